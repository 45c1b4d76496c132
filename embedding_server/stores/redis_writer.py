"""Writing a version into the Redis store: rows in blocks through a bounded pipeline, the dense
weights, dynamic tables' id maps and owners, then the version made current in one transaction
(a writer's lease keeps a concurrent collector from taking it for dead)."""

from __future__ import annotations

import logging
import time

import numpy as np
import redis
import torch

from embedding_server.idmap.view import owners_of
from embedding_server.stores.base import StoreUnavailable, VersionWriter
from embedding_server.stores.redis_blocks import BlockBuffer, block_rows
from embedding_server.stores.redis_idmaps import OWNER_BYTES
from embedding_server.wire import ModelVersion, encode_rows, encode_state, row_bytes

log = logging.getLogger(__name__)

PIPELINE_BYTES = 4 << 20
"""Flush a write pipeline after this many bytes of rows (bounds publisher memory)."""
LEASE_S = 600
"""How long a writer's lease lasts without a flush renewing it."""


class RedisVersionWriter(VersionWriter):
    def __init__(self, store, meta: ModelVersion) -> None:
        self.store = store
        self.meta = meta
        self._pipe = store.bulk.pipeline(transaction=False)
        self._bytes = 0
        self._blocks: dict[str, BlockBuffer] = {}
        self.rows_stored = 0
        """Rows written into blocks so far (a block with one kept row is written whole)."""
        store.make_room(sum(t.rows * row_bytes(t.dim, meta.row_dtype) for t in meta.spec.tables))
        v = meta.version
        with store.errors():  # the lease first: a concurrent collector must not take it for dead
            store.client.set(store.key("writing", v), "1", ex=LEASE_S)
            store.client.sadd(store.key("incomplete"), v)

    def _flush(self) -> None:
        with self.store.errors():
            self._pipe.set(self.store.key("writing", self.meta.version), "1", ex=LEASE_S)
            try:
                self._pipe.execute()
            except redis.exceptions.OutOfMemoryError:
                # maxmemory reached (noeviction refuses writes): collect the versions that may
                # go (all but the current one), then write again, once
                if not self.store.collect_garbage(keep=0):
                    raise
                log.warning(
                    "redis store %s: out of memory, collected old versions to write %s",
                    self.store.url,
                    self.meta.version,
                )
                self._pipe.execute()
        self._bytes = 0

    def write_rows(
        self, table: str, start: int, rows: np.ndarray, keep: np.ndarray | None = None
    ) -> None:
        buffer = self._blocks.get(table)
        if buffer is None:
            spec = next(t for t in self.meta.spec.tables if t.name == table)
            buffer = self._blocks[table] = BlockBuffer(
                spec.rows, row_bytes(spec.dim, self.meta.row_dtype)
            )
        # [n, W bytes]
        enc = encode_rows(rows, self.meta.row_dtype).view(np.uint8).reshape(len(rows), -1)
        self._set_blocks(table, buffer.add(start, enc, keep))

    def _set_blocks(self, table: str, blocks: list[tuple[int, bytes]]) -> None:
        for block, blob in blocks:  # one SET of ~16 KB per block: no command holds Redis long
            self._pipe.set(self.store.rows_key(self.meta.version, table, block), blob)
            self._bytes += len(blob)
            self.rows_stored += len(blob) // self._blocks[table].row_bytes
            if self._bytes >= PIPELINE_BYTES:
                self._flush()

    def write_dense(self, state: dict[str, torch.Tensor]) -> None:
        self._pipe.set(self.store.key("v", self.meta.version, "dense"), encode_state(state))

    def write_id_map(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        pair = np.stack([ids, rows]).astype("<i8")
        self._pipe.set(self.store.key("v", self.meta.version, "idmap", table), pair.tobytes())
        spec = next(t for t in self.meta.spec.tables if t.name == table)
        owner = owners_of(spec.rows, ids, rows).astype("<i8")
        per_block = block_rows(OWNER_BYTES)
        for block, start in enumerate(range(0, spec.rows, per_block)):
            self._pipe.set(
                self.store.owners_key(self.meta.version, table, block),
                owner[start : start + per_block].tobytes(),
            )
            self._bytes += per_block * OWNER_BYTES
        self.meta.owners = True

    def commit(self) -> None:
        s, v = self.store, self.meta.version
        for table, buffer in self._blocks.items():
            self._set_blocks(table, buffer.drain())
        self._pipe.set(s.key("v", v, "meta"), self.meta.model_dump_json())
        self._flush()
        with s.errors():
            pipe = s.client.pipeline(transaction=True)
            pipe.zadd(s.key("versions"), {v: time.time()})
            pipe.srem(s.key("incomplete"), v)
            pipe.delete(s.key("writing", v))
            pipe.set(s.key("current"), v)  # the version is complete: readers may switch
            pipe.execute()
        s.collect_garbage(v)

    def abort(self) -> None:
        self._pipe.reset()
        try:
            self.store.delete_version(self.meta.version)
        except StoreUnavailable:
            log.warning("could not clean up version %s after an aborted publish", self.meta.version)
