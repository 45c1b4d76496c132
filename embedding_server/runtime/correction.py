"""Corrected early lookups: how ``pipeline = exact`` looks batch i+1 up before step i's update.

Lockstep puts the server's update (fbgemm's fused backward) and then the whole lookup of the
next batch between a step's gradients and the next dense forward. Here the lookup of batch i+1
runs as soon as its ids arrive, on the rows as they were before step i's update (as semi-sync
does), and its pooled vectors leave at once. When step i's gradients are in and applied, only
the bags of batch i+1 that hold a row step i updated are looked up again, and each trainer gets
a correction message, which it applies to the pooled vectors before its dense forward.

Why the result is lockstep's bit for bit: a bag none of whose rows step i touched reads the same
rows before and after the update; a bag that holds such a row is recomputed by the same kernel
on a sub-batch in which every other bag is emptied, and fbgemm pools each bag on its own (sum
and mean alike), so its vector is the one a full lookup gives. The early lookup stays the one
the backward of batch i+1 runs through; the recomputation runs without gradients.

Correction message (server -> trainer r, per chunk; the exchange dtype; tag ``CORRECT``), per
slot j of the chunk, in slot order::

    mask   [B_r]          1 where bag (example, slot j) was looked up again, else 0
    values [n_j, d_j]     the recomputed pooled vectors of those bags, in example order

The trainer's receive buffer holds B_r * (slots + width) elements; a message is shorter unless
every bag changed.

Where it does not apply, a chunk is looked up as before (update first, then the lookup) and its
correction message carries an all-zero mask: chunks with a dynamic-id table (their lookup admits
and evicts rows, so it cannot run ahead of an update) and chunks on the PyTorch kernel fallback
(its per-bag arithmetic is not checked here). Towers (their stage is not deferrable) and the
collective route (lockstep) keep today's exact path altogether.
"""

from __future__ import annotations

import time

import torch

from dlrm_core.batch import SparseFeatures
from embedding_server.runtime.transport import CORRECT, Pending
from embedding_server.shard import EmbeddingShard

Ids = list[list[tuple[torch.Tensor, torch.Tensor]]]
"""Per trainer, per slot: (values int64 [n], lengths int64 [B_r]) (``wire.unpack_ids``)."""


def applies(shard: EmbeddingShard) -> bool:
    """Whether a shard's lookup may run ahead of its update and be corrected afterwards."""
    return shard.kernel_name == "fbgemm" and not shard.id_maps


class RowMarks:
    """The rows one training lookup of a shard trains, as a bitmap over the shard's rows: one
    bool per row of every piece, in the shard's row space (piece p's row r at ``starts[p] + r``),
    so marking a lookup and testing the next one are a scatter and a gather over its ids (no sort,
    no per-slot loop). Its memory is one byte per row (1/64 of a dim-16 fp32 table).

    Args:
        shard: the shard whose rows it marks.
    """

    def __init__(self, shard: EmbeddingShard) -> None:
        rows = [t.spec.rows for t in shard.local_tables]
        starts = torch.tensor([sum(rows[:p]) for p in range(len(rows))], dtype=torch.int64)
        self.slot_start = starts[torch.tensor(shard.feature_map, dtype=torch.int64)]  # [S]
        self.marked = torch.zeros(sum(rows), dtype=torch.bool)
        self.keys: torch.Tensor | None = None  # the marked rows, in the shard's row space

    def keys_of(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Row-space keys int64 [n] of a lookup's values [n] (slot-major) with lengths [S, B]."""
        slot = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths.sum(1))  # [n]
        return values + self.slot_start[slot]

    def hits(self, keys: torch.Tensor) -> torch.Tensor:
        """bool [n]: which of ``keys`` the marked lookup trains (none when nothing is marked)."""
        if self.keys is None:
            return torch.zeros(keys.numel(), dtype=torch.bool)
        return self.marked.index_select(0, keys)

    def remember(self, keys: torch.Tensor) -> None:
        """Mark ``keys`` (this lookup's) instead of the previous lookup's."""
        if self.keys is not None:
            self.marked.index_fill_(0, self.keys, False)
        self.marked.index_fill_(0, keys, True)
        self.keys = keys


def changed_bags(hit: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """bool [S, B]: the bags (lengths [S, B], values slot-major) that hold a value with ``hit``
    (bool [n])."""
    # [n]: each value's bag
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.reshape(-1))
    out = torch.zeros(lengths.numel(), dtype=torch.bool)
    out[bag[hit]] = True
    return out.view(lengths.shape)


def relookup(
    shard: EmbeddingShard, values: torch.Tensor, lengths: torch.Tensor, masks: torch.Tensor
) -> torch.Tensor:
    """The pooled vectors of the bags in ``masks`` (bool [S, B]) of a lookup (values [n],
    slot-major; lengths [S, B]), compacted: float [B', width] with B' the most bags changed in
    any slot; slot j's changed bags, in example order, are rows [0, n_j) of its columns (the rest
    of its rows are empty bags, not to be used). A sub-batch of B' examples, not B: the kernel
    writes B' rows, not a whole batch's."""
    counts = masks.sum(1)  # [S]
    slot, bag = masks.nonzero(as_tuple=True)  # the changed bags, slot-major, example order
    place = (torch.cumsum(masks, 1) - 1)[slot, bag]  # each one's row in the sub-batch
    sub_lengths = torch.zeros(
        masks.shape[0], int(counts.max()) if counts.numel() else 0, dtype=lengths.dtype
    )
    sub_lengths[slot, place] = lengths[slot, bag]  # [S, B']
    # [n]: values of changed bags
    keep = torch.repeat_interleave(masks.reshape(-1), lengths.reshape(-1))
    sub = SparseFeatures.from_lengths(values[keep], sub_lengths)
    steps = [kernel.step for kernel in shard.kernels]
    with torch.no_grad():
        out = shard(sub)
    for kernel, step in zip(shard.kernels, steps, strict=True):
        kernel.step = step  # fbgemm counts every forward as an iteration: this one is not
    return out


def patch(block: torch.Tensor, message: torch.Tensor, dims: list[int]) -> int:
    """Apply one correction message to a received block [B, sum(dims)], in place; -> the
    message's length (its receive buffer may be longer)."""
    b = block.shape[0]
    pos, col = 0, 0
    for d in dims:
        mask = message[pos : pos + b] != 0  # [B]
        n = int(mask.sum())
        pos += b
        if n:
            block[mask, col : col + d] = message[pos : pos + n * d].view(n, d)
        pos += n * d
        col += d
    return pos


def correction_messages(
    masks: torch.Tensor,
    fresh: torch.Tensor | None,
    batches: list[int],
    dims: list[int],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Per trainer r, its correction message: per slot j its mask [B_r] and its recomputed
    vectors [n_rj, d_j], flat. masks: bool [S, sum B_r]; fresh: :func:`relookup`'s compacted
    [B', sum(dims)] (None: nothing changed). Trainer r's bags of slot j are, among slot j's
    changed bags, those after the earlier trainers' (examples are in trainer order)."""
    starts = [sum(batches[:r]) for r in range(len(batches) + 1)]
    cols = [sum(dims[:j]) for j in range(len(dims) + 1)]
    per_trainer = (
        torch.stack([masks[:, starts[r] : starts[r + 1]].sum(1) for r in range(len(batches))])
        if batches
        else torch.zeros(0, len(dims), dtype=torch.int64)
    )  # [T, S]
    first = (torch.cumsum(per_trainer, 0) - per_trainer).tolist()  # [T][S]: rows before trainer r's
    counts = per_trainer.tolist()
    out = []
    for r in range(len(batches)):
        flags = masks[:, starts[r] : starts[r + 1]].to(dtype)  # [S, B_r]
        if fresh is None or not any(counts[r]):
            out.append(flags.reshape(-1))
            continue
        parts = []
        for j in range(len(dims)):
            parts.append(flags[j])
            if counts[r][j]:
                a = first[r][j]
                parts.append(
                    fresh[a : a + counts[r][j], cols[j] : cols[j + 1]].reshape(-1).to(dtype)
                )
        out.append(torch.cat(parts))
    return out


def message_capacity(b: int, dims: list[int]) -> int:
    """Elements of a trainer's receive buffer for one chunk's correction of ``b`` examples."""
    return b * (len(dims) + sum(dims))


class Corrector:
    """A server's side of corrected lookups: which rows each chunk's pending update touches, and
    the correction messages of the next batch.

    Args:
        shards: the server's shard of each chunk.
        dims: per chunk, the dim of each of its slots.
        trainers: the trainer ranks.
        wire_dtype: the exchange dtype.
        transport: the point-to-point route.
        timings: the server's timings (gains ``correct_s``, ``corrected_bags``, ``bags``).
    """

    def __init__(
        self,
        shards: list[EmbeddingShard],
        dims: list[list[int]],
        trainers: list[int],
        wire_dtype: torch.dtype,
        transport,
        timings: dict[str, float],
    ) -> None:
        self.shards = shards
        self.dims = dims
        self.trainers = trainers
        self.wire_dtype = wire_dtype
        self.transport = transport
        self.timings = timings
        for key in ("correct_s", "corrected_bags", "bags"):
            timings.setdefault(key, 0.0)
        self.early = [applies(s) for s in shards]
        """Per chunk: whether its lookup runs before the pending update."""
        self._marks = [RowMarks(s) if e else None for s, e in zip(shards, self.early, strict=True)]
        """Per early chunk: the rows its last training lookup trains (the pending update's)."""
        self._sent: list[Pending] = []

    def send(self, k: int, stale: bool, per_trainer: Ids, batches: list[int]) -> None:
        """Chunk k's correction of this lookup to every trainer. ``stale``: its lookup ran before
        the update just applied (the last lookup's); then remember this lookup's rows."""
        t0 = time.perf_counter()
        shard, slots, marks = self.shards[k], range(len(self.dims[k])), self._marks[k]
        values = torch.cat([ids[j][0] for j in slots for ids in per_trainer])  # [n], slot-major
        # [S, sum B_r]
        lengths = torch.stack([torch.cat([ids[j][1] for ids in per_trainer]) for j in slots])
        keys = marks.keys_of(values, lengths) if marks is not None else None
        if stale and keys is not None:
            masks = changed_bags(marks.hits(keys), lengths)  # [S, sum B_r]
        else:
            masks = torch.zeros(lengths.shape, dtype=torch.bool)
        changed = int(masks.sum())
        fresh = relookup(shard, values, lengths, masks) if changed else None
        messages = correction_messages(masks, fresh, batches, self.dims[k], self.wire_dtype)
        self._drain()
        self._sent.append(self.transport.send_floats(self.trainers, messages, CORRECT))
        if keys is not None:
            marks.remember(keys)
        self.timings["corrected_bags"] += float(changed)
        self.timings["bags"] += float(masks.numel())
        self.timings["correct_s"] += time.perf_counter() - t0

    def _drain(self) -> None:
        """Wait for the correction messages already sent (the trainers took them before their
        forward, so this does not block)."""
        while self._sent:
            self._sent.pop(0).wait()

    def close(self) -> None:
        """Wait for the last correction messages (the server stops)."""
        self._drain()
