"""A training batch and its position in the input stream."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from embedding_server.sparse import SparseFeatures


@dataclass(frozen=True)
class Position:
    """Where the next unread example is: resuming there continues the stream exactly.

    ``block_offset``/``block_line`` locate the start of a parsed block in file ``file_index``
    (byte offset in the decompressed stream, 1-based line number); ``rows_into_block`` valid
    rows of that block are already consumed.
    """

    epoch: int = 0
    file_index: int = 0
    block_offset: int = 0
    block_line: int = 1
    rows_into_block: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Batch:
    """B examples: dense float [B, I], sparse ids of F features, labels float [B]."""

    dense: torch.Tensor
    sparse: SparseFeatures
    labels: torch.Tensor
    position: Position | None = None

    @property
    def batch_size(self) -> int:
        return self.labels.numel()

    def share(self, index: int, parts: int) -> Batch:
        """Data-parallel share ``index`` of ``parts`` (contiguous, sizes differ by at most one)."""
        b = self.batch_size
        start, stop = index * b // parts, (index + 1) * b // parts
        return Batch(
            self.dense[start:stop], self.sparse.slice_examples(start, stop), self.labels[start:stop], self.position
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.position,
        )
