"""A shard's id maps admitted and evicted together (``idmap/batched.py``) make exactly the
decisions of one ``DynamicIdMap`` per table: the same rows for the same ids, the same rows reset,
the same state (hash buckets, sketches, free stacks, counters) after every step."""

import pytest
import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import DynamicIds, TableSpec
from embedding_server.idmap.dynamic import DynamicIdMap, shared_rows_of
from embedding_server.idmap.hash_table import IdHashTable, probe
from embedding_server.idmap.remap import ShardIdMaps, init_for_ids, init_for_pieces
from embedding_server.idmap.victims import RecentVictims
from embedding_server.kernels.row_blocks import RowBlocks
from embedding_server.local_table import LocalTable

HASHED_ROWS = 50


def tables_for(policy: str, admit_after: int, shared: float) -> list[LocalTable]:
    """Three tables of one kind (one group), one of other rows and one of other settings (two
    more groups), and a hashed table between them."""
    cfg = DynamicIds(
        admit_after=admit_after,
        evict=policy,
        ttl_steps=3,
        shared_rows=shared,
        start_from_shared=True,
    )
    other = DynamicIds(
        admit_after=1 if admit_after > 1 else 2,
        evict="lru" if policy != "lru" else "lfu",
        start_from_shared=True,
    )
    specs = [
        TableSpec(name="a", rows=1500, dim=4, dynamic=cfg),
        TableSpec(name="h", rows=HASHED_ROWS, dim=4),
        TableSpec(name="b", rows=1500, dim=4, dynamic=cfg),
        TableSpec(name="c", rows=2000, dim=4, dynamic=cfg),
        TableSpec(name="d", rows=1500, dim=4, dynamic=other),
        TableSpec(name="e", rows=1500, dim=4, dynamic=cfg),
    ]
    return [LocalTable(s, i) for i, s in enumerate(specs)]


def stream(steps: int, batch: int, features: int, seed: int) -> list[torch.Tensor]:
    """Raw ids [F, B] per step: a skewed vocabulary of 200k ids per feature, far above the rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        # [F, B]
        ranks = (torch.rand(features, batch, generator=gen) ** 3 * 200_000).to(torch.int64)
        out.append(ranks * 1_000_003 - 2**40 + torch.arange(features)[:, None] * 7)
    return out


@pytest.mark.parametrize(
    ("policy", "admit_after", "shared"),
    [("lru", 1, 0.25), ("lru", 2, 0.0), ("lfu", 1, 0.25), ("lfu", 3, 0.1), ("ttl", 2, 0.25)],
)
def test_batched_admission_equals_one_map_per_table(policy, admit_after, shared):
    tables = tables_for(policy, admit_after, shared)
    resets: dict[int, list] = {t: [] for t in range(len(tables))}
    reads: dict[int, list] = {t: [] for t in range(len(tables))}

    def per_piece(calls: dict[int, list], pieces: torch.Tensor, rows: torch.Tensor) -> None:
        for p in torch.unique(pieces).tolist():  # one call covers the tables of a group
            calls[p].append(rows[pieces == p].tolist())

    def read(pieces, rows):
        per_piece(reads, pieces, rows)
        return torch.zeros(rows.numel(), 4)

    shard = ShardIdMaps(
        tables, list(range(len(tables))), lambda p, r, w: per_piece(resets, p, r), read
    )
    ref_resets: dict[int, list] = {t: [] for t in range(len(tables))}
    refs = {
        t: DynamicIdMap(
            local.spec.rows,
            local.table.dynamic,
            reset=lambda r, i, t=t: ref_resets[t].append((r.tolist(), i)),
        )
        for t, local in enumerate(tables)
        if local.table.dynamic is not None
    }
    # 4,096 ids a table and step: the sketches (65,536 counters a row) halve along the stream.
    halvings = 0
    for step, ids in enumerate(stream(40, 4096, len(tables), seed=len(policy) + admit_after)):
        ids[1] %= HASHED_ROWS  # the hashed table's ids are rows already
        got = shard.remap(SparseFeatures.one_hot(ids), train=True).values.view(len(tables), -1)
        for t, m in refs.items():
            added = int(m.sketch.added) if m.sketch is not None else 0
            assert torch.equal(got[t], m.lookup(ids[t], train=True)), (step, t)
            halvings += m.sketch is not None and int(m.sketch.added) < added
            mine = shard.maps[t].state()
            for name, v in m.state().items():
                assert torch.equal(mine[name], v), (step, t, name)
        assert torch.equal(got[1], ids[1])
    for t, m in refs.items():
        assert resets[t] == [r for r, _ in ref_resets[t]]
        assert reads[t] == [shared_rows_of(i, m.shared).tolist() for _, i in ref_resets[t]]
        assert shard.maps[t].stats() == m.stats()
    evicted = sum(m.stats()["evicted"] for m in refs.values())
    assert evicted > 1000  # the stream churned: rows were freed and reused many times
    assert halvings > 0


def test_evaluation_lookups_change_nothing():
    tables = tables_for("lfu", 2, 0.25)
    shard = ShardIdMaps(
        tables,
        list(range(len(tables))),
        lambda p, r, w: None,
        lambda p, r: torch.zeros(r.numel(), 4),
    )
    ids = stream(3, 512, len(tables), seed=3)
    for x in ids:
        x[1] %= HASHED_ROWS
        shard.remap(SparseFeatures.one_hot(x), train=True)
    before = {k: v.clone() for k, v in shard.state().items()}
    shard.remap(SparseFeatures.one_hot(ids[0]), train=False)
    assert all(torch.equal(before[k], v) for k, v in shard.state().items())


def test_lfu_victims_by_sorts_equal_the_packed_key():
    """The fallback for clocks and counts too large for one int64 key chooses the same rows."""
    tables = tables_for("lfu", 2, 0.25)
    shard = ShardIdMaps(
        tables,
        list(range(len(tables))),
        lambda p, r, w: None,
        lambda p, r: torch.zeros(r.numel(), 4),
    )
    for x in stream(12, 512, len(tables), seed=5):
        x[1] %= HASHED_ROWS
        shard.remap(SparseFeatures.one_hot(x), train=True)
    _, _, group = shard.groups[0]
    tabs = torch.arange(group.count)
    clock = int(group.s["counters"][0, 0])
    below = torch.full_like(tabs, 1_000)
    packed = group._victims(tabs, torch.full_like(tabs, 20), clock, below)
    s = group.s
    movable = s["used"] & (s["last"] < clock - 1) & (s["uses"] < below[:, None])
    sorted_ = group._victims_sorted(tabs, torch.full_like(tabs, 20), movable, s["last"], s["uses"])
    assert packed[0].numel() > 0
    assert all(torch.equal(a, b) for a, b in zip(packed, sorted_, strict=True))


def test_fresh_rows_of_several_pieces_equal_those_of_each():
    tables = tables_for("lru", 1, 0.25)
    ids = torch.tensor([5, -(2**62), 2**40 + 3, 9], dtype=torch.int64)
    group = [tables[0], tables[2], tables[5]]  # a, b, e: 1,500 rows, dim 4
    which = torch.tensor([0, 2, 1, 0])
    got = init_for_pieces(
        ids,
        torch.tensor([group[i].index for i in which.tolist()]),
        torch.tensor([group[i].col_start for i in which.tolist()]),
        4,
        1500,
        seed=7,
        init_scale=None,
    )
    for k, i in enumerate(which.tolist()):
        assert torch.equal(
            got[k], init_for_ids(ids[k : k + 1], group[i], seed=7, init_scale=None)[0]
        )


def test_row_blocks_of_one_buffer_and_of_separate_tensors_agree():
    buf = torch.arange(40.0).view(10, 4)
    separate = [buf[:3].clone(), buf[3:].clone()]
    one, apart = RowBlocks([buf[:3], buf[3:]]), RowBlocks(separate)
    assert one.flat is not None and apart.flat is None
    pieces, rows = torch.tensor([1, 0, 1]), torch.tensor([6, 2, 0])
    assert torch.equal(one.read(pieces, rows), apart.read(pieces, rows))
    one.write(pieces, rows, torch.full((3, 4), -1.0))
    apart.write(pieces, rows, torch.full((3, 4), -1.0))
    assert torch.equal(torch.cat(separate), buf) and float(buf[9].sum()) == -4.0


def churned_group(policy: str, admit_after: int, steps: int = 12):
    tables = tables_for(policy, admit_after, 0.25)
    shard = ShardIdMaps(
        tables,
        list(range(len(tables))),
        lambda p, r, w: None,
        lambda p, r: torch.zeros(r.numel(), 4),
    )
    for x in stream(steps, 512, len(tables), seed=5):
        x[1] %= HASHED_ROWS
        shard.remap(SparseFeatures.one_hot(x), train=True)
    return shard.groups[0][2]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victims_by_sorting_the_movable_rows_equal_the_top_k(policy):
    """Where few rows are movable the victims come from a sort of those rows; the same as the
    top-k."""
    group = churned_group(policy, 1)
    tabs = torch.arange(group.count)
    clock, s = int(group.s["counters"][0, 0]), group.s
    n = torch.tensor([5, 300, 40])
    movable = s["used"] & (s["last"] < clock - 1)
    lfu = (clock + 1) * group.rows if policy == "lfu" else 0
    few = group._victims_few(tabs, n, movable, s["last"], s["uses"], lfu)
    key = s["last"] * group.rows + torch.arange(group.rows) + (s["uses"] * lfu if lfu else 0)
    vals, rows = torch.topk(torch.where(movable, key, 2**63 - 1), 300, dim=1, largest=False)
    keep = (torch.arange(300)[None, :] < n[:, None]) & (vals != 2**63 - 1)
    assert few[0].numel() > 45  # some tables cut at n, some with fewer movable rows
    assert torch.equal(few[0], tabs[:, None].expand_as(rows)[keep]) and torch.equal(
        few[1], rows[keep]
    )
    assert torch.equal(few[2], torch.arange(300).expand_as(rows)[keep])


def test_bucket_cache_falls_back_to_probing_when_stale():
    """Freed rows' buckets: from the row -> bucket cache where it is right, probed where not."""
    group = churned_group("lru", 1)
    used = torch.nonzero(group.s["used"])
    tables, rows = used[:, 0], used[:, 1]
    ids = group.s["row_id"][tables, rows]
    truth = probe(group.keys, group.slots, ids, tables * group.buckets, group.buckets - 1)
    assert bool((truth >= 0).all())
    assert torch.equal(group._buckets_of(tables, rows), truth)
    group.bucket_of[::3] = -1  # stale: unknown, and pointing at another table's or row's bucket
    group.bucket_of[1::3] = torch.roll(group.bucket_of[1::3], 7)
    assert torch.equal(group._buckets_of(tables, rows), truth)
    group.slots[truth[:4]] = -2  # ids no longer in the map: a clear error
    with pytest.raises(KeyError, match="freed row"):
        group._buckets_of(tables[:4], rows[:4])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_victim_lists_choose_what_a_full_ranking_chooses(seed):
    """lru victims read from the sorted lists are, step after step, the n smallest (last, row) of
    the movable rows (what a top-k over every row gives), while rows are used, freed and given
    again, lists run out and refill, and a load replaces every row's last use."""
    gen = torch.Generator().manual_seed(seed)
    m, r = 4, 400
    last = torch.randint(0, 6, (m, r), generator=gen)
    used = torch.rand(m, r, generator=gen) < 0.8
    lists, chosen_total, refills = RecentVictims(m, r), 0, set()
    for clock in range(6, 90):
        if clock == 50:  # a checkpoint load: every row's last use replaced, the lists forgotten
            last = torch.randint(0, clock, (m, r), generator=gen)
            lists.forget()
        top = clock - 2
        tabs = torch.nonzero(torch.rand(m, generator=gen) < 0.7).view(-1)
        if not tabs.numel():
            continue
        n = torch.randint(0, 120, (tabs.numel(),), generator=gen)
        got_t, got_r, got_rank = lists.choose(tabs, n, last, used, top, clock)
        refills.add(lists.built)
        # [m', R]
        key = torch.where(used & (last <= top), last * r + torch.arange(r), 2**63 - 1)[tabs]
        vals, rows = torch.sort(key, dim=1)
        keep = (torch.arange(r)[None, :] < n[:, None]) & (vals != 2**63 - 1)
        assert torch.equal(got_t, tabs[:, None].expand_as(rows)[keep])
        assert torch.equal(got_r, rows[keep])
        assert torch.equal(got_rank, torch.arange(r).expand_as(rows)[keep])
        chosen_total += got_r.numel()
        used[got_t, got_r] = False  # freed ...
        again = torch.rand(m, r, generator=gen) < 0.05  # ... and rows used or given to new ids now
        touched = again & (used | (torch.rand(m, r, generator=gen) < 0.5))
        last[touched], used[touched] = clock, True
    # the lists ran out and refilled, not once a step
    assert chosen_total > 2000 and len(refills) > 3


def test_batched_rebuild_equals_each_table_rebuilt():
    """Tables rebuilt together get the buckets IdHashTable._rebuild gives each; the others keep
    theirs; the row -> bucket cache points at the new buckets."""
    group = churned_group("lru", 1)
    refs = [
        IdHashTable(
            group.rows - group.shared,
            m.table.keys.clone(),
            m.table.slots.clone(),
            m.table.counts.clone(),
        )
        for m in group.maps
    ]
    assert all(r.tombstones > 0 for r in refs)
    for t in (0, 2):
        refs[t]._rebuild()
    group._rebuild(torch.tensor([0, 2]))
    for m, r in zip(group.maps, refs, strict=True):
        assert torch.equal(m.table.keys, r.keys) and torch.equal(m.table.slots, r.slots)
        assert torch.equal(m.table.counts, r.counts)
    used = torch.nonzero(group.s["used"])
    flat = used[:, 0] * group.rows + used[:, 1]
    truth = probe(
        group.keys,
        group.slots,
        group.s["row_id"].view(-1)[flat],
        used[:, 0] * group.buckets,
        group.buckets - 1,
    )
    assert torch.equal(group.bucket_of[flat][used[:, 0] != 1], truth[used[:, 0] != 1])
