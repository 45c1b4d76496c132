"""The Redis store's live updates: a generation of rows, id-map entries and owners written in
one script with the stream entry naming it (``UPDATE_ROWS``, ``UPDATE_DENSE``), and a serving
replica's poll of that stream (``P:v:<v>:updates``), which notices a gap by the generations."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from embedding_server.idmap.view import IdMapDelta
from embedding_server.stores.base import UpdateBatch
from embedding_server.stores.redis_blocks import block_len, block_rows, rows_by_block
from embedding_server.stores.redis_idmaps import compact_after_push, int64_items, overlay_keys
from embedding_server.wire import decode_ids, encode_ids, encode_rows, encode_state

UPDATES_MAXLEN = 20_000
"""Live-update stream entries kept; a reader further behind reloads its version."""


def live_keys(store, version: str) -> list[str]:
    return [
        store.key("v", version, "meta"),
        store.key("v", version, "gen"),
        store.key("v", version, "updates"),
    ]


def update_rows(
    store,
    version: str,
    updates: dict[str, tuple[np.ndarray, np.ndarray]],
    id_maps: dict[str, IdMapDelta] | None = None,
) -> None:
    """One generation: every table's rows, dynamic tables' map entries (the overlay hashes) and
    owners, and the stream entry naming them, atomically, and only while the version exists
    (never recreating keys of a deleted one)."""
    meta = store.read_meta(version)
    id_maps = id_maps or {}
    entry = [
        item
        for table, (ids, _) in updates.items()
        for item in (f"t:{table}".encode(), encode_ids(ids))
    ]
    entry += [
        item
        for table, delta in id_maps.items()
        for item in (f"m:{table}".encode(), delta.to_bytes())
    ]
    keys = live_keys(store, version) + overlay_keys(store, version, list(id_maps))
    args = [UPDATES_MAXLEN, len(entry) // 2, *entry, len(id_maps)]
    for delta in id_maps.values():
        args.append(len(delta))
        args.extend(
            b
            for pair in zip(int64_items(delta.ids), int64_items(delta.rows), strict=True)
            for b in pair
        )
    specs = {t.name: t for t in meta.spec.tables}
    blocks = [
        (
            store.rows_key(version, table, ""),
            ids,
            encode_rows(rows, meta.row_dtype),
            specs[table].rows,
        )
        for table, (ids, rows) in updates.items()
    ]
    blocks += [
        (
            store.owners_key(version, table, ""),
            d.slots,
            np.asarray(d.owners, "<i8"),
            specs[table].rows,
        )
        for table, d in id_maps.items()
    ]
    for base, ids, enc, table_rows in blocks:
        enc = enc.view(np.uint8).reshape(len(ids), -1)  # [n, W bytes]
        width = enc.shape[1]
        per_block = block_rows(width)
        for block, pieces in rows_by_block(np.asarray(ids, np.int64), enc, per_block).items():
            keys.append(f"{base}{block}")
            args += [block_len(block, per_block, table_rows) * width, len(pieces)]
            args.extend(item for piece in pieces for item in piece)
    with store.errors():
        generation = store._scripts["UPDATE_ROWS"](keys=keys, args=args)
    if generation < 0:
        raise store._gone(version)
    compact_after_push(store, version, list(id_maps))


def update_dense(store, version: str, state: dict[str, torch.Tensor]) -> None:
    with store.errors():
        generation = store._scripts["UPDATE_DENSE"](
            keys=[*live_keys(store, version), store.key("v", version, "dense")],
            args=[UPDATES_MAXLEN, encode_state(state)],
        )
    if generation < 0:
        raise store._gone(version)


def poll_updates(store, version: str, cursor: str | None) -> UpdateBatch:
    """Cursor ``"<generation>:<stream id>"``. Entries carry their generation, so a gap (the
    stream was trimmed past entries this reader had not seen) is noticed: ``lost``."""
    meta_key, gen_key, stream = live_keys(store, version)
    seen, _, after = (cursor or "0:0-0").partition(":")
    with store.errors():
        pipe = store.client.pipeline(transaction=True)
        pipe.exists(meta_key)
        pipe.get(gen_key)
        if cursor is None:
            pipe.xrevrange(stream, count=1)
        else:
            pipe.xread({stream: after}, count=10_000)
        alive, generation, entries = pipe.execute()
    if not alive:
        raise store._gone(version)
    generation = int(generation or 0)
    if cursor is None:
        last = entries[0][0].decode() if entries else "0-0"
        return UpdateBatch(cursor=f"{generation}:{last}", generation=generation)
    return _batch(entries, int(seen), after, generation)


def _batch(entries, seen: int, after: str, generation: int) -> UpdateBatch:
    """Stream entries after generation ``seen`` -> what changed, or ``lost`` on a gap."""
    items = [item for _name, stream_items in (entries or []) for item in stream_items]
    batch = UpdateBatch(cursor=f"{seen}:{after}", generation=seen)
    rows: dict[str, list[np.ndarray]] = defaultdict(list)
    for entry_id, fields in items:
        g = int(fields.get(b"g", -1))
        if g != batch.generation + 1:  # a gap, or an entry without a generation
            return UpdateBatch(
                cursor=f"{generation}:{items[-1][0].decode()}", generation=generation, lost=True
            )
        batch.generation, batch.cursor = g, f"{g}:{entry_id.decode()}"
        if batch.written_at is None:  # a stream id starts with the server's time in ms
            batch.written_at = int(entry_id.split(b"-")[0]) / 1000
        for name, value in fields.items():
            if name == b"dense":
                batch.dense_changed = True
            elif name.startswith(b"t:"):
                rows[name[2:].decode()].append(decode_ids(value))
            elif name.startswith(b"m:"):  # in stream order: the later change wins
                table, delta = name[2:].decode(), IdMapDelta.from_bytes(value)
                batch.id_maps[table] = (
                    batch.id_maps[table].then(delta) if table in batch.id_maps else delta
                )
    if not items and generation > seen:  # every entry after ours was trimmed
        return UpdateBatch(cursor=f"{generation}:{after}", generation=generation, lost=True)
    batch.rows = {t: np.unique(np.concatenate(v)) for t, v in rows.items()}
    return batch
