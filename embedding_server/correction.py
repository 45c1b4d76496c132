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
from embedding_server.shard import EmbeddingShard
from embedding_server.transport import CORRECT, Pending

Ids = list[list[tuple[torch.Tensor, torch.Tensor]]]
"""Per trainer, per slot: (values int64 [n], lengths int64 [B_r]) (``wire.unpack_ids``)."""


def applies(shard: EmbeddingShard) -> bool:
    """Whether a shard's lookup may run ahead of its update and be corrected afterwards."""
    return shard.kernel_name == "fbgemm" and not shard.id_maps


def changed_bags(values: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bool [B]: the bags (values [n], lengths [B]) that hold one of ``rows`` (int64 [k])."""
    hit = torch.isin(values, rows)  # [n]
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # [n]: each value's bag
    out = torch.zeros(lengths.numel(), dtype=torch.bool)
    out[bag[hit]] = True
    return out


def relookup(shard: EmbeddingShard, values: list[torch.Tensor], lengths: list[torch.Tensor],
             masks: list[torch.Tensor]) -> torch.Tensor:
    """Pooled vectors [B, width] of the bags in ``masks`` (per slot, bool [B]); every other bag is
    emptied (its row of the result is not to be used)."""
    kept = [v[torch.repeat_interleave(m, n)] for v, n, m in zip(values, lengths, masks, strict=True)]
    sub = SparseFeatures.from_lengths(torch.cat(kept), torch.stack([n * m for n, m in zip(lengths, masks, strict=True)]))
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


def correction_messages(masks: list[torch.Tensor], fresh: torch.Tensor | None, batches: list[int],
                        dims: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Per trainer r, its correction message: per slot j its mask [B_r] and its recomputed
    vectors [n, d_j], flat. masks: per slot, bool [sum B_r]; fresh: :func:`relookup`'s
    [sum B_r, sum(dims)] (None: nothing changed)."""
    starts = [sum(batches[:r]) for r in range(len(batches) + 1)]
    cols = [sum(dims[:j]) for j in range(len(dims) + 1)]
    out = []
    for r in range(len(batches)):
        parts = []
        for j, m in enumerate(masks):
            mine = m[starts[r] : starts[r + 1]]  # [B_r]
            parts.append(mine.to(dtype))
            if fresh is not None and bool(mine.any()):
                rows = fresh[starts[r] : starts[r + 1], cols[j] : cols[j + 1]][mine]  # [n, d_j]
                parts.append(rows.reshape(-1).to(dtype))
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=dtype))
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

    def __init__(self, shards: list[EmbeddingShard], dims: list[list[int]], trainers: list[int],
                 wire_dtype: torch.dtype, transport, timings: dict[str, float]) -> None:
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
        self._last: list[Ids | None] = [None] * len(shards)  # per chunk: ids of the last training lookup
        self._sent: list[Pending] = []

    def touched(self, k: int) -> list[torch.Tensor]:
        """Per piece of chunk k's shard: the rows (int64, unique) the last training lookup trains."""
        shard, last = self.shards[k], self._last[k]
        per_piece: list[list[torch.Tensor]] = [[] for _ in shard.local_tables]
        for j, piece in enumerate(shard.feature_map):
            per_piece[piece].extend(ids[j][0] for ids in last)
        return [torch.unique(torch.cat(v)) if v else torch.zeros(0, dtype=torch.int64) for v in per_piece]

    def send(self, k: int, stale: bool, per_trainer: Ids, batches: list[int]) -> None:
        """Chunk k's correction of this lookup to every trainer. ``stale``: its lookup ran before
        the update just applied (the last lookup's); then remember this lookup's ids."""
        t0 = time.perf_counter()
        shard, slots = self.shards[k], range(len(self.dims[k]))
        values = [torch.cat([ids[j][0] for ids in per_trainer]) for j in slots]  # per slot [n_j]
        lengths = [torch.cat([ids[j][1] for ids in per_trainer]) for j in slots]  # per slot [sum B_r]
        if stale and self.early[k] and self._last[k] is not None:
            rows = self.touched(k)
            masks = [changed_bags(v, n, rows[shard.feature_map[j]]) for j, (v, n) in enumerate(zip(values, lengths,
                                                                                                   strict=True))]
        else:
            masks = [torch.zeros(sum(batches), dtype=torch.bool) for _ in slots]
        fresh = relookup(shard, values, lengths, masks) if any(bool(m.any()) for m in masks) else None
        messages = correction_messages(masks, fresh, batches, self.dims[k], self.wire_dtype)
        self._drain()
        self._sent.append(self.transport.send_floats(self.trainers, messages, CORRECT))
        self._last[k] = per_trainer
        self.timings["corrected_bags"] += float(sum(int(m.sum()) for m in masks))
        self.timings["bags"] += float(sum(batches) * len(masks))
        self.timings["correct_s"] += time.perf_counter() - t0

    def _drain(self) -> None:
        """Wait for the correction messages already sent (the trainers took them before their
        forward, so this does not block)."""
        while self._sent:
            self._sent.pop(0).wait()

    def close(self) -> None:
        """Wait for the last correction messages (the server stops)."""
        self._drain()
