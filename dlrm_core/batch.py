"""A batch of model inputs, as it crosses from data to embeddings and the dense network.

``SparseFeatures`` is the id batch: a jagged tensor in TBE layout. A batch of B examples with F
sparse features is F*B bags, stored feature-major, the layout fbgemm's table-batched embedding
(TBE) kernels take: bag ``(f, b)`` holds the rows ``values[offsets[f*B + b] : offsets[f*B + b +
1]]``
of feature f's table. ``Batch`` adds the dense features and labels, and ``Position`` says where in
the input stream the batch ends, so that a resumed run reads exactly what an uninterrupted one
would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class SparseFeatures:
    """Row ids of F features for B examples.

    Attributes:
        values: int64 [N], row ids already hashed into each feature's table.
        offsets: int64 [F*B + 1], bag boundaries in ``values``, feature-major.
        batch_size: B.
    """

    values: torch.Tensor
    offsets: torch.Tensor
    batch_size: int

    @property
    def num_features(self) -> int:
        return (self.offsets.numel() - 1) // max(self.batch_size, 1)

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor) -> SparseFeatures:
        """Build from per-bag lengths, int [F, B]."""
        f, b = lengths.shape
        offsets = torch.zeros(f * b + 1, dtype=torch.int64)
        torch.cumsum(lengths.reshape(-1).to(torch.int64), 0, out=offsets[1:])
        return cls(values=values.to(torch.int64), offsets=offsets, batch_size=b)

    @classmethod
    def one_hot(cls, ids: torch.Tensor) -> SparseFeatures:
        """Build from one id per bag, int [F, B]."""
        f, b = ids.shape
        return cls(
            values=ids.reshape(-1).to(torch.int64),
            offsets=torch.arange(f * b + 1, dtype=torch.int64),
            batch_size=b,
        )

    def lengths(self) -> torch.Tensor:
        """Bag lengths, int64 [F, B]."""
        return (self.offsets[1:] - self.offsets[:-1]).view(-1, self.batch_size)

    def feature_values(self, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids of feature f and its B+1 offsets (rebased to 0)."""
        b = self.batch_size
        offs = self.offsets[f * b : (f + 1) * b + 1]
        return self.values[offs[0] : offs[-1]], offs - offs[0]

    def select_features(self, features: list[int]) -> SparseFeatures:
        """The sub-batch of some features, in the given order (used to route ids to shards)."""
        vals, offs, base = [], [torch.zeros(1, dtype=torch.int64)], 0
        for f in features:
            v, o = self.feature_values(f)
            vals.append(v)
            offs.append(o[1:] + base)
            base += v.numel()
        values = torch.cat(vals) if vals else self.values[:0]
        return SparseFeatures(values=values, offsets=torch.cat(offs), batch_size=self.batch_size)

    def slice_examples(self, start: int, stop: int) -> SparseFeatures:
        """The bags of examples [start, stop) of every feature (a trainer's share of a batch)."""
        b, f = self.batch_size, self.num_features
        if bool((self.offsets[1:] - self.offsets[:-1] == 1).all()) and self.values.numel() == f * b:
            return SparseFeatures.one_hot(self.values.view(f, b)[:, start:stop])
        lengths = self.lengths()[:, start:stop]  # [F, b']
        parts = [
            self.values[self.offsets[i * b + start] : self.offsets[i * b + stop]] for i in range(f)
        ]
        return SparseFeatures.from_lengths(torch.cat(parts), lengths)

    @classmethod
    def cat(cls, parts: list[SparseFeatures]) -> SparseFeatures:
        """The examples of several batches (same features) side by side, in order."""
        f = parts[0].num_features
        # one-hot: [F, B_i] blocks
        if all(p.values.numel() == p.offsets.numel() - 1 for p in parts):
            return cls.one_hot(torch.cat([p.values.view(f, p.batch_size) for p in parts], dim=1))
        values = torch.cat([p.feature_values(k)[0] for k in range(f) for p in parts])
        return cls.from_lengths(values, torch.cat([p.lengths() for p in parts], dim=1))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseFeatures:
        return SparseFeatures(
            values=self.values.to(device, non_blocking=non_blocking),
            offsets=self.offsets.to(device, non_blocking=non_blocking),
            batch_size=self.batch_size,
        )

    def pin_memory(self) -> SparseFeatures:
        return SparseFeatures(self.values.pin_memory(), self.offsets.pin_memory(), self.batch_size)


@dataclass(frozen=True)
class Position:
    """Where the next unread example is: resuming there continues the stream exactly.

    ``block_offset``/``block_line`` locate the start of a parsed block in file ``file_index``
    (byte offset in the decompressed stream, or row of a Parquet file; 1-based line number);
    ``block`` is that block's number in the epoch (all files together: a trainer of T reads the
    blocks whose number is its rank modulo T); ``rows_into_block`` valid rows of that block are
    already consumed.
    """

    epoch: int = 0
    file_index: int = 0
    block_offset: int = 0
    block_line: int = 1
    rows_into_block: int = 0
    block: int = 0

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

    @classmethod
    def cat(cls, parts: list[Batch]) -> Batch:
        """Several batches as one (the last one's position)."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            torch.cat([p.dense for p in parts]),
            SparseFeatures.cat([p.sparse for p in parts]),
            torch.cat([p.labels for p in parts]),
            parts[-1].position,
        )

    def share(self, index: int, parts: int) -> Batch:
        """Data-parallel share ``index`` of ``parts`` (contiguous, sizes differ by at most one)."""
        b = self.batch_size
        start, stop = index * b // parts, (index + 1) * b // parts
        return Batch(
            self.dense[start:stop],
            self.sparse.slice_examples(start, stop),
            self.labels[start:stop],
            self.position,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.position,
        )
