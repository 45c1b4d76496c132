#!/usr/bin/env python3
"""Make the secrets docker/compose.yaml mounts (``make compose-secrets``), once: random
passwords and an API key, and the Redis ACL file holding only their SHA-256 hashes.

    DIR/store-password       user ``dlrm``: publisher and trainers (read and write)
    DIR/api-store-password   user ``dlrm-api``: the API (read commands only)
    DIR/api-keys             bearer keys of the API, one per line (add one to rotate)
    DIR/users.acl            Redis users; the default (password-less) user is off

Existing files are kept (re-running never rotates a secret by surprise); the ACL file is
rewritten from the password files. Usage: python scripts/compose_secrets.py [DIR]
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from pathlib import Path

READER_COMMANDS = (
    "get",
    "zrange",
    "zscore",
    "exists",
    "xread",
    "xrange",
    "xrevrange",
    "multi",
    "exec",
    "discard",
    "ping",
    "evalsha_ro",
    "eval_ro",
    "getrange",
    "hgetall",
)
"""What a serving replica sends (api/, embedding_server/stores/redis_store.py): nothing that writes
(``getrange``: what the read-only gather script runs; a script runs as its caller; ``hgetall``:
a dynamic table's id-map overlay, read when a version loads)."""


def _secret(path: Path) -> str:
    if not path.exists():
        path.write_text(secrets.token_urlsafe(32) + "\n")
        os.chmod(path, 0o644)  # read by the containers' unprivileged users
    return path.read_text().splitlines()[0].strip()


def acl(writer_password: str, reader_password: str, prefix: str = "dlrm") -> str:
    """The ACL file: ``dlrm`` may do anything but the dangerous commands on the prefix's keys,
    ``dlrm-api`` only the read commands serving needs."""

    def sha(p: str) -> str:
        return hashlib.sha256(p.encode()).hexdigest()

    reader = " ".join(f"+{c}" for c in READER_COMMANDS)
    return (
        "user default off\n"
        f"user dlrm on #{sha(writer_password)} ~{prefix}:* resetchannels +@all -@dangerous\n"
        f"user dlrm-api on #{sha(reader_password)} ~{prefix}:* resetchannels -@all {reader}\n"
    )


def make(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    writer = _secret(directory / "store-password")
    reader = _secret(directory / "api-store-password")
    _secret(directory / "api-keys")
    (directory / "users.acl").write_text(acl(writer, reader))
    os.chmod(directory / "users.acl", 0o644)
    return {
        name: directory / name
        for name in ("store-password", "api-store-password", "api-keys", "users.acl")
    }


if __name__ == "__main__":
    out = Path(
        sys.argv[1]
        if len(sys.argv) > 1
        else Path(__file__).resolve().parents[1] / "docker" / "secrets"
    )
    for name, path in make(out).items():
        print(f"{name}: {path}")
