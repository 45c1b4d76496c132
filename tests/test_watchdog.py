"""Heartbeats through a real TCPStore: silent (stopped) ranks and lost stores are named within
the timeout; a rank that ends on its own is not; a phase past its bound ends its rank."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from dense_trainer.distributed import free_port
from embedding_server.runtime.watchdog import EXIT_LOST, JobMonitor

from .conftest import REPO

pytestmark = pytest.mark.slow  # each starts Python processes that import torch

TIMEOUT = 2.0

RANK = textwrap.dedent("""
    import sys, time
    from embedding_server.runtime.watchdog import Heartbeat, connect
    TIMEOUT = float(sys.argv[6])
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    watch, mode = sys.argv[4] == "1", sys.argv[5]
    hb = Heartbeat(connect("127.0.0.1", port, 1.0), rank, world, lambda r: f"rank {r} (role {r})",
                   timeout_s=TIMEOUT, interval_s=0.2, watch_peers=watch, where=f"127.0.0.1:{port}",
                   prog="test").start()
    print("ready", flush=True)
    if mode == "done":
        time.sleep(0.5); hb.close(); sys.exit(0)
    if mode == "phase":
        with hb.phase("restoring step-7", 1.0):
            time.sleep(30)
    time.sleep(30)
""")


def rank(r: int, world: int, port: int, watch: bool, mode: str = "run") -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            RANK,
            str(r),
            str(world),
            str(port),
            "1" if watch else "0",
            mode,
            str(TIMEOUT),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def ready(*procs: subprocess.Popen) -> list[subprocess.Popen]:
    """Processes started together (they import torch in parallel), once each has begun beating."""
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return list(procs)


def hosted_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)


def test_launcher_names_a_stopped_rank_and_a_phase_has_a_bound():
    port = free_port()
    store = hosted_store(port)
    procs = ready(rank(0, 2, port, watch=False), rank(1, 2, port, watch=False, mode="phase"))
    try:
        monitor = JobMonitor(store, [p.pid for p in procs], TIMEOUT)
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.time()
        while (lost := monitor.lost([True, False])) is None and time.time() - t0 < 10:
            time.sleep(0.1)
        assert lost is not None and lost[0] == 0 and "is stopped (SIGSTOP)" in lost[1]
        assert TIMEOUT <= time.time() - t0 < TIMEOUT + 2
        # rank 1 waited in its phase ("restoring step-7", bound 1 s) for too long: it ended itself
        output, _ = procs[1].communicate(timeout=15)
        assert procs[1].returncode == EXIT_LOST
        assert (
            "rank 1 (role 1) stopped: restoring step-7 took longer than its bound of 1s" in output
        )
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("victim", ["peer", "store"])
def test_unsupervised_ranks_give_up_naming_what_they_lost(victim):
    port = free_port()
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time, torch.distributed as dist
        s = dist.TCPStore("127.0.0.1", {port}, is_master=True, wait_for_workers=False)
        print("ready", flush=True); time.sleep(60)"""),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert host.stdout.readline().strip() == "ready"
    # rank 1 ends on its own (it says so: not lost); rank 2, or the store's host, is stopped
    procs = ready(
        rank(0, 3, port, watch=True),
        rank(1, 3, port, watch=False, mode="done"),
        rank(2, 3, port, watch=False),
    )
    try:
        assert procs[1].wait(timeout=10) == 0
        os.kill((procs[2] if victim == "peer" else host).pid, signal.SIGSTOP)
        t0 = time.time()
        output, _ = procs[0].communicate(timeout=30)
        assert procs[0].returncode == EXIT_LOST
        assert time.time() - t0 < TIMEOUT + 3
        expected = (
            "rank 2 (role 2) sent no heartbeat"
            if victim == "peer"
            else "the rendezvous store 127.0.0.1"
        )
        assert f"test: rank 0 (role 0) stopped: {expected}" in output, output
    finally:
        for p in (*procs, host):
            p.kill()
