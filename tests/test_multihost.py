"""Trainers and embedding servers on separate hosts: network namespaces with their own
addresses on a bridge (root), so the all-to-alls cross real interfaces. Where namespaces cannot
be made, the same processes run over loopback, and the test says which it used."""

import json
import os
import subprocess
import sys

import pytest

from . import netns
from .conftest import REPO

pytestmark = pytest.mark.slow


def test_trainer_and_servers_on_separate_hosts(synth_small, tmp_path):
    why_not = netns.available()
    out = tmp_path / "run"
    flags = [
        "--train",
        str(synth_small / "train.txt"),
        "--test",
        str(synth_small / "test.txt"),
        "--out",
        str(out),
        "--config",
        "configs/tiny.toml",
        "--embedding-servers",
        "2",
        "--trainers",
        "1",
        "--no-progress",
        "--set",
        "dist.timeout_s=30",
        "--validation",
        "0",  # every row trained on: the test counts them
    ]
    worker = [sys.executable, str(REPO / "dlrm_cli.py"), "worker", *flags]
    world = 3
    procs = []

    def start(rank: int, argv: list[str], env: dict) -> None:
        procs.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                env={**os.environ, **env, "RANK": str(rank), "WORLD_SIZE": str(world)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )

    if why_not is None:
        mode = "network namespaces"
        with netns.Hosts(world) as hosts:
            master = hosts.addrs[0]
            # rank 0: the trainer on host 0; ranks 1, 2: servers on hosts 1, 2
            for rank in range(world):
                start(
                    rank,
                    hosts.command(rank, worker),
                    {
                        "MASTER_ADDR": master,
                        "MASTER_PORT": "29731",
                        "GLOO_SOCKET_IFNAME": hosts.ifname,
                    },
                )
            outputs = [p.communicate(timeout=240)[0] for p in procs]
            traffic = [hosts.traffic(i) for i in range(world)]
    else:
        mode = f"loopback ({why_not})"
        for rank in range(world):
            start(rank, worker, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731"})
        outputs = [p.communicate(timeout=240)[0] for p in procs]
        traffic = None
    print(f"multi-host test ran over {mode}")
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["embedding_servers"] == 2 and metrics["samples_seen"] == 20_000
    assert metrics["test_auc"] > 0.6
    assert "test AUC" in outputs[0]  # the master prints the table
    if traffic is not None:  # the ids, pooled embeddings and gradients crossed the interfaces
        print("bytes (rx, tx) per host:", traffic)
        per_server = metrics["alltoall_bytes_per_sample"]["servers_to_trainers"] * 20_000 / 2
        for rx, tx in traffic[1:]:
            assert rx > 0.5 * per_server and tx > 0.5 * per_server
