"""Dynamic ids: the vectorised hash table, the count-min sketch and one table's id map
(admission, eviction, stable rows, bounded memory, state round trip)."""

import resource

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm_core.schema import DynamicIds
from embedding_server.idmap.dynamic import DynamicIdMap, shared_rows_of
from embedding_server.idmap.hash_table import IdHashTable, mix64
from embedding_server.idmap.sketch import CountMinSketch

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


class TestIdHashTable:
    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(st.sampled_from(["insert", "delete"]), st.lists(INT64, max_size=40)),
            max_size=12,
        )
    )
    def test_matches_a_dict(self, ops):
        table, ref = IdHashTable(64), {}
        next_slot = 0
        for op, keys in ops:
            keys = list(dict.fromkeys(keys))
            if op == "insert":
                keys = [k for k in keys if k not in ref][: 64 - len(ref)]
                slots = list(range(next_slot, next_slot + len(keys)))
                next_slot += len(keys)
                table.insert(
                    torch.tensor(keys, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
                )
                ref.update(zip(keys, slots, strict=True))
            else:
                keys = [k for k in keys if k in ref]
                table.delete(torch.tensor(keys, dtype=torch.int64))
                for k in keys:
                    del ref[k]
            probe = list(ref) + [k + 1 for k in ref if k + 1 not in ref and k < 2**63 - 1]
            found = table.find(torch.tensor(probe, dtype=torch.int64)).tolist()
            assert found == [ref.get(k, -1) for k in probe]
            assert table.live == len(ref)

    def test_reuses_tombstones_and_rebuilds(self):
        table = IdHashTable(1000)
        keys = torch.arange(1000, dtype=torch.int64) * 7919
        for _ in range(5):  # far more inserts and deletes than buckets
            table.insert(keys, torch.arange(1000))
            assert torch.equal(table.find(keys), torch.arange(1000))
            table.delete(keys)
            assert bool((table.find(keys) == -1).all())
        assert table.live == 0

    def test_mix64_is_fixed(self):
        # splitmix64 (0 -> 0xE220A8397B1DCDAF, its first output): the layout of maps in checkpoints
        # depends on it.
        assert mix64(torch.tensor([0, 1, -1])).tolist() == [
            -2152535657050944081,
            -7995527694508729151,
            -1956407806741107680,
        ]


def test_count_min_sketch_never_underestimates():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5000, (20000,), generator=gen)
    uniq, counts = torch.unique(ids, return_counts=True)
    sketch = CountMinSketch(width=16384)  # halves after 32768 increments: not yet
    sketch.add(uniq, counts)
    est = sketch.estimate(uniq).to(torch.int64)
    assert bool((est >= counts).all())
    assert float((est - counts).float().mean()) < 10  # and stays close on average


def test_count_min_sketch_halves_instead_of_saturating():
    sketch = CountMinSketch(width=16, depth=2)
    for i in range(100):
        sketch.add(torch.arange(i * 10, i * 10 + 10), torch.ones(10, dtype=torch.int64))
    assert int(sketch.counts.max()) <= 160 + 10


def batches(seed: int, steps: int, batch: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-vocab, vocab, (batch,), generator=gen) * 1_000_003 for _ in range(steps)]


class TestDynamicIdMap:
    def test_admission_after_threshold(self):
        m = DynamicIdMap(10, DynamicIds(admit_after=3, shared_rows=0))
        assert m.lookup(torch.tensor([5, 5]), train=True).tolist() == [0, 0]  # seen twice
        assert m.lookup(torch.tensor([5, 6]), train=True).tolist() == [1, 0]  # third time: admitted
        # evaluation reads
        assert m.lookup(torch.tensor([5, 6, 7]), train=False).tolist() == [1, 0, 0]
        assert m.stats() == {"rows_used": 2, "admitted": 1, "evicted": 0, "default_lookups": 3}

    def test_lru_frees_the_least_recently_used(self):
        m = DynamicIdMap(4, DynamicIds(evict="lru", shared_rows=0))  # 3 rows for ids
        m.lookup(torch.tensor([11, 12, 12, 12]), train=True)  # step 1
        m.lookup(torch.tensor([13, 11]), train=True)  # step 2
        m.lookup(torch.tensor([13]), train=True)  # step 3
        m.lookup(torch.tensor([20]), train=True)  # full: 12 (last used at step 1) goes
        kept = m.lookup(torch.tensor([11, 12, 13, 20]), train=False).tolist()
        assert [i for i, r in zip([11, 12, 13, 20], kept, strict=True) if r == 0] == [12]
        assert m.stats()["evicted"] == 1

    def test_lfu_admits_only_ids_seen_more_often_than_the_least_used_row(self):
        m = DynamicIdMap(4, DynamicIds(evict="lfu", shared_rows=0))
        m.lookup(torch.tensor([11, 12, 12, 12]), train=True)  # 11 used once, 12 three times
        m.lookup(torch.tensor([13, 11]), train=True)  # 11: twice
        m.lookup(torch.tensor([13]), train=True)  # 13: twice
        m.lookup(torch.tensor([20]), train=True)  # seen once: no row worth giving up
        assert (
            m.lookup(torch.tensor([20]), train=False).tolist() == [0] and m.stats()["evicted"] == 0
        )
        # seen 3 times: beats 11 (twice, and older than 13)
        m.lookup(torch.tensor([20, 20]), train=True)
        kept = m.lookup(torch.tensor([11, 12, 13, 20]), train=False).tolist()
        assert [i for i, r in zip([11, 12, 13, 20], kept, strict=True) if r == 0] == [11]
        assert m.stats()["evicted"] == 1

    def test_rows_of_the_last_two_lookups_are_never_evicted(self):
        m = DynamicIdMap(3, DynamicIds(shared_rows=0))
        m.lookup(torch.tensor([1, 2]), train=True)
        assert m.lookup(torch.tensor([3]), train=True).tolist() == [0]  # 1, 2 may await gradients
        assert m.lookup(torch.tensor([3]), train=True).tolist() == [1]  # now one of them may go

    def test_ttl_expires_unused_ids(self):
        m = DynamicIdMap(100, DynamicIds(evict="ttl", ttl_steps=3, shared_rows=0))
        m.lookup(torch.tensor([1, 2]), train=True)
        for _ in range(5):
            m.lookup(torch.tensor([2]), train=True)
        assert m.lookup(torch.tensor([1, 2]), train=False).tolist() == [0, 2]
        assert m.stats()["evicted"] == 1 and m.stats()["rows_used"] == 2

    def test_reused_rows_are_reset_first(self):
        resets = []
        m = DynamicIdMap(
            3,
            DynamicIds(shared_rows=0),
            reset=lambda rows, ids: resets.append((rows.tolist(), ids.tolist())),
        )
        m.lookup(torch.tensor([1, 2]), train=True)
        m.lookup(torch.tensor([3]), train=True)  # full, and 1, 2 are too recent: row 0
        m.lookup(torch.tensor([3]), train=True)  # 1 goes (lru, ties: lower row), 3 takes row 1
        m.lookup(torch.tensor([4]), train=True)
        assert resets == [([1, 2], [1, 2]), ([1], [3]), ([2], [4])]

    @settings(max_examples=40, deadline=None)
    @given(
        st.integers(2, 40),
        st.integers(1, 3),
        st.sampled_from(["lru", "lfu", "ttl"]),
        st.sampled_from([0.0, 0.25, 0.5]),
        st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=30), min_size=1, max_size=25),
    )
    def test_capacity_stable_rows_and_consistency(self, rows, admit_after, policy, shared, stream):
        resets: list[tuple[list[int], list[int]]] = []
        m = DynamicIdMap(
            rows,
            DynamicIds(admit_after=admit_after, evict=policy, ttl_steps=2, shared_rows=shared),
            reset=lambda r, i: resets.append((r.tolist(), i.tolist())),
        )
        s = m.shared
        held: dict[int, int] = {}  # id -> row, as seen in lookups
        for ids in stream:
            before = len(resets)
            out = m.lookup(torch.tensor(ids, dtype=torch.int64), train=True).tolist()
            hashed = shared_rows_of(torch.tensor(ids, dtype=torch.int64), s).tolist()
            # its own shared row
            assert all(r == h for r, h in zip(out, hashed, strict=True) if r < s)
            fresh = {i for _, new in resets[before:] for i in new}
            for i, r in zip(ids, out, strict=True):
                assert 0 <= r < rows
                if r >= s and i in held and held[i] != r:
                    assert i in fresh, (
                        f"id {i} moved from row {held[i]} to {r} without a new admission"
                    )
                if r >= s:
                    held[i] = r
            pairs = {(i, r) for i, r in zip(ids, out, strict=True) if r >= s}
            assert len({r for _, r in pairs}) == len(pairs)  # distinct ids, distinct rows
            assert m.ids_held <= rows - s and m.stats()["rows_used"] <= rows
            keys, slots = m.items()
            assert keys.numel() == m.ids_held
            assert torch.equal(m.row_id[slots], keys) and bool(m.used[slots].all())
            assert int(m.used.sum()) == m.ids_held and not bool(m.used[:s].any())
            assert not bool(torch.isin(slots, torch.arange(s)).any())

    def test_ids_without_a_row_scatter_over_the_shared_rows(self):
        m = DynamicIdMap(40, DynamicIds(admit_after=2, shared_rows=0.25))  # S = 10, 30 rows for ids
        assert m.shared == 10 and m.stats()["rows_used"] == 10
        ids = torch.arange(1000, 1200, dtype=torch.int64)  # seen once: none admitted
        train = m.lookup(ids, train=True)
        assert torch.equal(train, shared_rows_of(ids, 10)) and len(set(train.tolist())) == 10
        # unseen: same rule
        assert torch.equal(m.lookup(ids + 7, train=False), shared_rows_of(ids + 7, 10))
        assert m.stats()["default_lookups"] == 200 and m.ids_held == 0
        # seen twice: rows of their own, after the shared ones
        admitted = m.lookup(ids[:5], train=True)
        assert bool((admitted >= 10).all()) and m.stats()["rows_used"] == 15

    def test_state_round_trip_continues_identically(self):
        cfg = DynamicIds(admit_after=2, evict="lfu", shared_rows=0.25, start_from_shared=True)
        stream = batches(1, 30, 200, 300)
        a = DynamicIdMap(128, cfg)
        for ids in stream[:15]:
            a.lookup(ids, train=True)
        b = DynamicIdMap(128, cfg)
        b.load({k: v.clone() for k, v in a.state().items()})
        for ids in stream[15:]:
            assert torch.equal(a.lookup(ids, train=True), b.lookup(ids, train=True))
        assert a.stats() == b.stats()


@pytest.mark.slow
def test_ten_million_distinct_ids_stay_within_capacity():
    """A stream of 10M distinct ids into a 100k-row table: rows used never pass the capacity and
    the process's memory stays flat (the map's tensors have fixed sizes)."""
    m = DynamicIdMap(100_000, DynamicIds(admit_after=2, shared_rows=0.25))
    step, batch = 0, 200_000
    rss = []
    for start in range(0, 10_000_000, batch):
        ids = torch.arange(start, start + batch, dtype=torch.int64) * 2654435761  # all distinct
        ids = torch.cat([ids, ids[: batch // 10]])  # a tenth seen twice: admitted
        m.lookup(ids, train=True)
        step += 1
        assert m.stats()["rows_used"] <= 100_000
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    stats = m.stats()
    assert stats["admitted"] >= 900_000 and stats["evicted"] >= stats["admitted"] - 100_000
    assert rss[-1] - rss[len(rss) // 4] < 64 * 1024  # KB: no growth after warm-up
