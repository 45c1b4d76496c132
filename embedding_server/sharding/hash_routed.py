"""Row-wise for dynamic tables: rows split in contiguous blocks, ids routed by their hash.

input_dist:  each raw id goes to the piece holding its shared index (``idmap/pieces.py``),
             unchanged (that server's id map gives it a row); a bag becomes one sub-bag per
             server (possibly empty)
lookup:      each server maps its ids to rows and sum-pools its sub-bags
output_dist: as row-wise: the trainer adds the servers' partial sums (and divides by the
             whole bag's length for mean pooling); the gradient of the sum goes to every
             server alike
"""

from __future__ import annotations

import torch

from embedding_server.idmap.pieces import PieceLayout
from embedding_server.sharding.row_wise import combine, split_grad

__all__ = ["combine", "route", "split_grad"]


def route(
    values: torch.Tensor, lengths: torch.Tensor, pieces, table
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(pieces) != pieces[0].row_pieces:
        raise ValueError(
            f"table {table.name}: {len(pieces)} pieces of a {pieces[0].row_pieces}-way split by "
            "rows"
        )
    b = lengths.numel()
    bag = torch.repeat_interleave(torch.arange(b), lengths)  # bag of each id
    # [N]
    where = PieceLayout.of(table.rows, table.dynamic, len(pieces), table.name).piece_of(values)
    out = []
    for i in range(len(pieces)):
        sel = where == i
        out.append((values[sel], torch.bincount(bag[sel], minlength=b)))
    return out
