"""Serving stores: one interface (:class:`ServingStore`), two backends chosen by URL.

* ``file://DIR``: the embedded default; memory-mapped per-table arrays plus JSON metadata.
* ``redis://[:password@]host:port/db``: rows as binary blobs in hashes, pipelined multi-gets,
  a model registry, live row updates through a stream.
"""

from __future__ import annotations

from urllib.parse import urlparse

from dlrm_core.errors import ConfigError
from embedding_server.stores.base import (
    ServingStore,
    StoreUnavailable,
    UpdateBatch,
    VersionWriter,
)


def open_store(url: str, keep_versions: int = 3, timeout_s: float = 1.0) -> ServingStore:
    """Open the store at ``url`` (``file://DIR``, a bare path, or ``redis://...``).

    Args:
        keep_versions: versions kept when a new one is published.
        timeout_s: socket timeout of every call to a remote store.
    """
    parsed = urlparse(url)
    if parsed.scheme in ("file", ""):
        from embedding_server.stores.file_store import FileStore

        path = parsed.path if parsed.scheme == "file" else url
        if parsed.scheme == "file" and parsed.netloc:  # file://relative/dir
            path = parsed.netloc + parsed.path
        return FileStore(path, keep_versions=keep_versions)
    if parsed.scheme in ("redis", "rediss", "unix"):
        from embedding_server.stores.redis_store import RedisStore

        return RedisStore(url, keep_versions=keep_versions, timeout_s=timeout_s)
    raise ConfigError(f"store URL {url!r}: unknown scheme {parsed.scheme!r} (use file://DIR or redis://host:port/db)")


__all__ = ["ServingStore", "StoreUnavailable", "UpdateBatch", "VersionWriter", "open_store"]
