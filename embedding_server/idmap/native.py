"""The id maps' hot loops of ``idhash.c``, compiled on first use and called through ctypes:
:func:`probe` and :func:`place` (``hash_table.py``), :func:`find_touch` (a training lookup's
probe, ``remap.py``), :func:`release`, :func:`victims` and :func:`rebuild` (``batched.py``). Each
returns None (or
False) where the library is off, and the caller runs its torch code, which decides the same.

A training lookup of dynamic tables probes every id's bucket and inserts the new ones; in torch
that is a dozen full-batch tensor passes per probe round (``hash_table.probe``), in C one pass
with one or two cache misses per id, the next ids' buckets prefetched: 0.57 ms against 3.5 ms
for a warm 26-table batch of 53k ids (one thread). fbgemm 1.8's ``zero_collision_hash`` was
measured as the library alternative and is slower than the torch loop on CPU (5.3 ms with the
probes it needs, 3.0 ms with one each; read-only there), so the map keeps its own.

The library is built and loaded by ``native_build.py`` (:func:`library`: None where it is off).

The same library gathers, scatters and fills rows of a kernel's buffer by index
(:func:`gather_rows`, :func:`scatter_rows`, :func:`copy_rows`, :func:`fill_rows`: ``row_blocks.py``,
the fresh rows
of a step's new ids): torch's ``index_copy_`` into a [N, D] float buffer ran at about 2 GB/s
here (1.7 ms a step for dynamic_ids.py's 15k fresh rows of dim 64), a row copy per index with
the next rows prefetched at memory speed.

Every function takes CPU int64 tensors and writes its outputs; shapes as in ``hash_table.py``
(H buckets, n keys in a call).
"""

from __future__ import annotations

import ctypes

import torch

from embedding_server.idmap.native_build import ENV, SOURCE, build, library  # noqa: F401 (re-exported)

_P = ctypes.c_void_p
_I = ctypes.c_int64


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _usable(*tensors: torch.Tensor, dtype: torch.dtype = torch.int64) -> bool:
    return all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)


def probe(
    keys: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    base: torch.Tensor | int,
    mask: torch.Tensor | int,
    with_slots: bool,
):
    """``hash_table.probe`` in C, or None where the library is off or the tensors do not suit it
    (the caller then probes in torch)."""
    lib = library()
    ids = ids.contiguous()
    tensors = [t.contiguous() if isinstance(t, torch.Tensor) else None for t in (base, mask)]
    if lib is None or not _usable(keys, slots, ids, *(t for t in tensors if t is not None)):
        return None
    n = ids.numel()
    pos = torch.empty(n, dtype=torch.int64)
    found = torch.empty(n, dtype=torch.int64) if with_slots else None
    lib.idhash_probe(
        keys.data_ptr(),
        slots.data_ptr(),
        ids.data_ptr(),
        n,
        _ptr(tensors[0]),
        0 if tensors[0] is not None else int(base),
        _ptr(tensors[1]),
        0 if tensors[1] is not None else int(mask),
        pos.data_ptr(),
        _ptr(found),
    )
    return (pos, found) if with_slots else pos


def place(
    keys: torch.Tensor,
    slots: torch.Tensor,
    new_keys: torch.Tensor,
    tables: torch.Tensor | None,
    new_slots: torch.Tensor,
    buckets: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Insert ``new_keys`` [n] (distinct, absent; table ``tables`` [n] of ``buckets`` buckets
    each, None: one table) with ``new_slots`` [n], in order, each into the first empty or
    tombstone bucket from its home -> (buckets int64 [n], tombstone reused bool [n]); None where
    the library is off (the caller places them in torch).

    Raises:
        RuntimeError: a table had no free bucket (callers rebuild before that can happen).
    """
    lib = library()
    new_keys, new_slots = new_keys.contiguous(), new_slots.contiguous()
    tables = None if tables is None else tables.contiguous()
    if lib is None or not _usable(
        keys, slots, new_keys, new_slots, *([] if tables is None else [tables])
    ):
        return None
    n = new_keys.numel()
    pos, reused = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.bool)
    done = lib.idhash_place(
        keys.data_ptr(),
        slots.data_ptr(),
        new_keys.data_ptr(),
        _ptr(tables),
        new_slots.data_ptr(),
        n,
        buckets,
        pos.data_ptr(),
        reused.data_ptr(),
    )
    if done != n:
        raise RuntimeError(f"id hash table full: key {done} of {n} found no free bucket")
    return pos, reused


def victims(
    last: torch.Tensor,
    used: torch.Tensor,
    uses: torch.Tensor,
    tabs: torch.Tensor,
    n: torch.Tensor,
    below: torch.Tensor | None,
    top: int,
    lfu: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``MapGroup._victims``' choice in C: of each table tabs[i] (``last``, ``used``, ``uses``:
    [M, R]), the movable rows (used, last <= top, uses < below[i] where ``below`` is given), the
    first n[i] by key uses * lfu + last * R + row -> (tables [v], rows [v], ranks [v]); None
    where the library is off. The caller makes sure the keys fit in 63 bits."""
    lib = library()
    if (
        lib is None
        or not _usable(last, uses, tabs, n)
        or (below is not None and not _usable(below))
        or (not _usable(used, dtype=torch.bool))
    ):
        return None
    rows = last.shape[1]
    out = torch.empty((3, int(n.clamp(max=rows).sum())), dtype=torch.int64)
    scratch = torch.empty(rows, dtype=torch.int64)  # named: alive until the call returns
    got = lib.idhash_victims(
        last.data_ptr(),
        used.data_ptr(),
        uses.data_ptr(),
        tabs.data_ptr(),
        n.data_ptr(),
        _ptr(below),
        tabs.numel(),
        rows,
        top,
        lfu,
        scratch.data_ptr(),
        out[0].data_ptr(),
        out[1].data_ptr(),
        out[2].data_ptr(),
    )
    return out[0, :got], out[1, :got], out[2, :got]


def sketch_add(
    sketch: torch.Tensor,
    added: torch.Tensor,
    ids: torch.Tensor,
    tables: torch.Tensor,
    counts: torch.Tensor,
    width: int,
    depth: int,
) -> torch.Tensor | None:
    """``MapGroup._count``'s sketch update in C: ``counts`` [u] occurrences of ``ids`` [u]
    (distinct within their table, ``tables`` [u]) added to the tables' count-min sketches
    (``sketch`` [M, d * W] int32, rows of ``width`` W) and to ``added`` [M] -> their estimates after
    every add, int64
    [u]; None where the library is off."""
    lib = library()
    ids, tables, counts = ids.contiguous(), tables.contiguous(), counts.contiguous()
    if (
        lib is None
        or not _usable(added, ids, tables, counts)
        or not _usable(sketch, dtype=torch.int32)
    ):
        return None
    out = torch.empty(ids.numel(), dtype=torch.int64)
    lib.idhash_sketch_add(
        sketch.data_ptr(),
        added.data_ptr(),
        ids.data_ptr(),
        tables.data_ptr(),
        counts.data_ptr(),
        ids.numel(),
        width,
        depth,
        out.data_ptr(),
    )
    return out


def find_touch(
    keys: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    k: torch.Tensor,
    bucket_base: torch.Tensor,
    bucket_mask: torch.Tensor,
    row_base: torch.Tensor,
    last: torch.Tensor,
    uses: torch.Tensor,
    clock: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A training lookup's probe (``ShardIdMaps._train``): the row of each of ids [n] in its map
    k [n] (-1: absent), each found id's row touched (last = clock, one more use, repeats counted)
    -> (rows [n], positions of the absent ids [a]); None where the library is off."""
    lib = library()
    if lib is None or not _usable(
        keys, slots, ids, k, bucket_base, bucket_mask, row_base, last, uses
    ):
        return None
    n = ids.numel()
    rows, absent = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    a = lib.idhash_find_touch(
        keys.data_ptr(),
        slots.data_ptr(),
        ids.data_ptr(),
        k.data_ptr(),
        n,
        bucket_base.data_ptr(),
        bucket_mask.data_ptr(),
        row_base.data_ptr(),
        last.data_ptr(),
        uses.data_ptr(),
        clock,
        rows.data_ptr(),
        absent.data_ptr(),
    )
    return rows, absent[:a]


def release(
    keys: torch.Tensor,
    slots: torch.Tensor,
    state: dict[str, torch.Tensor],
    bucket_of: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    shared: int,
    columns: tuple[int, int],
) -> bool:
    """``MapGroup._release`` in C: rows [v] of tables [v] (by table) freed: their ids' buckets
    tombstoned (found through ``bucket_of`` or probed), the rows unused and pushed on the free
    stacks in order, the counters (``columns``: free, evicted) and live / tombstone counts moved.
    False where the library is off (nothing done).

    Raises:
        KeyError: a freed row's id is not in its map.
    """
    lib = library()
    names = ("row_id", "free", "counters", "table_counts")
    if (
        lib is None
        or not _usable(keys, slots, bucket_of, tables, rows, *(state[k] for k in names))
        or (not _usable(state["used"], dtype=torch.bool))
    ):
        return False
    count, r = state["row_id"].shape
    done = lib.idhash_release(
        keys.data_ptr(),
        slots.data_ptr(),
        state["row_id"].data_ptr(),
        bucket_of.data_ptr(),
        state["used"].data_ptr(),
        state["free"].data_ptr(),
        state["counters"].data_ptr(),
        state["counters"].shape[1],
        columns[0],
        columns[1],
        state["table_counts"].data_ptr(),
        tables.data_ptr(),
        rows.data_ptr(),
        rows.numel(),
        r,
        shared,
        slots.numel() // count,
    )
    if done != rows.numel():
        raise KeyError("MapGroup: a freed row's id is not in its map (or the row holds no id)")
    return True


def rebuild(
    keys: torch.Tensor,
    slots: torch.Tensor,
    tabs: torch.Tensor,
    buckets: int,
    rows: int,
    bucket_of: torch.Tensor,
    table_counts: torch.Tensor,
) -> bool:
    """``MapGroup._rebuild`` in C: the hash tables of ``tabs`` [m] (``buckets`` buckets each)
    rebuilt
    from their live keys, re-placed in bucket order; ``bucket_of`` ([M * R], rows R) and
    ``table_counts`` [M, 2] follow. False where the library is off (nothing done)."""
    lib = library()
    tabs = tabs.contiguous()
    if lib is None or not _usable(keys, slots, tabs, bucket_of, table_counts):
        return False
    scratch = torch.empty((2, buckets), dtype=torch.int64)  # named: alive until the call returns
    lib.idhash_rebuild(
        keys.data_ptr(),
        slots.data_ptr(),
        tabs.data_ptr(),
        tabs.numel(),
        buckets,
        rows,
        bucket_of.data_ptr(),
        table_counts.data_ptr(),
        scratch[0].data_ptr(),
        scratch[1].data_ptr(),
    )
    return True


def take(
    lists: torch.Tensor,
    head: torch.Tensor,
    end: torch.Tensor,
    tabs: torch.Tensor,
    n: torch.Tensor,
    used: torch.Tensor,
    last: torch.Tensor,
    row_bits: int,
    when_bits: int,
    strict: bool,
):
    """``RecentVictims._take`` in C: each table tabs[i]'s first n[i] true entries of its sorted
    list (``lists`` [Q], ``head`` / ``end`` [M]), its head moved past them -> (tables [v], rows
    [v], ranks [v]); "ran out" (where ``strict`` and a list holds too few; nothing changed), or
    None where the library is off."""
    lib = library()
    if (
        lib is None
        or not _usable(lists, head, end, tabs, n, last)
        or not _usable(used, dtype=torch.bool)
    ):
        return None
    m, rows = tabs.numel(), last.shape[1]
    out = torch.empty((3, int(n.clamp(min=0).sum())), dtype=torch.int64)
    scratch = torch.empty(m, dtype=torch.int64)  # named: alive until the call returns
    got = lib.idhash_take(
        lists.data_ptr(),
        head.data_ptr(),
        end.data_ptr(),
        tabs.data_ptr(),
        n.data_ptr(),
        m,
        used.data_ptr(),
        last.data_ptr(),
        rows,
        row_bits,
        when_bits,
        int(strict),
        scratch.data_ptr(),
        out[0].data_ptr(),
        out[1].data_ptr(),
        out[2].data_ptr(),
    )
    return "ran out" if got < 0 else (out[0, :got], out[1, :got], out[2, :got])


def _rows_of(flat: torch.Tensor) -> tuple[int, int] | None:
    """(rows N, bytes a row) of a CPU buffer of contiguous rows [N, *row], or None."""
    if flat.device.type != "cpu" or not flat.is_contiguous() or flat.dim() == 0:
        return None
    return flat.shape[0], flat[0].numel() * flat.element_size() if flat.shape[0] else 0


def _check_rows(done: int, idx: torch.Tensor, n_rows: int) -> None:
    if done != idx.numel():
        raise IndexError(f"row index {int(idx[done])} out of range for {n_rows} rows")


def gather_rows(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """``flat.index_select(0, idx)`` (``idx`` int64 [k]) in C -> [k, *row]; None where the
    library is off or ``flat`` is not a CPU buffer of contiguous rows.

    Raises:
        IndexError: an index out of range (nothing read).
    """
    lib, shape = library(), _rows_of(flat)
    idx = idx.contiguous()
    if lib is None or shape is None or not _usable(idx):
        return None
    out = torch.empty((idx.numel(), *flat.shape[1:]), dtype=flat.dtype)
    _check_rows(
        lib.rows_gather(flat.data_ptr(), *shape, idx.data_ptr(), idx.numel(), out.data_ptr()),
        idx,
        shape[0],
    )
    return out


def scatter_rows(flat: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> bool:
    """``flat.index_copy_(0, idx, values)`` (``idx`` int64 [k], distinct; ``values`` [k, *row]) in
    C -> False where the library is off or the tensors do not suit it (nothing written).

    Raises:
        IndexError: an index out of range (nothing written).
    """
    lib, shape = library(), _rows_of(flat)
    idx, values = idx.contiguous(), values.contiguous()
    if (
        lib is None
        or shape is None
        or not _usable(idx)
        or values.dtype != flat.dtype
        or (values.shape != (idx.numel(), *flat.shape[1:]))
        or values.device.type != "cpu"
    ):
        return False
    _check_rows(
        lib.rows_scatter(flat.data_ptr(), *shape, idx.data_ptr(), idx.numel(), values.data_ptr()),
        idx,
        shape[0],
    )
    return True


def copy_rows(flat: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> bool:
    """``flat.index_copy_(0, dst, flat.index_select(0, src))`` (int64 [k] each; ``dst`` distinct
    and disjoint from ``src``) in C, without the copy between -> False where the library is off
    or ``flat`` does not suit it (nothing written).

    Raises:
        IndexError: an index out of range (nothing written).
    """
    lib, shape = library(), _rows_of(flat)
    src, dst = src.contiguous(), dst.contiguous()
    if lib is None or shape is None or not _usable(src, dst) or src.numel() != dst.numel():
        return False
    done = lib.rows_copy(flat.data_ptr(), *shape, src.data_ptr(), dst.data_ptr(), src.numel())
    if done != src.numel():
        bad = src if not 0 <= int(src[done]) < shape[0] else dst
        _check_rows(done, bad, shape[0])
    return True


def fill_rows(flat: torch.Tensor, idx: torch.Tensor, value: float) -> bool:
    """``flat.index_fill_(0, idx, value)`` for a float32 buffer in C -> False where the library
    is off or ``flat`` does not suit it (nothing written).

    Raises:
        IndexError: an index out of range (nothing written).
    """
    lib, shape = library(), _rows_of(flat)
    idx = idx.contiguous()
    if lib is None or shape is None or flat.dtype != torch.float32 or not _usable(idx):
        return False
    _check_rows(
        lib.rows_fill_f32(
            flat.data_ptr(), shape[0], shape[1] // 4, idx.data_ptr(), idx.numel(), value
        ),
        idx,
        shape[0],
    )
    return True
