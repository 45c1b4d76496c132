"""Chaos: kill or stop a random role at a random moment; every run must end in bounded time naming
the role, resume to completion and reach the uninterrupted run's quality.

    python bench/chaos.py                          30 runs (seed 0), about 30 minutes on 2 cores
    python bench/chaos.py --runs 10 --first 10 --append     runs 10..19, merged into the results

Each run draws a role and a fault:

    trainer / master trainer / embedding server   SIGKILL or SIGSTOP at a random step of an E=2, T=2
                                                  `dlrm train` (deltas every second): the job must
                                                  end within dist.timeout_s + 15 s naming the rank;
                                                  then `--resume` must complete within 0.003 AUC of
                                                  the uninterrupted run; updates lost = steps redone
    host link                                     (root only) the four ranks as bare `dlrm worker`
                                                  processes in four network namespaces; one host's
                                                  link is cut (no TCP reset): every rank must give up
                                                  within dist.timeout_s + 30 s, the survivors naming
                                                  the lost one; then the job resumes (local launcher)
    API worker                                    SIGKILL or SIGSTOP one of `dlrm serve --workers 2`
                                                  under load: the worker must be gone (uvicorn's
                                                  supervisor names it: `Child process [pid] died`)
                                                  within 15 s; service resumes by itself; served AUC
    Redis                                         SIGKILL or SIGSTOP the serving store (append-only
                                                  file) while the API serves v1 and v2 is published:
                                                  requests and the publish fail in bounded time
                                                  naming the store; Redis restarts (or continues);
                                                  v2 is published; served AUC

After every training run the checkpoints are checked: ``latest`` names a complete checkpoint whose
whole chain verifies (every file's digest). Every served answer is checked against the
predictions of the version it names: a version never mixes another's rows or weights.
Results: bench/results/chaos.json (every run) and chaos.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from embedding_server.runtime.watchdog import connect, read_status  # noqa: E402

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
ROLES = ["trainer", "master trainer", "embedding server", "API worker", "Redis", "host link"]
RANK_OF = {"trainer": 1, "master trainer": 0, "embedding server": 2}
ROLE_TEXT = {0: "rank 0 (trainer 0, master)", 1: "rank 1 (trainer 1)", 2: "rank 2 (embedding server 0)",
             3: "rank 3 (embedding server 1)"}
AUC_TOLERANCE = 0.003


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, timeout: float = 180.0, every: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (value := predicate()):
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
            subprocess.run([*DLRM, *self.train_args(self.ref)], cwd=REPO, check=True, capture_output=True)
        ref = json.loads((self.ref / "metrics.json").read_text())
        self.ref_auc = ref["test_auc"]
        self.steps_per_s = ref["train_samples_per_s"] / batch  # what one delta interval (1 s) holds
        fulls = sorted(p for p in (self.ref / "checkpoints").glob("step-*") if read_manifest(p).get("base") is None)
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
        return ["train", "--train", str(self.data / "train.txt"), "--test", str(self.data / "test.txt"),
                "--out", str(out), "--config", "configs/tiny.toml", "--batch-size", str(self.batch), "--no-progress",
                "--embedding-servers", "2", "--trainers", "2", "--set", "train.checkpoint_every_steps=100",
                "--set", "train.checkpoint_delta_every_s=1", "--set", f"dist.timeout_s={self.timeout_s:g}",
                "--set", "data.block_bytes=65536", *extra]

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
                out[name] = wait_for(lambda a=api, n=name: a.answer_of(n), f"version {name} served")["predictions"]
        cache.write_text(json.dumps(out))
        return out


def publish(ckpt: Path, url: str, version: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*DLRM, "publish", "--checkpoint", str(ckpt), "--store", url, "--version", version],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


# -- serving -------------------------------------------------------------------------------------


class Api:
    """`dlrm serve` as a black box: start, post, find its workers, stop."""

    def __init__(self, store: str, probe: str, workers: int = 2) -> None:
        self.port = free_port()
        self.probe = probe
        self.proc = subprocess.Popen([*DLRM, "serve", "--store", store, "--port", str(self.port), "--workers",
                                      str(workers), "--log-level", "info"], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "DLRM_POLL_INTERVAL_S": "0.2"})
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
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/models/dlrm:predict_tsv", data=body.encode(),
                                     headers={"Connection": "close"})
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
        self.answers: list[tuple[float, int, str | None, float]] = []  # time, status, version, latency
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
    return b is not None and len(a) == len(b) and all(abs(x - y) <= 1e-4 for x, y in zip(a, b, strict=True))


# -- training runs -------------------------------------------------------------------------------


def verify_checkpoints(root: Path) -> str | None:
    """None when ``latest`` names a complete checkpoint whose whole chain verifies, else what is wrong."""
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
    done = subprocess.run(cmd or [*DLRM, *setting.train_args(out, "--resume")], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
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


def training_run(setting: Setting, role: str, fault: str, rng: random.Random, out: Path) -> dict:
    rank = RANK_OF[role] + (rng.randrange(2) if role == "embedding server" else 0)
    target = rng.randrange(10, int(setting.steps * 0.6))
    port = free_port()
    proc = subprocess.Popen([*DLRM, *setting.train_args(out, "--set", f"dist.master_port={port}")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = wait_for(lambda: _store("127.0.0.1", port), "the launcher's store", every=0.2)
    wait_for(lambda: (read_status(store, 0).get("step") or 0) >= target or proc.poll() is not None, "the step")
    pid = json.loads((out / "ranks" / f"rank-{rank}.json").read_text())["pid"]
    kill(pid, getattr(signal, fault))
    t0 = time.time()
    try:
        output, _ = proc.communicate(timeout=setting.timeout_s + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    exit_s = time.time() - t0
    kill(pid, signal.SIGCONT)
    kill(pid, signal.SIGKILL)
    fault_info = _try(lambda: json.loads((out / "last-fault.json").read_text())) or {}
    result = {"rank": rank, "at_step": fault_info.get("step", target), "exit_s": round(exit_s, 1),
              "status": proc.returncode, "named": f"error: {ROLE_TEXT[rank]}" in output,
              "bounded": proc.returncode not in (0, None) and exit_s <= setting.timeout_s + 15,
              "message": next((ln for ln in output.splitlines() if "error:" in ln and "dlrm train: error" in ln), "")}
    result["checkpoint_problem"] = verify_checkpoints(out / "checkpoints")
    result.update(resume_and_score(setting, out))
    if result.get("resumed") and result.get("updates_lost_steps") is None:  # no fault record, or no checkpoint
        result["updates_lost_steps"] = max(0, result["at_step"] - result["resumed_step"])
    return result


def _store(addr: str, port: int):
    """A client of the store at addr:port once it listens (else None)."""
    try:
        socket.create_connection((addr, port), timeout=1).close()
        return connect(addr, port, 2.0)
    except OSError:
        return None


def _try(fn):
    try:
        return fn()
    except Exception:
        return None


def _bounded(fn, timeout_s: float = 3.0):
    """fn() from a thread of its own, or None after ``timeout_s``: a store client whose host was cut
    off blocks in TCP retransmission for many minutes, whatever its own timeout says."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(_try(fn)), daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0] if box else None


# -- a host cut off the network --------------------------------------------------------------------


def link_run(setting: Setting, rng: random.Random, out: Path) -> dict:
    """Four ranks as bare `dlrm worker` processes, one network namespace each; one host's link is
    cut mid-run. No launcher watches them: every rank must give up by itself."""
    from tests.netns import Hosts, available

    if (why := available()) is not None:
        return {"skipped": f"no network namespaces ({why})"}
    net = rng.randrange(100, 200)
    victim, target = rng.randrange(4), rng.randrange(10, int(setting.steps * 0.6))
    port = free_port()
    worker = [*DLRM, "worker", *setting.train_args(out)[1:]]
    with Hosts(4, net=net) as hosts:
        subprocess.run(["ip", "addr", "add", f"10.{net}.0.254/24", "dev", hosts.bridge], check=True)  # to watch
        env = {**os.environ, "MASTER_ADDR": hosts.addrs[0], "MASTER_PORT": str(port), "WORLD_SIZE": "4",
               "GLOO_SOCKET_IFNAME": hosts.ifname}
        procs = [subprocess.Popen(hosts.command(r, worker), cwd=REPO, env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(4)]
        outputs: list[str] = [""] * 4
        drains = [threading.Thread(target=lambda i=i: outputs.__setitem__(i, procs[i].communicate()[0]), daemon=True)
                  for i in range(4)]
        for t in drains:
            t.start()
        store = wait_for(lambda: _store(hosts.addrs[0], port), "rank 0's store", every=0.5)
        wait_for(lambda: (read_status(store, 0).get("step") or 0) >= target or procs[0].poll() is not None, "the step")
        link = f"{hosts.bridge}v{victim}"  # the host's cable, on the bridge side
        reached = (_bounded(lambda: read_status(store, 0)) or {}).get("step", target)  # before the cut
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        t0 = time.time()
        ended = [None] * 4
        last_read = 0.0
        while time.time() - t0 < setting.timeout_s + 90 and None in ended:
            for r, p in enumerate(procs):
                if ended[r] is None and p.poll() is not None:
                    ended[r] = time.time() - t0
            if victim != 0 and procs[0].poll() is None and time.time() - last_read > 0.5:
                # the master's last step (its store is on its host, which is still connected)
                reached = max(reached, (_bounded(lambda: read_status(store, 0), 1.0) or {}).get("step") or 0)
                last_read = time.time()
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for t in drains:
            t.join(timeout=10)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    survivors = [r for r in range(4) if r != victim]
    lost = ROLE_TEXT[victim] if victim else "rank 0"
    result = {"rank": victim, "at_step": reached, "exit_s": round(max(e or 1e9 for e in ended), 1),
              "status": [p.returncode for p in procs],
              "bounded": all(e is not None and e <= setting.timeout_s + 30 for e in ended)
              and all(p.returncode != 0 for p in procs),
              "named": all(lost in outputs[r] for r in survivors),
              "exits_s": [round(e, 1) if e is not None else None for e in ended],
              "last_lines": [(o.strip().splitlines() or [""])[-1][:200] for o in outputs],
              "message": next((ln for ln in outputs[survivors[0]].splitlines() if "stopped" in ln or "error" in ln), "")}
    result["checkpoint_problem"] = verify_checkpoints(out / "checkpoints")
    result.update(resume_and_score(setting, out))
    if result.get("resumed"):  # no launcher recorded the fault: the master's last step, from its store
        result["updates_lost_steps"] = max(0, reached - result["resumed_step"])
    return result


# -- serving ---------------------------------------------------------------------------------------


def api_worker_run(setting: Setting, fault: str, rng: random.Random) -> dict:
    expected = setting.expected  # (publishes the versions' own stores, the first time)
    with Api(f"file://{setting.work / 'store-v2'}", setting.probe, workers=2) as api:
        wait_for(lambda: len(api.workers()) == 2 and api.answer_of("v2"), "two workers serving v2", every=0.2)
        load = Load(api, expected)
        at = rng.randrange(5, 40)
        wait_for(lambda: len(load.answers) >= at, "requests")
        victim = rng.choice(api.workers())
        kill(victim, getattr(signal, fault))
        t0 = time.time()
        gone = _try(lambda: wait_for(lambda: not Path(f"/proc/{victim}").exists() or _zombie(victim), "gone", 60))
        exit_s = time.time() - t0
        back = _try(lambda: wait_for(lambda: len(api.workers()) == 2 and load.ok_after(t0 + exit_s) >= 5,
                                     "recovery", 60))
        auc = _try(lambda: api.served_auc(setting.test_lines, setting.labels))
        load.stop()
        named = any(f"Child process [{victim}] died" in line for line in api.output)
    failed = [a for a in load.answers if a[1] != 200]
    return {"at_request": at, "exit_s": round(exit_s, 1), "bounded": bool(gone) and exit_s <= 15, "named": named,
            "resumed": bool(back) and auc is not None, "auc_diff": abs(auc - setting.ref_auc) if auc else None,
            "version_mixes": load.mixes, "requests": len(load.answers), "failed_requests": len(failed),
            "max_latency_s": round(max(a[3] for a in load.answers), 2)}


def _zombie(pid: int) -> bool:
    text = _try(lambda: Path(f"/proc/{pid}/stat").read_text()) or ""
    return text[text.rindex(")") + 2 :].startswith("Z") if text else True


class Redis:
    """A redis-server with an append-only file (fsynced on every write), restartable on its data."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port = workdir, free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                                      str(self.workdir), "--save", "", "--appendonly", "yes", "--appendfsync",
                                      "always"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=0.5)
        wait_for(lambda: _try(client.ping), "redis-server", 30)

    def stop(self) -> None:
        kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(timeout=10)


def redis_run(setting: Setting, fault: str, rng: random.Random, work: Path) -> dict:
    if shutil.which("redis-server") is None:
        return {"skipped": "redis-server is not installed"}
    shutil.rmtree(work, ignore_errors=True)
    expected = setting.expected
    redis = Redis(work)
    try:
        assert publish(setting.versions["v1"], redis.url, "v1").returncode == 0
        with Api(redis.url, setting.probe, workers=2) as api:
            wait_for(lambda: api.answer_of("v1"), "v1 served", every=0.2)
            load = Load(api, expected)
            at = rng.randrange(5, 40)
            wait_for(lambda: len(load.answers) >= at, "requests")
            kill(redis.proc.pid, getattr(signal, fault))
            t0 = time.time()
            failed_publish = publish(setting.versions["v2"], redis.url, "v2", timeout=120)  # must fail, bounded
            exit_s = time.time() - t0
            message = (failed_publish.stderr.strip().splitlines() or [""])[-1]
            time.sleep(rng.uniform(0, 3))  # the outage goes on a little
            if fault == "SIGKILL":
                redis.proc.wait(timeout=10)
                redis.start()  # on its append-only file
            else:
                kill(redis.proc.pid, signal.SIGCONT)
            t_back = time.time()
            ok = publish(setting.versions["v2"], redis.url, "v2").returncode == 0
            back = ok and _try(lambda: wait_for(lambda: api.answer_of("v2") and load.ok_after(t_back) >= 5,
                                                "v2 served", 60))
            auc = _try(lambda: api.served_auc(setting.test_lines, setting.labels)) if back else None
            load.stop()
    finally:
        redis.stop()
    versions = [v for _, _, v, _ in load.answers if v is not None]
    regressions = sum(1 for a, b in zip(versions, versions[1:], strict=False) if a == "v2" and b == "v1")
    outage = [a for a in load.answers if t0 <= a[0] <= t_back]
    return {"at_request": at, "exit_s": round(exit_s, 1), "status": failed_publish.returncode,
            "bounded": failed_publish.returncode != 0 and exit_s <= 15,
            "named": "redis" in message.lower() or "store" in message.lower(), "message": message,
            "resumed": bool(back) and auc is not None, "auc_diff": abs(auc - setting.ref_auc) if auc else None,
            "version_mixes": load.mixes, "version_regressions": regressions, "requests": len(load.answers),
            "outage_requests": len(outage), "outage_max_latency_s": round(max((a[3] for a in outage), default=0), 2),
            "outage_503": sum(1 for a in outage if a[1] == 503)}


# -- the suite ---------------------------------------------------------------------------------------


def draw(seed: int, n: int) -> list[tuple[str, str]]:
    """The (role, fault) of runs 0..n-1, the same for every slice of one seed: every block of 30
    runs gives each role 5 runs (SIGKILL and SIGSTOP 3/2 or 2/3), in a random order."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < n:
        block = []
        for role in ROLES:
            faults = ["link cut"] * 5 if role == "host link" else ["SIGKILL", "SIGSTOP"] * 2 + [rng.choice(
                ["SIGKILL", "SIGSTOP"])]
            block += [(role, f) for f in faults]
        rng.shuffle(block)
        out += block
    return out[:n]


def run_one(setting: Setting, index: int, role: str, fault: str, seed: int) -> dict:
    rng = random.Random(seed * 1000 + index)
    out = setting.work / f"run-{index}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    try:
        if role in RANK_OF:
            result = training_run(setting, role, fault, rng, out)
        elif role == "host link":
            result = link_run(setting, rng, out)
        elif role == "API worker":
            result = api_worker_run(setting, fault, rng)
        else:
            result = redis_run(setting, fault, rng, setting.work / f"redis-{index}")
    except Exception as exc:  # a harness failure is a failed run, not a crash of the suite
        result = {"bounded": False, "resumed": False, "harness_error": f"{type(exc).__name__}: {exc}"}
    shutil.rmtree(out, ignore_errors=True)
    return {"run": index, "role": role, "fault": fault, "seconds": round(time.time() - t0, 1), **result}


def summarize(runs: list[dict]) -> dict:
    done = [r for r in runs if "skipped" not in r]
    aucs = [r["auc_diff"] for r in done if r.get("auc_diff") is not None]
    lost = [r["updates_lost_steps"] for r in done if r.get("updates_lost_steps") is not None]
    return {
        "runs": len(done), "skipped": len(runs) - len(done),
        "bounded_exits": sum(1 for r in done if r.get("bounded") and r.get("named")),
        "max_exit_s": max((r.get("exit_s", 0) for r in done), default=0),
        "resumes_completed": sum(1 for r in done if r.get("resumed")),
        "worst_auc_diff": max(aucs, default=None),
        "max_updates_lost_steps": max(lost, default=None),
        "mean_updates_lost_steps": sum(lost) / len(lost) if lost else None,
        "version_mixes": sum(r.get("version_mixes", 0) for r in done),
        "version_regressions": sum(r.get("version_regressions", 0) for r in done),
        "checkpoint_problems": sum(1 for r in done if r.get("checkpoint_problem")),
    }


def markdown(runs: list[dict], meta: dict) -> str:
    def row(name: str, rs: list[dict]) -> str:
        s = summarize(rs)
        auc = f"{s['worst_auc_diff']:.4f}" if s["worst_auc_diff"] is not None else "-"
        lost = (f"{s['max_updates_lost_steps']} max, {s['mean_updates_lost_steps']:.1f} mean"
                if s["max_updates_lost_steps"] is not None else "-")
        return (f"| {name} | {s['runs']} | {s['bounded_exits']}/{s['runs']} | {s['max_exit_s']:.1f} | "
                f"{s['resumes_completed']}/{s['runs']} | {auc} | {lost} | {s['version_mixes']} | "
                f"{s['version_regressions']} | {s['checkpoint_problems']} |")

    lines = [f"# Chaos runs (`bench/chaos.py`, seed {meta['seed']})", "",
             f"{meta['note']}", "",
             "| role | runs | bounded exits naming the role | max time to exit (s) | resumes completed | "
             "worst AUC difference | updates lost (steps) | version mixes | version regressions | "
             "corrupt or incomplete checkpoints |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             row("**all**", runs)]
    for role in ROLES:
        rs = [r for r in runs if r["role"] == role]
        if rs:
            lines.append(row(role, rs))
    lines += ["", "| run | role | fault | at | exit (s) | bounded, named | resumed | AUC diff | lost steps | message |",
              "|---:|---|---|---:|---:|---|---|---:|---:|---|"]
    for r in sorted(runs, key=lambda r: r["run"]):
        at = r.get("at_step", r.get("at_request", ""))
        auc = f"{r['auc_diff']:.4f}" if r.get("auc_diff") is not None else "-"
        msg = (r.get("message") or r.get("skipped") or r.get("harness_error") or r.get("resume_error") or "")
        msg = str(msg).replace("|", "/")[:140]
        lines.append(f"| {r['run']} | {r['role']} | {r['fault']} | {at} | {r.get('exit_s', '-')} | "
                     f"{'yes' if r.get('bounded') and r.get('named') else 'NO'} | {'yes' if r.get('resumed') else 'NO'} | "
                     f"{auc} | {r.get('updates_lost_steps', '-')} | {msg} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--first", type=int, default=0, help="index of the first run (slices of one seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=20.0, help="dist.timeout_s of the training runs")
    p.add_argument("--work", type=Path, default=REPO / "build" / "chaos")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--append", action="store_true", help="merge with the runs already in chaos.json")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    setting = Setting(args.work, args.timeout_s)
    plan = draw(args.seed, args.first + args.runs)
    path = args.results / "chaos.json"
    previous = json.loads(path.read_text())["runs"] if args.append and path.exists() else []
    runs = {r["run"]: r for r in previous}
    for index in range(args.first, args.first + args.runs):
        role, fault = plan[index]
        result = run_one(setting, index, role, fault, args.seed)
        runs[index] = result
        print(json.dumps(result), flush=True)
    ordered = [runs[i] for i in sorted(runs)]
    meta = {"seed": args.seed, "timeout_s": args.timeout_s,
            "note": (f"E=2, T=2 `dlrm train` on {setting.rows:,} generated rows (tiny config, batch {setting.batch}, "
                     f"{setting.steps} steps), "
                     f"deltas every second, full checkpoints every 100 steps, dist.timeout_s = {args.timeout_s:g}; "
                     f"uninterrupted test AUC {setting.ref_auc:.4f}; the uninterrupted run trains "
                     f"{setting.steps_per_s:.0f} steps/s, so one delta interval holds about that many steps "
                     f"(updates lost are counted in steps redone on resume). Version regressions: a v2 answer "
                     f"followed by a v1 answer while the two workers switch (each answer is its own version's). "
                     f"2 CPU cores shared with other jobs.")}
    args.results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "summary": summarize(ordered), "runs": ordered}, indent=1) + "\n")
    (args.results / "chaos.md").write_text(markdown(ordered, meta))
    print(json.dumps(summarize(ordered), indent=1))


if __name__ == "__main__":
    main()
