"""The Redis store's dynamic-table parts: owners beside the rows, the id map's overlay hash.

    P:v:<v>:o:<table>:<block>      the id each row holds (int64 little-endian), in blocks of
                                   ``block_rows(OWNER_BYTES)`` rows; ABSENT bytes read as -1
    P:v:<v>:idmap:<table>:over     hash keyed by raw id (8 bytes): the row (8 bytes, -1 evicted)
                                   of each id changed since the base; folded into the base
                                   (``P:v:<v>:idmap:<table>``) past ``view.compact_at(n)`` entries

A gather reads each checked row and its owner in the same ``GATHER`` call (a pair never spans
two calls): a live update's ``UPDATE_ROWS`` changes both in one script, so a reader sees both
before or both after it.
"""

from __future__ import annotations

import logging

import numpy as np

from embedding_server.idmap.view import compact_at, fold
from embedding_server.stores.base import StoreUnavailable
from embedding_server.stores.redis_blocks import GATHER_KEYS, absent, block_rows
from embedding_server.wire import NUMPY_DTYPE, row_bytes

log = logging.getLogger(__name__)

OWNER_BYTES = 8
"""An owner as stored: the raw id, int64 little-endian."""


def overlay_key(store, version: str, table: str) -> str:
    return store.key("v", version, "idmap", table, "over")


def overlay_changes_key(store, version: str, table: str) -> str:
    """Pushes that wrote the table's overlay (a fold that read it checks that none came since)."""
    return store.key("v", version, "idmap", table, "over", "n")


def overlay_keys(store, version: str, tables: list[str]) -> list[str]:
    """The overlay hashes of ``tables``, then their change counters (``UPDATE_ROWS``'s keys)."""
    return [overlay_key(store, version, t) for t in tables] + [
        overlay_changes_key(store, version, t) for t in tables
    ]


def read_id_map(store, version: str, table: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The base and its overlay as of one moment, folded -> (ids sorted, rows); None: no version."""
    base_key = store.key("v", version, "idmap", table)
    with store.errors():
        pipe = store.client.pipeline(transaction=True)
        pipe.get(base_key)
        pipe.hgetall(overlay_key(store, version, table))
        raw, over = pipe.execute()
    if raw is None:
        return None
    pair = np.frombuffer(raw, dtype="<i8").reshape(2, -1).astype(np.int64)
    return fold(pair[0], pair[1], *decode_overlay(over))


def gather_rows(
    store, version: str, requests: dict[str, np.ndarray], expect: dict[str, np.ndarray]
):
    """Rows of a :class:`RedisStore` version in one round trip -> table -> (rows as stored
    [n, W], present [n], owners [n] or None, expect [n] or None); the tables in ``expect`` get
    each row's owner, read in the same call as the row."""
    meta = store.read_meta(version)
    specs = {t.name: t for t in meta.spec.tables}
    keys, args, starts, shapes = [], [], [], []
    for table, ids in requests.items():
        width = row_bytes(specs[table].dim, meta.row_dtype)
        per_block = block_rows(width)
        base = store.rows_key(version, table, "").encode()
        row_keys = [b"%s%d" % (base, b) for b in (ids // per_block).tolist()]
        row_args = [[f, width] for f in ((ids % per_block) * width).tolist()]
        owned = table in expect
        if owned:  # row i, then its owner: [r0, o0, r1, o1, ...] (a call never splits a pair)
            per_owner = block_rows(OWNER_BYTES)
            obase = store.owners_key(version, table, "").encode()
            own_keys = [b"%s%d" % (obase, b) for b in (ids // per_owner).tolist()]
            own_args = [[f, OWNER_BYTES] for f in ((ids % per_owner) * OWNER_BYTES).tolist()]
            row_keys = [k for pair in zip(row_keys, own_keys, strict=True) for k in pair]
            row_args = [a for pair in zip(row_args, own_args, strict=True) for a in pair]
        keys += row_keys
        args += [a for pair in row_args for a in pair]
        starts += [not owned or i % 2 == 0 for i in range(len(row_keys))]
        shapes.append((table, len(ids), width, owned))
    meta_key = store.key("v", version, "meta")
    calls, at = [], 0
    while at < len(keys):
        end = min(at + GATHER_KEYS, len(keys))
        if end < len(keys) and not starts[end]:
            end -= 1
        calls.append((1 + end - at, meta_key, *keys[at:end], *args[2 * at : 2 * end]))
        at = end
    replies = store._gather(calls)
    if any(r is None for r in replies):
        raise store._gone(version)
    blob = np.frombuffer(b"".join(replies), dtype=np.uint8)
    out, at = {}, 0
    dtype = NUMPY_DTYPE[meta.row_dtype]
    for table, n, width, owned in shapes:
        step = width + OWNER_BYTES if owned else width
        both = blob[at : at + n * step].reshape(n, step)
        at += n * step
        raw = both[:, :width] if owned else both
        owner = (
            np.ascontiguousarray(both[:, width:]).view("<i8").reshape(n).astype(np.int64)
            if owned
            else None
        )
        raw = np.ascontiguousarray(raw)
        out[table] = (raw.view(dtype).reshape(n, -1), ~absent(raw), owner, expect.get(table))
    return out


def compact_after_push(store, version: str, tables: list[str]) -> None:
    """After a push (already applied): fold the overlays grown past their bound. A fold that
    fails is logged and tried again after the next push; the push itself stands."""
    for table in tables:
        try:
            maybe_compact(store, version, table)
        except StoreUnavailable as exc:
            log.warning(
                "redis store: folding the id-map overlay of %s (version %s) failed, retried after "
                "the "
                "next push: %s",
                table,
                version,
                exc,
            )


def maybe_compact(store, version: str, table: str) -> None:
    """Fold a dynamic table's overlay hash into its base once it is past ``compact_at`` entries
    (left when a push writes its overlay between the read and the fold: a table split by rows
    has a writer per piece; readers following the stream are not affected)."""
    base_key, over_key = store.key("v", version, "idmap", table), overlay_key(store, version, table)
    changes_key = overlay_changes_key(store, version, table)
    with store.errors():
        pipe = store.bulk.pipeline(transaction=True)
        pipe.strlen(base_key)
        pipe.hlen(over_key)
        size, entries = pipe.execute()
        if entries <= compact_at(size // 16):
            return
        pipe = store.bulk.pipeline(transaction=True)
        pipe.get(base_key)
        pipe.hgetall(over_key)
        pipe.get(changes_key)
        raw, over, changes = pipe.execute()
        if raw is None:
            return
        pair = np.frombuffer(raw, dtype="<i8").reshape(2, -1).astype(np.int64)
        folded = np.stack(fold(pair[0], pair[1], *decode_overlay(over))).astype("<i8").tobytes()
        if (
            store._scripts["COMPACT"](
                keys=[store.key("v", version, "meta"), base_key, over_key, changes_key],
                args=[len(over), changes or b"0", folded],
            )
            == 1
        ):
            store.compactions += 1


def int64_items(values: np.ndarray) -> list[bytes]:
    """Each int64 as 8 little-endian bytes (the overlay hash's fields and values)."""
    raw = np.ascontiguousarray(values, dtype="<i8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def decode_overlay(over: dict[bytes, bytes]) -> tuple[np.ndarray, np.ndarray]:
    """An overlay hash (HGETALL) -> (ids sorted [k], rows [k], -1: evicted)."""
    if not over:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ids = np.frombuffer(b"".join(over.keys()), dtype="<i8").astype(np.int64)
    rows = np.frombuffer(b"".join(over.values()), dtype="<i8").astype(np.int64)
    order = np.argsort(ids)
    return ids[order], rows[order]
