"""Row-wise: a table's rows split in contiguous blocks, one per server.

input_dist:  each id goes to the server holding its row (block = id // rows_per_block),
             as a local row (id - block start); a bag becomes one sub-bag per server
             (possibly empty)
lookup:      each server sum-pools its sub-bags
output_dist: the trainer adds the servers' partial sums (and divides by the whole bag's
             length for mean pooling); the gradient of the sum goes to every server alike
"""

from __future__ import annotations

import torch


def route(
    values: torch.Tensor, lengths: torch.Tensor, pieces, table
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    b = lengths.numel()
    bag = torch.repeat_interleave(torch.arange(b), lengths)  # bag of each id
    out = []
    for p in pieces:
        sel = (values >= p.row_start) & (values < p.row_start + p.rows)
        out.append((values[sel] - p.row_start, torch.bincount(bag[sel], minlength=b)))
    return out


def _mean_scale(lengths: torch.Tensor, table) -> torch.Tensor | None:
    if table.pooling != "mean":
        return None
    return 1.0 / lengths.clamp(min=1).to(torch.float32).unsqueeze(1)  # [B, 1]


def combine(outputs: list[torch.Tensor], lengths: torch.Tensor, table) -> torch.Tensor:
    total = torch.stack(outputs).sum(dim=0)  # [B, D]
    scale = _mean_scale(lengths, table)
    return total if scale is None else total * scale


def split_grad(grad: torch.Tensor, lengths: torch.Tensor, pieces, table) -> list[torch.Tensor]:
    scale = _mean_scale(lengths, table)
    g = grad if scale is None else grad * scale
    return [g] * len(pieces)
