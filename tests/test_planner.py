"""Sharding planner, the three sharding schemes, and the id wire format."""

import pytest
import torch

from dlrm_core.errors import ConfigError
from dlrm_core.schema import DynamicIds, FeatureSpec, TableSpec, criteo_spec
from embedding_server.idmap.dynamic import shared_rows_of
from embedding_server.idmap.pieces import PieceLayout
from embedding_server.planner import Piece, describe_plan, parse_bytes, plan_sharding
from embedding_server.sharding import column_wise, hash_routed, row_wise, table_wise
from embedding_server.wire import pack_ids, unpack_ids

SPEC = criteo_spec([1000] * 20 + [100_000] * 6, [16] * 26)


def covered(plan, spec):
    """Every (row, column) of every table is held by exactly one piece."""
    for t in spec.tables:
        cells = torch.zeros(t.rows, t.dim, dtype=torch.int32)
        for p in plan.pieces_of(t.name):
            cells[p.row_start : p.row_start + p.rows, p.col_start : p.col_start + p.dim] += 1
        assert bool((cells == 1).all()), t.name


@pytest.mark.parametrize("strategy", ["auto", "table_wise", "row_wise", "column_wise"])
@pytest.mark.parametrize("servers", [1, 2, 3])
def test_every_cell_placed_once(strategy, servers):
    plan = plan_sharding(SPEC, servers, "rowwise_adagrad", strategy)
    covered(plan, SPEC)
    assert {p.server for p in plan.pieces} <= set(range(servers))


def test_auto_balances_and_splits_what_does_not_fit():
    plan = plan_sharding(SPEC, 2, "rowwise_adagrad", "auto")
    assert all(p.kind == "table_wise" for p in plan.pieces)
    loads = [sum(1 for p in plan.pieces_on(s)) for s in range(2)]
    assert abs(loads[0] - loads[1]) <= 2
    big = criteo_spec([1000] * 25 + [10_000_000], [16] * 26)
    plan = plan_sharding(big, 3, "rowwise_adagrad", "auto", server_memory=parse_bytes("400MB"))
    assert plan.kind_of("C26") == "row_wise" and len(plan.pieces_of("C26")) == 3


def test_refuses_a_model_that_cannot_fit_naming_table_and_shortfall():
    big = criteo_spec([1000] * 25 + [10_000_000], [16] * 26)
    with pytest.raises(ConfigError, match=r"table C26 .* short"):
        plan_sharding(big, 1, "rowwise_adagrad", "auto", server_memory=parse_bytes("100MB"))
    with pytest.raises(ConfigError, match=r"table C26 does not fit: split row-wise over 2"):
        plan_sharding(big, 2, "adam", "auto", server_memory=parse_bytes("300MB"))


def test_parse_bytes_and_describe():
    assert (
        parse_bytes("8GB") == 8 << 30
        and parse_bytes("512MiB") == 512 << 20
        and parse_bytes("1000") == 1000
    )
    with pytest.raises(ConfigError):
        parse_bytes("lots")
    text = describe_plan(plan_sharding(SPEC, 2, "sgd", "row_wise"), SPEC, "sgd", 512)
    assert "imbalance" in text and "C26[rows 50000:100000]" in text


def test_column_wise_dims_are_multiples_of_four():
    spec = criteo_spec([100] * 26, [24] * 26)
    plan = plan_sharding(spec, 4, "sgd", "column_wise")
    assert sorted(p.dim for p in plan.pieces_of("C1")) == [4, 4, 8, 8]


TABLE = TableSpec(name="t", rows=10, dim=4, pooling="mean")


def test_row_wise_route_combine_split():
    pieces = [
        Piece(
            table="t",
            table_index=0,
            server=s,
            kind="row_wise",
            row_start=5 * s,
            rows=5,
            col_start=0,
            dim=4,
        )
        for s in range(2)
    ]
    values, lengths = torch.tensor([1, 7, 9, 3, 4]), torch.tensor([2, 0, 3])
    parts = row_wise.route(values, lengths, pieces, TABLE)
    assert parts[0][0].tolist() == [1, 3, 4] and parts[0][1].tolist() == [1, 0, 2]
    assert parts[1][0].tolist() == [2, 4] and parts[1][1].tolist() == [1, 0, 1]
    out = row_wise.combine([torch.ones(3, 4), 2 * torch.ones(3, 4)], lengths, TABLE)
    assert out[0].tolist() == [1.5] * 4 and out[1].tolist() == [3.0] * 4  # empty bag: /1, no NaN
    grads = row_wise.split_grad(torch.ones(3, 4), lengths, pieces, TABLE)
    assert len(grads) == 2
    torch.testing.assert_close(grads[0][2], torch.full((4,), 1 / 3))


def test_column_and_table_wise():
    pieces = [
        Piece(
            table="t",
            table_index=0,
            server=s,
            kind="column_wise",
            row_start=0,
            rows=10,
            col_start=2 * s,
            dim=2,
        )
        for s in range(2)
    ]
    values, lengths = torch.tensor([1, 2]), torch.tensor([1, 1])
    assert all(torch.equal(v, values) for v, _ in column_wise.route(values, lengths, pieces, TABLE))
    out = column_wise.combine([torch.zeros(2, 2), torch.ones(2, 2)], lengths, TABLE)
    assert out.tolist() == [[0, 0, 1, 1]] * 2
    assert [
        g.shape[1] for g in column_wise.split_grad(torch.ones(2, 4), lengths, pieces, TABLE)
    ] == [2, 2]
    assert table_wise.route(values, lengths, pieces[:1], TABLE)[0][0] is values


def test_id_payload_round_trip():
    parts = [
        (torch.tensor([5, 6, 7]), torch.tensor([2, 1])),
        (torch.tensor([], dtype=torch.int64), torch.tensor([0, 0])),
    ]
    payload = pack_ids(parts)
    back = unpack_ids(payload, batch=2, num_pieces=2)
    one_hot = pack_ids([(torch.tensor([4, 9]), torch.tensor([1, 1]))], torch.int32)
    assert one_hot.dtype == torch.int32 and one_hot.tolist() == [1, 4, 9]  # lengths implied
    assert [t.tolist() for t in unpack_ids(one_hot, batch=2, num_pieces=1)[0]] == [[4, 9], [1, 1]]
    for (v, ln), (v2, ln2) in zip(parts, back, strict=True):
        assert torch.equal(v, v2) and torch.equal(ln, ln2)


def test_dynamic_tables_split_by_rows_route_each_id_to_its_shared_row():
    dynamic = DynamicIds(shared_rows=0.1)
    spec = FeatureSpec(dense=[], tables=[TableSpec(name="C1", rows=10_000, dim=8, dynamic=dynamic)])
    plan = plan_sharding(spec, 3, "rowwise_adagrad", "auto", server_memory=parse_bytes("200KB"))
    pieces = plan.pieces_of("C1")
    assert [(p.kind, p.row_pieces) for p in pieces] == [("row_wise", 3)] * 3
    layout = PieceLayout.of(10_000, dynamic, 3)
    ids = torch.randint(-(2**62), 2**62, (60_000,))
    where, shared = layout.piece_of(ids), layout.shared_row(ids)
    starts, s_starts = torch.tensor(layout.row_starts), torch.tensor(layout.shared_starts)
    s_p = s_starts[1:] - s_starts[:-1]  # [P] shared rows of each piece: its first local rows
    assert bool(((shared >= starts[where]) & (shared < starts[where] + s_p[where])).all())
    # balanced by hash
    assert torch.bincount(where).tolist() == pytest.approx([20_000] * 3, rel=0.05)
    # The trainer routes the raw ids there, unchanged (the server's map gives them rows).
    routed = hash_routed.route(ids, torch.ones(60_000, dtype=torch.int64), pieces, spec.tables[0])
    assert all(torch.equal(values, ids[where == i]) for i, (values, _) in enumerate(routed))
    # one piece: hash % S
    assert torch.equal(PieceLayout.of(10_000, dynamic).shared_row(ids), shared_rows_of(ids, 1000))
    # Shared rows (so ids) in proportion to the blocks' rows: a short last block gets its share
    # only.
    short = PieceLayout.of(100, dynamic, 9)  # blocks of 12 rows, the last 4; S = 10
    assert torch.tensor(short.shared_starts).diff().tolist() == [2] + [1] * 8
    assert torch.tensor(short.row_starts).diff().tolist() == [12] * 8 + [4]
    tiny = FeatureSpec(dense=[], tables=[TableSpec(name="C2", rows=12, dim=8, dynamic=dynamic)])
    with pytest.raises(
        ConfigError,
        match=r"table C2: 12 rows with 1 shared row\(s\) cannot be split by rows in 2 blocks",
    ):
        plan_sharding(tiny, 2, "rowwise_adagrad", "row_wise")
