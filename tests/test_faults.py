"""Hung and lost ranks: bounded exits naming the rank, then resumes (elastic ones included).

A SIGSTOPped process keeps its sockets open: only its silence (no heartbeat) gives it away. Every
scenario here stops a rank and checks that the job ends within ``dist.timeout_s`` plus a few
seconds, with status 2 and a line naming the rank; the run then resumes, with other numbers of
trainers and servers, to the uninterrupted run's AUC.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dense_trainer.train import Trainer
from embedding_server.checkpoint.files import checkpoint_chain, latest_checkpoint, read_manifest
from embedding_server.runtime.watchdog import connect, read_status

from .conftest import REPO, tiny_config

pytestmark = pytest.mark.slow

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
TIMEOUT_S = 6
BLOCK_BYTES = 1 << 16
"""Blocks small enough that every trainer has a share of the 20,000 rows."""
HASH = 300_000  # tables large enough that restoring them takes a moment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(data: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = [*train_args(data, out), *extra]
    return subprocess.Popen(
        [*DLRM, *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate, what: str, timeout: float = 120, every: float = 0.01):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def pid_of(out: Path, rank: int) -> int:
    path = out / "ranks" / f"rank-{rank}.json"
    return wait_for(
        lambda: path.exists() and json.loads(path.read_text())["pid"], f"rank {rank}'s pid"
    )


def stopped_job_ends(proc: subprocess.Popen, pid: int, rank_text: str) -> str:
    """SIGSTOP ``pid``; the job must end promptly, with status 2, naming the rank."""
    os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S + 60)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    elapsed = time.time() - t0
    assert proc.returncode == 2, output
    assert f"error: {rank_text} is stopped (SIGSTOP)" in output, output
    assert elapsed < TIMEOUT_S + 15, f"the job took {elapsed:.0f}s to end"
    assert "Traceback" not in output
    return output


def test_stopped_ranks_end_the_job_then_elastic_resumes_complete(synth_small, tmp_path):
    out = tmp_path / "run"
    dist2 = ["--embedding-servers", "2", "--trainers", "2"]
    # 1. during start-up (before it joins): a trainer
    proc = train(synth_small, out, *dist2)
    stopped_job_ends(proc, pid_of(out, 1), "rank 1 (trainer 1)")
    # 2. mid-run, after a checkpoint: an embedding server
    proc = train(synth_small, out, *dist2)
    wait_for(lambda: latest_checkpoint(out / "checkpoints"), "a checkpoint")
    stopped_job_ends(proc, pid_of(out, 3), "rank 3 (embedding server 1)")
    # 3. while a resumed run restores that checkpoint: the other server
    port = free_port()
    proc = train(synth_small, out, *dist2, "--resume", "--set", f"dist.master_port={port}")
    store = wait_for(lambda: _connect(port), "the launcher's store")
    wait_for(
        lambda: read_status(store, 2).get("phase", "").startswith("restoring"),
        "rank 2 restoring",
        every=0.002,
    )
    output = stopped_job_ends(proc, pid_of(out, 2), "rank 2 (embedding server 0)")
    assert "while restoring step-" in output
    # 4. elastic: the T=2, E=2 checkpoint resumed with one trainer and one server (on a copy, 12
    #    steps), whose checkpoint writer is throttled so that its first checkpoint (all the rows
    #    trained so far, as many bytes as the restored one at least) takes longer than
    #    dist.timeout_s to write: training goes on, skipping the checkpoints that fall due
    #    meanwhile, and the last one is waited for.
    manifest = read_manifest(latest_checkpoint(out / "checkpoints"))
    written, nbytes = manifest["step"], sum(f["bytes"] for f in manifest["files"].values())
    shutil.copytree(out / "checkpoints", tmp_path / "one" / "checkpoints")
    done = subprocess.run(
        [
            *DLRM,
            *map(str, train_args(synth_small, tmp_path / "one")),
            "--resume",
            "--trainers",
            "1",
            "--embedding-servers",
            "1",
            "--set",
            f"train.max_steps={written + 12}",
            "--set",
            "train.checkpoint_every_steps=2",
            "--set",
            f"train.checkpoint_write_bytes_per_s={nbytes / (TIMEOUT_S + 3):.0f}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "written by 2 trainer(s), resumed by 1" in done.stderr
    metrics = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert metrics["steps"] == written + 12 and metrics["samples_seen"] == (written + 12) * 256
    ckpts = metrics["checkpoints"]
    assert ckpts["longest_s"] > TIMEOUT_S and ckpts["skipped"] >= 1, ckpts
    assert ckpts["last"]["step"] == written + 12
    # 5. ... and with three of each, to the end: the data position carried over
    done = subprocess.run(
        [
            *DLRM,
            *map(str, train_args(synth_small, out)),
            "--resume",
            "--trainers",
            "3",
            "--embedding-servers",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "written by 2 trainer(s), resumed by 3" in done.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["samples_seen"] == 20_000 and metrics["trainers"] == 3
    # The uninterrupted run: two trainers' shares of the blocks, as one process reads them.
    reference = Trainer(
        tiny_config(
            train={"batch_size": 256},
            embedding={"hash_size": HASH},
            data={"block_bytes": BLOCK_BYTES, "interleave": 2},
        ),
        tmp_path / "ref",
    ).fit([synth_small / "train.txt"], [synth_small / "test.txt"])
    assert abs(metrics["test_auc"] - reference["test_auc"]) < 0.003
    # No checkpoint left current-but-incomplete, none corrupt: the latest chain reads back whole.
    for path in checkpoint_chain(latest_checkpoint(out / "checkpoints")):
        assert set(read_manifest(path)["writers"]) >= {"trainer-0"}


def train_args(data: Path, out: Path) -> list:
    return [
        "train",
        "--train",
        data / "train.txt",
        "--test",
        data / "test.txt",
        "--out",
        out,
        "--config",
        "configs/tiny.toml",
        "--batch-size",
        "256",
        "--hash-size",
        str(HASH),
        "--no-progress",
        "--set",
        "train.checkpoint_every_steps=20",
        "--set",
        f"dist.timeout_s={TIMEOUT_S}",
        "--set",
        f"data.block_bytes={BLOCK_BYTES}",
        "--validation",
        "0",  # every row trained on, every epoch: the tests count rows and deltas
    ]


def _connect(port: int):
    """The launcher's store once it listens, else None at once: a store client started before
    that backs off for seconds, and the ranks (forks of a ready fork server) may have restored by
    then."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return connect("127.0.0.1", port, 2.0)
    except Exception:
        return None


EPOCHS = 3
"""Long enough (about 900 steps) that three deltas are cut well before the run ends, at any
speed."""


def test_incremental_checkpoints_bound_the_updates_a_killed_server_loses(synth_small, tmp_path):
    out, interval = tmp_path / "run", 1.0
    args = [
        "train",
        "--train",
        synth_small / "train.txt",
        "--test",
        synth_small / "test.txt",
        "--out",
        out,
        "--config",
        "configs/tiny.toml",
        "--batch-size",
        "64",
        "--no-progress",
        "--embedding-servers",
        "2",
        "--set",
        "train.checkpoint_every_steps=0",
        "--set",
        f"train.checkpoint_delta_every_s={interval}",
        "--set",
        f"dist.timeout_s={TIMEOUT_S}",
        "--epochs",
        EPOCHS,
        "--validation",
        "0",  # no best-model checkpoints: only the deltas under test
    ]
    proc = subprocess.Popen(
        [*DLRM, *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def deltas() -> list[Path] | None:
        if proc.poll() is not None:  # ended before three deltas: fail now, with what it printed
            raise AssertionError(
                f"the run ended (status {proc.returncode}) before three deltas:\n"
                f"{proc.stdout.read()}"
            )
        try:
            chain = checkpoint_chain(latest_checkpoint(out / "checkpoints"))
        except Exception:  # none yet, or pruned while read
            return None
        return chain if len(chain) >= 4 else None

    wait_for(deltas, "three deltas")
    os.kill(pid_of(out, 2), signal.SIGKILL)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "rank 2 (embedding server 1) was killed by SIGKILL" in output, (
        output
    )
    assert "Traceback" not in output
    fault = json.loads((out / "last-fault.json").read_text())
    latest = latest_checkpoint(out / "checkpoints")
    assert read_manifest(latest)["kind"] == "delta"
    # Updates lost: the steps between the last checkpoint and the fault, at most about one
    # interval's worth (plus the finaliser's latency and one heartbeat of imprecision).
    cuts = [read_manifest(p) for p in checkpoint_chain(latest)[-3:]]
    rate = (cuts[-1]["step"] - cuts[0]["step"]) / (
        cuts[-1]["meta"]["cut_time"] - cuts[0]["meta"]["cut_time"]
    )
    lost = fault["step"] - read_manifest(latest)["step"]
    print(f"{rate:.1f} steps/s; {lost} steps of updates lost (bound {rate * (interval + 2.5):.0f})")
    assert lost <= rate * (interval + 2.5)
    resumed = subprocess.run(
        [*DLRM, *map(str, args), "--resume"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    # the chain (full + deltas) restored onto both servers
    assert metrics["samples_seen"] == 20_000 * EPOCHS
    assert metrics["resumed_after_fault"]["steps_redone"] == max(lost, 0)
    reference = Trainer(
        tiny_config(train={"batch_size": 64, "epochs": EPOCHS}), tmp_path / "ref"
    ).fit([synth_small / "train.txt"], [synth_small / "test.txt"])
    assert abs(metrics["test_auc"] - reference["test_auc"]) < 0.003
