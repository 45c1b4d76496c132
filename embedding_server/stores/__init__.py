"""Serving stores: one interface (:class:`ServingStore`), two backends chosen by URL.

* ``file://DIR``: the embedded default; memory-mapped per-table arrays plus JSON metadata.
* ``redis://[user[:password]@]host:port/db`` (``rediss://`` for TLS): rows as binary blobs in
  hashes, pipelined multi-gets, a model registry, live row updates through a stream.

The password is best kept out of the URL: ``password_file`` (``--store-password-file``, or the
``DLRM_STORE_PASSWORD_FILE`` variable, which every process that opens a store reads) holds it.
"""

from __future__ import annotations

import os
from pathlib import Path

from dlrm_core.secrets import read_secret_file
from dlrm_core.store_url import check_store_url, file_store_dir
from embedding_server.stores.base import (
    ServingStore,
    StoreUnavailable,
    UpdateBatch,
    VersionNotFound,
    VersionWriter,
)

PASSWORD_FILE_ENV = "DLRM_STORE_PASSWORD_FILE"


def open_store(
    url: str,
    keep_versions: int = 3,
    timeout_s: float = 1.0,
    password_file: str | Path | None = None,
) -> ServingStore:
    """Open the store at ``url`` (``file://DIR``, a bare path, ``redis://...`` or ``rediss://...``).

    Args:
        keep_versions: versions kept when a new one is published.
        timeout_s: socket timeout of every call to a remote store.
        password_file: file holding the store's password (default: ``$DLRM_STORE_PASSWORD_FILE``).
    """
    if check_store_url(url) == "file":
        from embedding_server.stores.file_store import FileStore

        return FileStore(file_store_dir(url), keep_versions=keep_versions)
    from embedding_server.stores.redis_store import RedisStore

    password_file = password_file or os.environ.get(PASSWORD_FILE_ENV) or None
    password = read_secret_file(password_file, "store password file") if password_file else None
    return RedisStore(url, keep_versions=keep_versions, timeout_s=timeout_s, password=password)


__all__ = [
    "ServingStore",
    "StoreUnavailable",
    "UpdateBatch",
    "VersionNotFound",
    "VersionWriter",
    "open_store",
]
