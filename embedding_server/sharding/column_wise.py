"""Column-wise: a table's dims split over servers; each server holds every row, some columns.

    input_dist:  every piece's server gets the whole bag
    lookup:      each server pools its columns
    output_dist: the trainer concatenates the column slices in order; the gradient is sliced
                 the same way

With row-wise Adagrad each column piece keeps its own accumulator over its own columns (as in
TorchRec); element-wise optimizers (Adagrad, Adam, SGD) are exactly the unsharded maths.
"""

from __future__ import annotations

import torch


def route(
    values: torch.Tensor, lengths: torch.Tensor, pieces, table
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(values, lengths)] * len(pieces)


def combine(outputs: list[torch.Tensor], lengths: torch.Tensor, table) -> torch.Tensor:
    return torch.cat(outputs, dim=1)


def split_grad(grad: torch.Tensor, lengths: torch.Tensor, pieces, table) -> list[torch.Tensor]:
    return [grad[:, p.col_start : p.col_start + p.dim] for p in pieces]
