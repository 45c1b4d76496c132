"""Corrected early lookups (``embedding_server/correction.py``): a lookup run before an update,
patched with the bags that update changed, equals the lookup run after it, bit for bit."""

import pytest
import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import TableSpec
from embedding_server.correction import (
    applies,
    changed_bags,
    correction_messages,
    message_capacity,
    patch,
    relookup,
)
from embedding_server.local_table import LocalTable
from embedding_server.optimizers import SparseOptimizerConfig
from embedding_server.shard import EmbeddingShard

ROWS, DIMS = [40, 500, 6], [8, 16, 4]
FEATURE_MAP = [0, 1, 1, 2]  # features 1 and 2 share a table


def test_changed_bags_marks_bags_holding_a_touched_row():
    values = torch.tensor([3, 5, 7, 1, 9])
    lengths = torch.tensor([2, 0, 1, 2])  # bags {3,5} {} {7} {1,9}
    assert changed_bags(values, lengths, torch.tensor([5, 9])).tolist() == [True, False, False, True]
    assert not changed_bags(values, lengths, torch.zeros(0, dtype=torch.int64)).any()


def test_patch_reads_mask_then_vectors_per_slot():
    block = torch.zeros(3, 6)  # B = 3, slots of dims 2 and 4
    message = torch.tensor([0, 1, 0, 7, 8,  # slot 0: bag 1 -> [7, 8]
                            1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.float32)  # slot 1: bags 0, 2
    assert patch(block, message, [2, 4]) == message.numel() <= message_capacity(3, [2, 4])
    assert block.tolist() == [[0, 0, 1, 2, 3, 4], [7, 8, 0, 0, 0, 0], [0, 0, 5, 6, 7, 8]]


def batch(seed: int, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per feature (values, lengths [b]) of a multi-hot batch with hot rows (so bags repeat)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, 4, (b,), generator=g) for _ in FEATURE_MAP]
    values = [torch.randint(0, min(ROWS[t], 30), (int(n.sum()),), generator=g)
              for t, n in zip(FEATURE_MAP, lengths, strict=True)]
    return values, lengths


def sparse(values, lengths) -> SparseFeatures:
    return SparseFeatures.from_lengths(torch.cat(values), torch.stack(lengths))


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_early_lookup_patched_equals_lookup_after_the_update(pooling):
    def shard():
        tables = [LocalTable(TableSpec(name=f"T{i}", rows=r, dim=d, pooling=pooling), i)
                  for i, (r, d) in enumerate(zip(ROWS, DIMS, strict=True))]
        return EmbeddingShard(tables, SparseOptimizerConfig(lr=0.5), seed=3, init_scale=0.5, feature_map=FEATURE_MAP)

    lockstep, early = shard(), shard()
    assert applies(early)
    dims = [DIMS[t] for t in FEATURE_MAP]
    prev, nxt = batch(0, 64), batch(1, 64)
    grad = torch.randn(64, sum(dims), generator=torch.Generator().manual_seed(2))
    # lockstep: step i's update, then batch i+1's lookup
    lockstep(sparse(*prev)).backward(grad)
    want = lockstep(sparse(*nxt))  # [B, width]
    # early: batch i+1 looked up first, on the rows before step i's update; then the update
    pooled_prev = early(sparse(*prev))
    early_next = early(sparse(*nxt))  # the graph batch i+1's backward runs through
    stale = early_next.detach().clone()
    pooled_prev.backward(grad)
    touched = [torch.unique(torch.cat([v for v, t in zip(prev[0], FEATURE_MAP, strict=True) if t == p]))
               for p in range(len(ROWS))]
    masks = [changed_bags(v, n, touched[t]) for v, n, t in zip(*nxt, FEATURE_MAP, strict=True)]
    assert all(m.any() for m in masks) and not all(m.all() for m in masks)
    assert not torch.equal(stale, want.detach())  # the early lookup is stale where bags changed
    fresh = relookup(early, *nxt, masks)
    batches = [40, 24]  # two trainers' examples
    got = []
    for part, msg in zip(torch.split(stale, batches), correction_messages(masks, fresh, batches, dims,
                                                                          torch.float32), strict=True):
        block = part.clone()
        patch(block, msg, dims)
        got.append(block)
    assert torch.equal(torch.cat(got), want.detach())
    # ... and batch i+1's update, through the early lookup, leaves the tables lockstep's
    want.backward(grad.flip(0))
    early_next.backward(grad.flip(0))
    for a, b in zip(lockstep.export_state().values(), early.export_state().values(), strict=True):
        assert torch.equal(a, b)
