"""CPU primitives the id maps use on every lookup, where numpy's are several times faster than
torch's (torch 2.x on CPU: ``nonzero`` is branchy and single-threaded, ``argsort`` has a large
fixed cost below ~50k elements; numpy's ``flatnonzero`` and vectorised ``sort`` are not).

Both take and give torch tensors (numpy views, no copies); other devices use torch's own.

Shape letters: n elements.
"""

from __future__ import annotations

import numpy as np
import torch


def where_true(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the true elements of a 1-d bool ``mask`` [n], ascending -> int64 [k]:
    ``torch.nonzero(mask).squeeze(1)``."""
    if mask.device.type != "cpu":
        return torch.nonzero(mask).squeeze(1)
    return torch.from_numpy(np.flatnonzero(mask.contiguous().numpy()).astype(np.int64, copy=False))


def sort_distinct(key: torch.Tensor) -> torch.Tensor:
    """Distinct int64 keys [n] sorted ascending -> int64 [n] (an unstable sort is exact on
    distinct keys; a key that packs its position makes the order readable from it)."""
    if key.device.type != "cpu":
        return torch.sort(key).values
    return torch.from_numpy(np.sort(key.contiguous().numpy()))


def bits(value: int) -> int:
    """Bits that hold every integer in [0, value]."""
    return max(1, int(value).bit_length())
