"""The id maps' C kernel (``idmap/idhash.c`` via ``idmap/native.py``) makes exactly the torch
version's decisions: the same slot for every probed id, the same rows admitted, evicted and
reset, the same map state after every step. Hash buckets may differ (C inserts one key after
another, torch in rounds); every id still finds its own.

CI sets DLRM_IDMAP_KERNEL=native, so there a kernel that does not build fails these tests rather
than skipping them."""

import os
import shutil

import pytest
import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.errors import ConfigError
from embedding_server.idmap import native, native_build
from embedding_server.idmap.hash_table import TOMBSTONE, IdHashTable, probe
from embedding_server.idmap.remap import ShardIdMaps
from embedding_server.idmap.sketch import sketch_cells_of

from .test_idmap_batched import HASHED_ROWS, stream, tables_for


@pytest.fixture
def kernel(monkeypatch):
    """kernel(mode): the maps use ``mode`` (auto / torch / native) from now on in this test."""

    def use(mode: str) -> None:
        monkeypatch.setenv(native.ENV, mode)
        native.library.cache_clear()

    yield use
    native.library.cache_clear()


def test_the_kernel_builds_where_ci_requires_it(kernel):
    kernel(os.environ.get(native.ENV, "auto"))
    if os.environ.get(native.ENV) == "native":
        assert native.library() is not None
    elif native.library() is None:
        pytest.skip("no C compiler here: the torch version runs")


def test_probe_and_insert_agree_with_torch(kernel):
    kernel("native")
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(-(2**63), 2**63 - 1, (6000,), generator=gen, dtype=torch.int64)
    # edge ids too
    keys = torch.unique(torch.cat([keys, torch.tensor([-1, 0, 1, 2**63 - 1, -(2**63)])]))
    keys = keys[torch.randperm(keys.numel(), generator=gen)]
    tables = {}
    for mode in ("torch", "native"):
        kernel(mode)
        t = IdHashTable(8000)
        t.insert(keys[:4000], torch.arange(4000))
        t.delete(keys[1000:2500])  # tombstones, reused by the next inserts
        t.insert(keys[4000:], torch.arange(4000, keys.numel()))
        tables[mode] = t
    queries = torch.cat([keys, torch.randint(-(2**62), 2**62, (3000,), generator=gen)])
    want = torch.arange(keys.numel()).masked_fill(
        torch.arange(keys.numel()).ge(1000) & torch.arange(keys.numel()).lt(2500), -1
    )
    want = torch.cat([want, torch.full((3000,), -1)])
    for mode, t in tables.items():
        for probing in ("torch", "native"):  # each table read by both probes
            kernel(probing)
            assert torch.equal(t.find(queries), want), (mode, probing)
        assert t.live == keys.numel() - 1500
    assert tables["native"].tombstones == tables["torch"].tombstones  # the same tombstones reused


@pytest.mark.parametrize("width", [16, 1 << 12])
def test_sketch_counts_agree_with_torch(kernel, width):
    """The admission sketches' add-then-estimate: the same counters, totals and estimates, with
    ids of one batch colliding in a narrow sketch (their estimates see each other's adds)."""
    kernel("native")
    gen = torch.Generator().manual_seed(1)
    tables, depth = 3, 4
    ids = torch.cat(
        [
            torch.randint(-(2**63), 2**63 - 1, (2000,), generator=gen, dtype=torch.int64),
            torch.tensor([-1, 0, 1, 2**63 - 1, -(2**63)]),
        ]
    )
    which = torch.randint(0, tables, (ids.numel(),), generator=gen)
    counts = torch.randint(1, 5, (ids.numel(),), generator=gen)
    want_sketch = torch.randint(0, 3, (tables, depth * width), generator=gen, dtype=torch.int32)
    got_sketch, want_added, got_added = (
        want_sketch.clone(),
        torch.arange(tables),
        torch.arange(tables),
    )
    cells = sketch_cells_of(ids, width, depth) + which * (depth * width)  # the torch version
    flat = want_sketch.view(-1)
    flat.scatter_add_(0, cells.reshape(-1), counts.to(torch.int32).repeat(depth))
    want_added.index_add_(0, which, counts)
    want = flat.index_select(0, cells.view(-1)).view(cells.shape).amin(dim=0).to(torch.int64)
    got = native.sketch_add(got_sketch, got_added, ids, which, counts, width, depth)
    assert (
        torch.equal(got, want)
        and torch.equal(got_sketch, want_sketch)
        and torch.equal(got_added, want_added)
    )
    assert bool((got >= counts).all())  # never below an id's true count


def test_probe_of_tables_side_by_side_with_per_id_masks(kernel):
    """Several tables in one buffer, each id with its table's base and mask (``remap.py``)."""
    tabs = [IdHashTable(100), IdHashTable(700), IdHashTable(30)]
    keys = torch.cat([t.keys for t in tabs])
    slots = torch.cat([t.slots for t in tabs])
    gen = torch.Generator().manual_seed(1)
    ids, bases, masks, want, start = [], [], [], [], 0
    for i, t in enumerate(tabs):
        n = (t.mask + 1) // 4
        mine = torch.randint(-(2**40), 2**40, (n,), generator=gen) * 3 + i
        t2 = IdHashTable(n, keys[start : start + t.mask + 1], slots[start : start + t.mask + 1])
        t2.insert(mine, torch.arange(n) + 10 * i)
        ids += [mine, mine + 1]  # present, and (almost surely) absent
        bases.append(torch.full((2 * n,), start))
        masks.append(torch.full((2 * n,), t.mask))
        want += [torch.arange(n) + 10 * i, torch.full((n,), -1)]
        start += t.mask + 1
    ids, base, mask, want = torch.cat(ids), torch.cat(bases), torch.cat(masks), torch.cat(want)
    got = {}
    for mode in ("torch", "native"):
        kernel(mode)
        got[mode] = probe(keys, slots, ids, base, mask, with_slots=True)
        assert torch.equal(got[mode][1], want), mode
    assert torch.equal(got["torch"][0], got["native"][0])


def test_place_reports_tombstones_and_a_full_table(kernel):
    kernel("native")
    keys, slots = torch.zeros(8, dtype=torch.int64), torch.full((8,), -1, dtype=torch.int64)
    slots[3] = TOMBSTONE
    pos, reused = native.place(keys, slots, torch.arange(8) * 977, None, torch.arange(8) + 100, 8)
    assert (
        sorted(pos.tolist()) == list(range(8))
        and int(reused.sum()) == 1
        and bool(reused[pos == 3].all())
    )
    with pytest.raises(RuntimeError, match="no free bucket"):
        native.place(keys, slots, torch.tensor([12345]), None, torch.tensor([0]), 8)


@pytest.mark.parametrize(
    ("policy", "admit_after", "shared"),
    [("lru", 1, 0.25), ("lfu", 1, 0.1), ("lfu", 3, 0.1), ("ttl", 2, 0.25)],
)
def test_a_stream_of_steps_makes_the_torch_versions_decisions(kernel, policy, admit_after, shared):
    """Every remap, reset and read of a churning stream, and the maps' state after every step."""
    runs = {}
    for mode in ("torch", "native"):
        kernel(mode)
        tables = tables_for(policy, admit_after, shared)
        calls: list = []

        def read(pieces, rows, calls=calls):
            calls.append(("read", pieces.tolist(), rows.tolist()))
            return torch.zeros(rows.numel(), 4)

        shard = ShardIdMaps(
            tables,
            list(range(len(tables))),
            lambda p, r, w, calls=calls: calls.append(("reset", p.tolist(), r.tolist())),
            read,
        )
        rows, states = [], []
        for ids in stream(30, 4096, len(tables), seed=len(policy) + admit_after):
            ids[1] %= HASHED_ROWS
            rows.append(shard.remap(SparseFeatures.one_hot(ids), train=True).values)
            states.append(
                {
                    (t, k): v.clone()
                    for t, m in shard.maps.items()
                    for k, v in m.state().items()
                    # buckets aside: C places keys one by one
                    if not k.startswith("table.")
                }
            )
        test = stream(1, 4096, len(tables), seed=99)[0]
        test[1] %= HASHED_ROWS
        runs[mode] = (
            rows,
            states,
            calls,
            shard.remap(SparseFeatures.one_hot(test), train=False).values,
            shard.stats(),
        )
    (r0, s0, c0, e0, st0), (r1, s1, c1, e1, st1) = runs["torch"], runs["native"]
    assert all(torch.equal(a, b) for a, b in zip(r0, r1, strict=True))
    for step, (a, b) in enumerate(zip(s0, s1, strict=True)):
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)
    assert c0 == c1 and torch.equal(e0, e1) and st0 == st1
    assert sum(s["evicted"] for s in st0.values()) > 1000  # the stream churned


def test_kernel_modes_and_a_failed_build(kernel, monkeypatch, tmp_path, caplog):
    kernel("bogus")
    with pytest.raises(ConfigError, match="auto, torch or native"):
        native.library()
    kernel("torch")
    assert native.library() is None
    source = tmp_path / "pkg" / "idhash.c"  # a source no build exists of, and no compiler for it
    source.parent.mkdir()
    source.write_text(native.SOURCE.read_text() + "\n/* another version */\n")
    monkeypatch.setattr(native_build, "SOURCE", source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/bin/false")
    kernel("native")
    with pytest.raises(ConfigError, match="DLRM_IDMAP_KERNEL=native but"):
        native.library()
    kernel("auto")
    assert native.library() is None
    assert "using the torch version" in caplog.text
    monkeypatch.delenv("CC")
    # and with a compiler: built once, beside the source
    if shutil.which("cc") or shutil.which("gcc"):
        kernel("native")
        assert native.library() is not None and len(list(source.parent.glob("_idhash-*.so"))) == 1


def test_freeing_rows_with_a_stale_bucket_cache(kernel):
    """C's release finds each freed id's bucket through the row -> bucket cache where it holds,
    by probing where it is stale (unknown, or pointing at another table's or row's bucket), and
    leaves the group as the torch release does; an id not in its map is a clear error."""
    from .test_idmap_batched import churned_group

    kernel("native")
    groups = {}
    for mode in ("torch", "native"):
        kernel(mode)
        group = churned_group("lru", 1)
        group.bucket_of[::3] = -1
        group.bucket_of[1::3] = torch.roll(group.bucket_of[1::3], 7)
        used = torch.nonzero(group.s["used"])
        group._release(used[::2, 0].contiguous(), used[::2, 1].contiguous())
        groups[mode] = group
    a, b = groups["torch"], groups["native"]

    # (table, id, row) of every live bucket, sorted (buckets may differ: C inserts one by one)
    def live(g):
        at = torch.nonzero(g.slots >= 0).squeeze(1)
        return sorted(
            zip((at // g.buckets).tolist(), g.keys[at].tolist(), g.slots[at].tolist(), strict=True)
        )

    assert live(a) == live(b) and int((a.slots == TOMBSTONE).sum()) == int(
        (b.slots == TOMBSTONE).sum()
    )
    for name in ("used", "free", "counters", "table_counts", "row_id"):
        assert torch.equal(a.s[name], b.s[name]), name
    used = torch.nonzero(b.s["used"])
    truth = probe(
        b.keys,
        b.slots,
        b.s["row_id"][used[:4, 0], used[:4, 1]],
        used[:4, 0] * b.buckets,
        b.buckets - 1,
    )
    b.slots[truth] = TOMBSTONE  # those ids are no longer in the map
    b.bucket_of.fill_(-1)
    with pytest.raises(KeyError, match="freed row"):
        b._release(used[:4, 0].contiguous(), used[:4, 1].contiguous())


def test_a_rebuild_keeps_every_id_and_points_the_bucket_cache_at_it(kernel, monkeypatch):
    """C's rebuild of a churned group (tombstones piled up) is the torch rebuild's with C's
    inserts: the same buckets, no tombstone left in the tables rebuilt, the live counts kept, and
    the row -> bucket cache pointing at each row's new bucket."""
    from embedding_server.idmap import batched

    from .test_idmap_batched import churned_group

    kernel("native")
    rebuilt = {}
    for way in ("torch", "native"):
        group = churned_group("lru", 1)
        assert int((group.slots == TOMBSTONE).sum()) > 0
        with monkeypatch.context() as m:
            calls = []
            # the torch body, its inserts in C (one key at a time, as C's rebuild)
            if way == "torch":
                m.setattr(batched, "native_rebuild", lambda *a: False)
            else:
                m.setattr(
                    batched,
                    "native_rebuild",
                    lambda *a, calls=calls: calls.append(native.rebuild(*a)) or calls[-1],
                )
            group._rebuild(torch.tensor([0, 2]))
            assert calls == ([True] if way == "native" else [])
        rebuilt[way] = group
    a, b = rebuilt["torch"], rebuilt["native"]
    assert torch.equal(a.keys, b.keys) and torch.equal(a.slots, b.slots)
    assert torch.equal(a.s["table_counts"], b.s["table_counts"])
    for t in (0, 2):
        assert int((b.slots[t * b.buckets : (t + 1) * b.buckets] == TOMBSTONE).sum()) == 0
    used = torch.nonzero(b.s["used"])
    at = b.bucket_of[used[:, 0] * b.rows + used[:, 1]]
    # the rebuilt tables' rows: the cache is right for each
    mine = (used[:, 0] == 0) | (used[:, 0] == 2)
    assert torch.equal(b.keys[at[mine]], b.s["row_id"][used[mine, 0], used[mine, 1]])
    assert torch.equal(b.slots[at[mine]], used[mine, 1])
    assert torch.equal(a.bucket_of[(used[:, 0] * b.rows + used[:, 1])[mine]], at[mine])


def test_row_blocks_in_c_read_write_copy_and_fill_as_torch(kernel):
    from embedding_server.kernels.row_blocks import RowBlocks

    out = {}
    for mode in ("torch", "native"):
        kernel(mode)
        buf = torch.randn(60, 5, generator=torch.Generator().manual_seed(1))
        blocks = RowBlocks([buf[:20], buf[20:60]])  # pieces of 20 and 40 rows in one buffer
        pieces = torch.tensor([1, 0, 1, 1])
        got = [blocks.read(pieces, torch.tensor([39, 3, 0, 7]))]
        blocks.write(pieces, torch.tensor([5, 6, 7, 8]), torch.arange(20.0).view(4, 5))
        blocks.write(torch.tensor([0, 1]), torch.tensor([1, 2]), 0.5)
        blocks.copy(pieces, torch.tensor([0, 1, 2, 3]), torch.tensor([30, 10, 31, 32]))
        out[mode] = (got, buf.clone())
        assert (native.gather_rows(blocks.flat, torch.tensor([0])) is not None) == (
            mode == "native"
        )
        with pytest.raises(IndexError):
            blocks.read(torch.tensor([1]), torch.tensor([40]))  # past the buffer's last row
    assert torch.equal(out["torch"][0][0], out["native"][0][0]) and torch.equal(
        out["torch"][1], out["native"][1]
    )


@pytest.mark.parametrize("start_from_shared", [True, False])
def test_a_dynamic_shard_trains_the_same_rows_with_either_kernel(
    kernel, monkeypatch, start_from_shared
):
    """Fresh rows copied from shared rows (C: one copy per row) or drawn from the id, reset
    optimizer state, the fused update on the remapped rows: the same weights and state after a
    churning stream."""
    from dlrm_core.schema import DynamicIds, TableSpec
    from embedding_server.kernels import row_blocks
    from embedding_server.kernels.optimizers import SparseOptimizerConfig
    from embedding_server.local_table import LocalTable
    from embedding_server.shard import EmbeddingShard

    states = {}
    for mode in ("torch", "native"):
        kernel(mode)
        ran: list[tuple[str, bool]] = []

        # row_blocks' C call ``name``, noting whether it did the work
        def counted(name, real, ran=ran):
            def call(*args):
                ran.append((name, real(*args)))
                return ran[-1][1]

            return call

        for name in ("copy_rows", "scatter_rows", "fill_rows"):
            monkeypatch.setattr(row_blocks, name, counted(name, getattr(native, name)))
        dynamic = DynamicIds(evict="lru", shared_rows=0.25, start_from_shared=start_from_shared)
        tables = [
            LocalTable(TableSpec(name=f"t{i}", rows=64, dim=8, dynamic=dynamic), i)
            for i in range(3)
        ]
        shard = EmbeddingShard(tables, SparseOptimizerConfig(lr=0.3), init_scale=0.1)
        for ids in stream(25, 256, 3, seed=11):
            shard(SparseFeatures.one_hot(ids)).square().sum().backward()
        states[mode] = (shard.export_state(), shard.id_stats())
        done = {name for name, ok in ran if ok}
        want = {"copy_rows" if start_from_shared else "scatter_rows", "fill_rows"}
        assert done == (want if mode == "native" else set()), (mode, done)
    (a, sa), (b, sb) = states["torch"], states["native"]
    assert sa == sb and sum(s["evicted"] for s in sa.values()) > 100  # the stream churned
    for key in a:
        if ".idmap.table." not in key:  # buckets aside: C places keys one by one
            assert torch.equal(a[key], b[key]), key
