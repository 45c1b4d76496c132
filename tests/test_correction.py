"""Corrected early lookups (``embedding_server/runtime/correction.py``): a lookup run before an
update,
patched with the bags that update changed, equals the lookup run after it, bit for bit."""

import pytest
import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import TableSpec
from embedding_server.kernels.optimizers import SparseOptimizerConfig
from embedding_server.local_table import LocalTable
from embedding_server.runtime.correction import (
    RowMarks,
    applies,
    changed_bags,
    correction_messages,
    message_capacity,
    patch,
    relookup,
)
from embedding_server.shard import EmbeddingShard

ROWS, DIMS = [40, 500, 6], [8, 16, 4]
FEATURE_MAP = [0, 1, 1, 2]  # features 1 and 2 share a table


def test_changed_bags_marks_bags_holding_a_touched_row():
    lengths = torch.tensor([[2, 0, 1, 2]])  # one slot, bags {3,5} {} {7} {1,9}
    hit = torch.tensor([False, True, False, False, True])  # 5 and 9 were trained
    assert changed_bags(hit, lengths).tolist() == [[True, False, False, True]]
    assert not changed_bags(torch.zeros(5, dtype=torch.bool), lengths).any()


def test_row_marks_keep_the_last_lookup_only_and_separate_pieces():
    tables = [
        LocalTable(TableSpec(name=f"T{i}", rows=r, dim=d), i)
        for i, (r, d) in enumerate(zip(ROWS, DIMS, strict=True))
    ]
    marks = RowMarks(EmbeddingShard(tables, SparseOptimizerConfig(), feature_map=FEATURE_MAP))
    # 4 slots, one bag each; slots 1 and 2 read table 1
    lengths = torch.tensor([[1], [1], [1], [1]])
    first = marks.keys_of(torch.tensor([3, 7, 8, 2]), lengths)
    assert not marks.hits(first).any()  # nothing marked yet
    marks.remember(first)
    # row 3 of table 0 and row 8 of table 1 (read by slot 1 now) were trained; row 4 of table 2 was
    # not
    second = marks.keys_of(torch.tensor([3, 8, 5, 4]), lengths)
    assert marks.hits(second).tolist() == [True, True, False, False]
    marks.remember(second)
    assert marks.hits(first).tolist() == [True, False, True, False]  # only the second lookup's rows


def test_patch_reads_mask_then_vectors_per_slot():
    block = torch.zeros(3, 6)  # B = 3, slots of dims 2 and 4
    message = torch.tensor(
        [
            0,
            1,
            0,
            7,
            8,  # slot 0: bag 1 -> [7, 8]
            # slot 1: bags 0, 2
            1,
            0,
            1,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
        ],
        dtype=torch.float32,
    )
    assert patch(block, message, [2, 4]) == message.numel() <= message_capacity(3, [2, 4])
    assert block.tolist() == [[0, 0, 1, 2, 3, 4], [7, 8, 0, 0, 0, 0], [0, 0, 5, 6, 7, 8]]


def batch(seed: int, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per feature (values, lengths [b]) of a multi-hot batch with hot rows (so bags repeat)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, 4, (b,), generator=g) for _ in FEATURE_MAP]
    values = [
        torch.randint(0, min(ROWS[t], 30), (int(n.sum()),), generator=g)
        for t, n in zip(FEATURE_MAP, lengths, strict=True)
    ]
    return values, lengths


def sparse(values, lengths) -> SparseFeatures:
    return SparseFeatures.from_lengths(torch.cat(values), torch.stack(lengths))


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_early_lookup_patched_equals_lookup_after_the_update(pooling):
    def shard():
        tables = [
            LocalTable(TableSpec(name=f"T{i}", rows=r, dim=d, pooling=pooling), i)
            for i, (r, d) in enumerate(zip(ROWS, DIMS, strict=True))
        ]
        return EmbeddingShard(
            tables, SparseOptimizerConfig(lr=0.5), seed=3, init_scale=0.5, feature_map=FEATURE_MAP
        )

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
    marks = RowMarks(early)
    marks.remember(marks.keys_of(torch.cat(prev[0]), torch.stack(prev[1])))
    values, lengths = torch.cat(nxt[0]), torch.stack(nxt[1])
    masks = changed_bags(marks.hits(marks.keys_of(values, lengths)), lengths)  # [S, B]
    assert masks.any(1).all() and not masks.all(1).any()
    assert not torch.equal(stale, want.detach())  # the early lookup is stale where bags changed
    fresh = relookup(early, values, lengths, masks)
    batches = [40, 24]  # two trainers' examples
    got = []
    for part, msg in zip(
        torch.split(stale, batches),
        correction_messages(masks, fresh, batches, dims, torch.float32),
        strict=True,
    ):
        block = part.clone()
        patch(block, msg, dims)
        got.append(block)
    assert torch.equal(torch.cat(got), want.detach())
    # ... and batch i+1's update, through the early lookup, leaves the tables lockstep's
    want.backward(grad.flip(0))
    early_next.backward(grad.flip(0))
    for a, b in zip(lockstep.export_state().values(), early.export_state().values(), strict=True):
        assert torch.equal(a, b)
