"""What bench/online.py's parts share: a redis-server of its own, configs, running online and
file training in this process, and the served-score probe of the freshness part."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import redis

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from dense_trainer.config import Config, load_config  # noqa: E402
from dense_trainer.distributed import free_port  # noqa: E402
from dense_trainer.metrics import roc_auc  # noqa: E402
from dense_trainer.online import OnlineTraining, stream_config  # noqa: E402
from dense_trainer.progressive import Scores  # noqa: E402
from dense_trainer.train import Trainer  # noqa: E402

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]


class Redis:
    """A redis-server on a free loopback port, data in a temporary directory."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            sys.exit("bench/online.py needs redis-server (make setup installs it as root)")
        self.dir = Path(tempfile.mkdtemp(prefix="online-redis-"))
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.client = redis.Redis(port=self.port, decode_responses=True)
        for _ in range(100):
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def config(overrides: list[dict], base: Path | None = None) -> Config:
    """The bench's config: ``base`` (a TOML) or the defaults, dynamic ids, then ``overrides``."""
    common = {
        "embedding": {"ids": "dynamic", "hash_size": 100_000},
        "train": {"validation": 0.0, "epochs": 1, "progress": False},
    }
    return load_config(base, [common, *overrides])


def stream_settings(url: str, tag: str, **more) -> dict:
    return {
        "stream": {
            "url": url,
            "impressions": f"imp-{tag}",
            "clicks": f"clk-{tag}",
            "idle_exit_s": 2.0,
            "join_window_s": 2.0,
            "report_every_s": 1e9,
            **more,
        }
    }


class SegmentScores(OnlineTraining):
    """Online training that also keeps the progressive scores of each segment of the stream
    (impression ``r-N`` belongs to segment ``N // rows_per_segment``)."""

    def __init__(self, trainer: Trainer, rows_per_segment: int) -> None:
        super().__init__(trainer)
        self.rows_per_segment = rows_per_segment
        self.segments: dict[int, Scores] = {}

    def _train(self, step) -> None:
        super()._train(step)
        seg = np.array([int(i.rsplit("-", 1)[1]) for i in step.impression_ids])
        seg //= self.rows_per_segment
        logits, labels = self.trainer.last_logits, step.batch.labels
        for k in np.unique(seg):
            mask = seg == k
            self.segments.setdefault(int(k), Scores()).add(logits[mask], labels[mask])


def online(cfg: Config, out: Path, rows_per_segment: int = 0) -> tuple[dict, OnlineTraining]:
    trainer = Trainer(stream_config(cfg), out)
    run = SegmentScores(trainer, rows_per_segment) if rows_per_segment else OnlineTraining(trainer)
    return run.run(), run


def file_training(cfg: Config, files: list[Path], out: Path) -> tuple[dict, Trainer]:
    trainer = Trainer(cfg, out)
    return trainer.fit(files, []), trainer


def file_auc(trainer: Trainer, path: Path) -> float:
    """Exact AUC of ``trainer``'s model, unchanged, on every row of ``path``."""
    scores, labels = [], []
    for batch in trainer.loader([path], 8192):
        scores.append(trainer.predict(batch).numpy())
        labels.append(batch.labels.numpy())
    return roc_auc(np.concatenate(scores), np.concatenate(labels))


def predict(port: int, instance: dict, timeout_s: float = 5.0) -> float:
    body = json.dumps({"instances": [instance]}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models/dlrm:predict",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return float(json.loads(r.read())["predictions"][0])


def instance_of(row: dict[str, str]) -> dict:
    """A Criteo-layout row (column -> text) as a V1 instance by feature name."""
    out: dict = {}
    for k, v in row.items():
        if k == "label":
            continue
        out[k] = int(v) if k.startswith("I") else v
    return out


def wait_ready(port: int, proc: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("dlrm serve exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("dlrm serve did not become ready")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]
