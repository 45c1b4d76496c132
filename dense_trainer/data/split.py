"""The validation split: a fixed share of the training rows held out for validation.

A row is held out by a hash of (its file's place in the training list, its row number), so
the choice does not depend on the input format (a table's CSV and Parquet agree), the block
grid, the number of trainers or parse workers, the batch size, or any earlier run: every
trainer and every rerun on the same files agrees, and a validation row is never trained on.
``train.validation`` sets the share; ``--valid FILE`` names validation files instead (the
training rows are then all trained on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_FILE_SHIFT = np.uint64(40)  # lines below 2**40 per file


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of uint64 [n] (wrapping arithmetic): uniform, stable bits."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class RowSplit:
    """Which of a training file's rows a loader keeps.

    Attributes:
        fraction: the share of rows held out for validation, in (0, 1).
        side: ``train`` keeps the other rows, ``validation`` the held-out ones.
        seed: another seed holds out other rows.
    """

    fraction: float
    side: Literal["train", "validation"]
    seed: int = 0

    def keep(self, file_index: int, lines: np.ndarray) -> np.ndarray:
        """Rows to keep (bool [n]) of file ``file_index``'s rows at ``lines`` (int64 [n])."""
        key = (np.uint64(file_index) << _FILE_SHIFT) ^ lines.astype(np.uint64)
        key ^= _splitmix64(np.array([self.seed], dtype=np.uint64))
        unit = (_splitmix64(key) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
        held = unit < self.fraction
        return held if self.side == "validation" else ~held

    @property
    def reports_bad_lines(self) -> bool:
        """The training side reports the files' malformed lines; validation would repeat them."""
        return self.side == "train"
