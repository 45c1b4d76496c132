"""Rows of several table pieces of a shard read and written with one indexing op.

A kernel keeps its tables' weights (and each optimizer state) in one buffer, and a piece's
tensor is a view of it at a row-aligned offset. :class:`RowBlocks` over such views (each
[R_t, *row]) sees the buffer as one [N, *row] tensor, so that (piece, row) pairs become rows of it
and the rows of many pieces (the fresh rows of every dynamic table of a step) are one gather or
one scatter. Views that do not share a buffer so are served one piece at a time.

Shape letters: P pieces, R_t rows of piece t, k (piece, row) pairs in a call.
"""

from __future__ import annotations

import math

import torch

from embedding_server.idmap.native import copy_rows, fill_rows, gather_rows, scatter_rows


def _one_buffer(views: list[torch.Tensor]) -> bool:
    """Whether every view is a contiguous, row-aligned block of the first view's storage."""
    v0 = views[0]
    width = math.prod(v0.shape[1:])
    return width > 0 and all(
        v.untyped_storage().data_ptr() == v0.untyped_storage().data_ptr()
        and v.dtype == v0.dtype
        and v.shape[1:] == v0.shape[1:]
        and v.is_contiguous()
        and v.storage_offset() % width == 0
        for v in views
    )


class RowBlocks:
    """Rows of ``views`` (one per piece, each [R_t, *row]) by (piece, row).

    Example:
        >>> buf = torch.arange(12.0).view(6, 2)
        >>> b = RowBlocks([buf[:2], buf[2:]])  # piece 0: rows 0-1, piece 1: rows 2-5
        >>> b.read(torch.tensor([1, 0]), torch.tensor([3, 1]))
        tensor([[10., 11.],
                [ 2.,  3.]])
    """

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views
        self.flat: torch.Tensor | None = None  # [N, *row] the whole buffer
        if views and _one_buffer(views):
            v0, width = views[0], math.prod(views[0].shape[1:])
            n = v0.untyped_storage().nbytes() // v0.element_size() // width
            self.flat = v0.as_strided((n, *v0.shape[1:]), (width, *v0.stride()[1:]), 0)
            # [P]
            self.base = torch.tensor(
                [v.storage_offset() // width for v in views], dtype=torch.int64
            )

    def read(self, pieces: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` [k] of pieces ``pieces`` [k] -> a copy [k, *row]."""
        # in C where it is built (native.py), else index_select (far cheaper than flat[index])
        if self.flat is not None:
            at = self.base[pieces] + rows
            fast = gather_rows(self.flat, at)
            return fast if fast is not None else self.flat.index_select(0, at)
        out = torch.empty((rows.numel(), *self.views[0].shape[1:]), dtype=self.views[0].dtype)
        for p in torch.unique(pieces).tolist():
            at = torch.nonzero(pieces == p).squeeze(1)
            out[at] = self.views[p][rows[at]]
        return out

    def write(self, pieces: torch.Tensor, rows: torch.Tensor, values: torch.Tensor | float) -> None:
        """Set rows ``rows`` [k] of pieces ``pieces`` [k] to ``values`` ([k, *row], or one
        number)."""
        if self.flat is not None:  # the rows (pieces, rows) are distinct
            at = self.base[pieces] + rows
            if isinstance(values, torch.Tensor):
                values = values.to(self.flat.dtype)
                if not scatter_rows(self.flat, at, values):  # in C where it is built
                    self.flat.index_copy_(0, at, values)
            elif not fill_rows(self.flat, at, values):
                self.flat.index_fill_(0, at, values)
            return
        for p in torch.unique(pieces).tolist():
            at = torch.nonzero(pieces == p).squeeze(1)
            self.views[p][rows[at]] = values if not isinstance(values, torch.Tensor) else values[at]

    def copy(self, pieces: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows ``dst`` [k] of pieces ``pieces`` [k] = rows ``src`` [k] of the same pieces (``dst``
        distinct and none of them among ``src``): :meth:`write` of :meth:`read`, without the copy
        between where the views share a buffer (in C where it is built)."""
        if self.flat is not None:
            base = self.base[pieces]
            if copy_rows(self.flat, base + src, base + dst):
                return
        self.write(pieces, dst, self.read(pieces, src))
