"""The trainer's flat stage (``embedding_server/client/distributed.py``): with a table-wise plan it
moves
pooled vectors and gradients as column blocks; the result equals the general per-feature path
bit for bit, for one and several servers and chunks, and a whole-input message is not copied."""

import copy

import pytest
import torch

from dlrm_core.schema import criteo_spec
from embedding_server.client.distributed import FlatStage
from embedding_server.planner import plan_sharding

DIMS = [8, 4, 16, 8, 4, 8] * 4 + [8, 4]  # 26 features, mixed dims


def stages(servers: int, chunks: int, kind: str = "table_wise") -> tuple[FlatStage, FlatStage]:
    spec = criteo_spec([50 + 10 * i for i in range(len(DIMS))], DIMS)
    plan = plan_sharding(spec, servers, "rowwise_adagrad", kind)
    fast = FlatStage(plan, spec, servers, chunks)
    general = copy.copy(fast)
    general.runs = None
    return fast, general


@pytest.mark.parametrize(("servers", "chunks"), [(1, 1), (1, 3), (2, 1), (3, 2)])
def test_column_blocks_equal_the_per_feature_path(servers, chunks):
    fast, general = stages(servers, chunks)
    assert fast.runs is not None
    b = 5
    g = torch.Generator().manual_seed(servers * 10 + chunks)
    received = [torch.randn(n, generator=g) for _, n in fast.messages(b)]
    lengths = [torch.ones(b, dtype=torch.int64) for _ in DIMS]
    want = general.assemble([m.clone() for m in received], b, lengths)
    assert torch.equal(fast.assemble([m.clone() for m in received], b, lengths), want)
    grad = torch.randn(b, sum(DIMS), generator=g)
    got, ref = fast.split_grad(grad, b, lengths), general.split_grad(grad, b, lengths)
    assert [s for s, _ in got] == [s for s, _ in ref]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, ref, strict=True))


def test_a_whole_input_message_is_not_copied():
    fast, _ = stages(1, 1)
    b = 3
    (msg,) = [torch.randn(n) for _, n in fast.messages(b)]
    out = fast.assemble([msg], b, [torch.ones(b, dtype=torch.int64)] * len(DIMS))
    assert out.data_ptr() == msg.data_ptr() and out.shape == (b, sum(DIMS))
    grad = torch.randn(b, sum(DIMS))
    ((_, part),) = fast.split_grad(grad, b, [])
    assert part.data_ptr() == grad.data_ptr()


def test_row_wise_plans_keep_the_general_path():
    fast, _ = stages(2, 1, "row_wise")
    assert fast.runs is None
