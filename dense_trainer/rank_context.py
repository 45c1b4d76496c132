"""How the local launcher starts its ranks: forks of a fork server.

The fork server is a clean process (no threads: no rendezvous store, no OpenMP pool yet) that
imports :data:`RANK_PRELOAD` once; each rank is then a cheap fork of it instead of a fresh
interpreter importing torch and fbgemm (about 3 s of CPU per rank). It lasts as long as the
launcher and serves its later jobs too. Forking the launcher itself would copy its store's
threads. Ranks take the launcher's environment and working directory of the moment they start
(``distributed._child``), as spawned processes would. Torch-free, so that ``dlrm train`` can start
the server while it still checks its flags and files.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

RANK_PRELOAD = [
    "dense_trainer.distributed",
    "dense_trainer.train",
    "embedding_server.runtime.server",
]
"""What the fork server imports before forking the ranks."""


def rank_context(start: bool = False):
    """The ``forkserver`` context with :data:`RANK_PRELOAD`; ``start``: start the server now (it
    imports in the background) rather than at the first rank."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    if start:
        multiprocessing.forkserver.ensure_running()
    return ctx


def launcher_state() -> tuple[dict[str, str], str]:
    """What a rank takes from the launcher when it starts: its environment and directory now."""
    return dict(os.environ), os.getcwd()


def adopt_launcher_state(env: dict[str, str], cwd: str) -> None:
    """In a rank: the launcher's environment and directory of :func:`launcher_state` (the fork
    server's are those of the launcher's first job, which may have changed since)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
