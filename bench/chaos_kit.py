"""The chaos bench's kit (``bench/chaos.py``): the job setting, processes and waits, the
API under load, checkpoint checks and the resumed run's score."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dense_trainer.data.synth import synthesize  # noqa: E402
from dense_trainer.metrics import roc_auc  # noqa: E402
from embedding_server.checkpoint.files import (  # noqa: E402
    checkpoint_chain,
    latest_checkpoint,
    load_file,
    read_manifest,
)

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
ROLES = ["trainer", "master trainer", "embedding server", "API worker", "Redis", "host link"]
RANK_OF = {"trainer": 1, "master trainer": 0, "embedding server": 2}
ROLE_TEXT = {
    0: "rank 0 (trainer 0, master)",
    1: "rank 1 (trainer 1)",
    2: "rank 2 (embedding server 0)",
    3: "rank 3 (embedding server 1)",
}
AUC_TOLERANCE = 0.003


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, timeout: float = 180.0, every: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise RuntimeError(f"timed out waiting for {what}")


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# -- the setting: data, the uninterrupted run, two published versions ----------------------------


class Setting:
    """What every run compares against (made once in the work directory, reused by slices)."""

    def __init__(self, work: Path, timeout_s: float, rows: int = 20_000, batch: int = 64) -> None:
        self.work = work
        self.timeout_s = timeout_s
        self.rows, self.batch = rows, batch
        self.steps = -(-rows // batch)
        self.data = work / "data"
        if not (self.data / "test.txt").exists():
            synthesize(self.data, train_rows=rows, test_rows=rows // 4, seed=0)
        self.ref = work / "reference"
        if not (self.ref / "metrics.json").exists():
            shutil.rmtree(self.ref, ignore_errors=True)
            subprocess.run(
                [*DLRM, *self.train_args(self.ref)], cwd=REPO, check=True, capture_output=True
            )
        ref = json.loads((self.ref / "metrics.json").read_text())
        self.ref_auc = ref["test_auc"]
        self.steps_per_s = ref["train_samples_per_s"] / batch  # what one delta interval (1 s) holds
        fulls = sorted(
            p
            for p in (self.ref / "checkpoints").glob("step-*")
            if read_manifest(p).get("base") is None
        )
        self.versions = {"v1": fulls[-2], "v2": fulls[-1]}
        lines = (self.data / "test.txt").read_text().splitlines(keepends=True)
        self.test_lines, self.labels = lines, [int(line.split("\t", 1)[0]) for line in lines]
        self.probe = "".join(lines[:8])
        self._expected: dict[str, list[float]] | None = None

    @property
    def expected(self) -> dict[str, list[float]]:
        """The probe's predictions under each version (made when a serving run first needs them)."""
        if self._expected is None:
            self._expected = self._expected_predictions()
        return self._expected

    def train_args(self, out: Path, *extra: str) -> list[str]:
        return [
            "train",
            "--train",
            str(self.data / "train.txt"),
            "--test",
            str(self.data / "test.txt"),
            "--out",
            str(out),
            "--config",
            "configs/tiny.toml",
            "--batch-size",
            str(self.batch),
            "--no-progress",
            "--embedding-servers",
            "2",
            "--trainers",
            "2",
            "--set",
            "train.checkpoint_every_steps=100",
            "--set",
            "train.checkpoint_delta_every_s=1",
            "--set",
            f"dist.timeout_s={self.timeout_s:g}",
            "--set",
            "data.block_bytes=65536",
            *extra,
        ]

    def _expected_predictions(self) -> dict[str, list[float]]:
        """The probe's predictions under each version, served alone from a file store."""
        cache = self.work / "expected.json"
        if cache.exists():
            return json.loads(cache.read_text())
        out = {}
        for name, ckpt in self.versions.items():
            store = self.work / f"store-{name}"
            shutil.rmtree(store, ignore_errors=True)
            publish(ckpt, f"file://{store}", name)
            with Api(f"file://{store}", self.probe, workers=1) as api:
                out[name] = wait_for(
                    lambda a=api, n=name: a.answer_of(n), f"version {name} served"
                )["predictions"]
        cache.write_text(json.dumps(out))
        return out


def publish(
    ckpt: Path, url: str, version: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DLRM, "publish", "--checkpoint", str(ckpt), "--store", url, "--version", version],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- serving -------------------------------------------------------------------------------------


class Api:
    """`dlrm serve` as a black box: start, post, find its workers, stop."""

    def __init__(self, store: str, probe: str, workers: int = 2) -> None:
        self.port = free_port()
        self.probe = probe
        self.proc = subprocess.Popen(
            [
                *DLRM,
                "serve",
                "--store",
                store,
                "--port",
                str(self.port),
                "--workers",
                str(workers),
                "--log-level",
                "info",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "DLRM_POLL_INTERVAL_S": "0.2"},
        )
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc) -> None:
        for pid in self.workers():
            kill(pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def post(self, body: str, timeout: float = 5.0) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/models/dlrm:predict_tsv",
            data=body.encode(),
            headers={"Connection": "close"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            err = exc
            return err.code, _try(lambda: json.loads(err.read())) or {}
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            return 0, {"error": str(exc)}

    def answer_of(self, version: str) -> dict | None:
        """The probe's answer once ``version`` is served, else None."""
        status, body = self.post(self.probe)
        return body if status == 200 and body.get("model_version") == version else None

    def workers(self) -> list[int]:
        """Process ids of the uvicorn workers (children of `dlrm serve`)."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
                ppid = int(text[text.rindex(")") + 2 :].split()[1])
                cmd = (stat.parent / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmd:
                out.append(int(stat.parent.name))
        return sorted(out)

    def served_auc(self, lines: list[str], labels: list[int]) -> float:
        """AUC of the served predictions of the whole test set."""
        import numpy as np

        preds = []
        for i in range(0, len(lines), 500):
            status, body = self.post("".join(lines[i : i + 500]), timeout=30)
            if status != 200:
                raise RuntimeError(f"scoring the test set: HTTP {status} {body}")
            preds.extend(body["predictions"])
        q = np.clip(np.asarray(preds, dtype=np.float64), 1e-7, 1 - 1e-7)
        return roc_auc(np.log(q / (1 - q)), np.asarray(labels))


class Load:
    """A client posting the probe in a loop; every answer is checked against its version."""

    def __init__(self, api: Api, expected: dict[str, list[float]]) -> None:
        self.api, self.expected = api, expected
        # time, status, version, latency
        self.answers: list[tuple[float, int, str | None, float]] = []
        self.mixes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.time()
            status, body = self.api.post(self.api.probe, timeout=10)
            version = body.get("model_version") if status == 200 else None
            if version is not None and not _close(body["predictions"], self.expected.get(version)):
                self.mixes += 1
            self.answers.append((t0, status, version, time.time() - t0))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def ok_after(self, t: float) -> int:
        return sum(1 for t0, status, _, _ in self.answers if t0 >= t and status == 200)


def _close(a: list[float], b: list[float] | None) -> bool:
    return (
        b is not None
        and len(a) == len(b)
        and all(abs(x - y) <= 1e-4 for x, y in zip(a, b, strict=True))
    )


# -- training runs -------------------------------------------------------------------------------


def verify_checkpoints(root: Path) -> str | None:
    """None when ``latest`` names a complete checkpoint whose whole chain verifies, else what is
    wrong."""
    try:
        latest = latest_checkpoint(root)
        if latest is None:
            return None
        for path in checkpoint_chain(latest):
            for name in read_manifest(path)["files"]:
                load_file(path, name, mmap=True)  # digest checked
        for path in root.glob("step-*"):
            if not (path / "manifest.json").exists():
                return f"{path.name} has no manifest"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def resume_and_score(setting: Setting, out: Path, cmd: list[str] | None = None) -> dict:
    t0 = time.time()
    done = subprocess.run(
        cmd or [*DLRM, *setting.train_args(out, "--resume")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    result = {"resumed": done.returncode == 0, "resume_s": round(time.time() - t0, 1)}
    if done.returncode != 0:
        result["resume_error"] = (done.stdout + done.stderr).strip().splitlines()[-1:]
        return result
    metrics = json.loads((out / "metrics.json").read_text())
    result["auc_diff"] = abs(metrics["test_auc"] - setting.ref_auc)
    resumed = metrics.get("resumed_after_fault") or {}
    result["updates_lost_steps"] = resumed.get("steps_redone")
    result["resumed_step"] = resumed.get("resumed_step", 0)
    return result


def _try(fn):
    try:
        return fn()
    except Exception:
        return None
