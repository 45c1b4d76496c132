"""The prepared GPU check (bench/gpu_check.py) runs end to end without CUDA: the same layouts on
the CPU, so the one call a lent GPU machine gets is known to work before it is made."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_every_layout_on_the_cpu(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_check.py"),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--rows",
            "2000",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no CUDA device: running the same check on the CPU" in run.stdout
    result = json.loads((tmp_path / "gpu.json").read_text())
    names = ["single process", "E1,T1 lockstep", "E1,T1 exact", "E1,T1 semi-sync", "E2,T1 exact"]
    assert list(result["results"]) == names
    for name in names:
        r = result["results"][name]
        assert r["device"] == "cpu" and r["samples_per_s"] > 0, (name, r)
        assert set(r["breakdown_ms"]) >= {
            "embedding_forward",
            "dense_forward",
            "backward",
            "optimizer",
        }
    md = (tmp_path / "gpu.md").read_text()
    assert all(f"| {name} | cpu |" in md for name in names)
