"""The chaos bench's faults (``bench/chaos.py``): one function per role, each injecting its
fault into a run and reporting how the system ended and resumed."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from chaos_kit import (  # noqa: E402
    DLRM,
    RANK_OF,
    REPO,
    ROLE_TEXT,
    Api,
    Load,
    Setting,
    _try,
    free_port,
    kill,
    publish,
    resume_and_score,
    verify_checkpoints,
    wait_for,
)

from embedding_server.runtime.watchdog import connect, read_status  # noqa: E402


def training_run(setting: Setting, role: str, fault: str, rng: random.Random, out: Path) -> dict:
    rank = RANK_OF[role] + (rng.randrange(2) if role == "embedding server" else 0)
    target = rng.randrange(10, int(setting.steps * 0.6))
    port = free_port()
    proc = subprocess.Popen(
        [*DLRM, *setting.train_args(out, "--set", f"dist.master_port={port}")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    store = wait_for(lambda: _store("127.0.0.1", port), "the launcher's store", every=0.2)
    wait_for(
        lambda: (read_status(store, 0).get("step") or 0) >= target or proc.poll() is not None,
        "the step",
    )
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
    result = {
        "rank": rank,
        "at_step": fault_info.get("step", target),
        "exit_s": round(exit_s, 1),
        "status": proc.returncode,
        "named": f"error: {ROLE_TEXT[rank]}" in output,
        "bounded": proc.returncode not in (0, None) and exit_s <= setting.timeout_s + 15,
        "message": next(
            (ln for ln in output.splitlines() if "error:" in ln and "dlrm train: error" in ln), ""
        ),
    }
    result["checkpoint_problem"] = verify_checkpoints(out / "checkpoints")
    result.update(resume_and_score(setting, out))
    # no fault record, or no checkpoint
    if result.get("resumed") and result.get("updates_lost_steps") is None:
        result["updates_lost_steps"] = max(0, result["at_step"] - result["resumed_step"])
    return result


def _store(addr: str, port: int):
    """A client of the store at addr:port once it listens (else None)."""
    try:
        socket.create_connection((addr, port), timeout=1).close()
        return connect(addr, port, 2.0)
    except OSError:
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
        # to watch
        subprocess.run(["ip", "addr", "add", f"10.{net}.0.254/24", "dev", hosts.bridge], check=True)
        env = {
            **os.environ,
            "MASTER_ADDR": hosts.addrs[0],
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "4",
            "GLOO_SOCKET_IFNAME": hosts.ifname,
        }
        procs = [
            subprocess.Popen(
                hosts.command(r, worker),
                cwd=REPO,
                env={**env, "RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(4)
        ]
        outputs: list[str] = [""] * 4
        drains = [
            threading.Thread(
                target=lambda i=i: outputs.__setitem__(i, procs[i].communicate()[0]), daemon=True
            )
            for i in range(4)
        ]
        for t in drains:
            t.start()
        store = wait_for(lambda: _store(hosts.addrs[0], port), "rank 0's store", every=0.5)
        wait_for(
            lambda: (
                (read_status(store, 0).get("step") or 0) >= target or procs[0].poll() is not None
            ),
            "the step",
        )
        link = f"{hosts.bridge}v{victim}"  # the host's cable, on the bridge side
        # before the cut
        reached = (_bounded(lambda: read_status(store, 0)) or {}).get("step", target)
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
                reached = max(
                    reached, (_bounded(lambda: read_status(store, 0), 1.0) or {}).get("step") or 0
                )
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
    result = {
        "rank": victim,
        "at_step": reached,
        "exit_s": round(max(e or 1e9 for e in ended), 1),
        "status": [p.returncode for p in procs],
        "bounded": all(e is not None and e <= setting.timeout_s + 30 for e in ended)
        and all(p.returncode != 0 for p in procs),
        "named": all(lost in outputs[r] for r in survivors),
        "exits_s": [round(e, 1) if e is not None else None for e in ended],
        "last_lines": [(o.strip().splitlines() or [""])[-1][:200] for o in outputs],
        "message": next(
            (ln for ln in outputs[survivors[0]].splitlines() if "stopped" in ln or "error" in ln),
            "",
        ),
    }
    result["checkpoint_problem"] = verify_checkpoints(out / "checkpoints")
    result.update(resume_and_score(setting, out))
    # no launcher recorded the fault: the master's last step, from its store
    if result.get("resumed"):
        result["updates_lost_steps"] = max(0, reached - result["resumed_step"])
    return result


# -- serving ---------------------------------------------------------------------------------------


def api_worker_run(setting: Setting, fault: str, rng: random.Random) -> dict:
    expected = setting.expected  # (publishes the versions' own stores, the first time)
    with Api(f"file://{setting.work / 'store-v2'}", setting.probe, workers=2) as api:
        wait_for(
            lambda: len(api.workers()) == 2 and api.answer_of("v2"),
            "two workers serving v2",
            every=0.2,
        )
        load = Load(api, expected)
        at = rng.randrange(5, 40)
        wait_for(lambda: len(load.answers) >= at, "requests")
        victim = rng.choice(api.workers())
        kill(victim, getattr(signal, fault))
        t0 = time.time()
        gone = _try(
            lambda: wait_for(
                lambda: not Path(f"/proc/{victim}").exists() or _zombie(victim), "gone", 60
            )
        )
        exit_s = time.time() - t0
        back = _try(
            lambda: wait_for(
                lambda: len(api.workers()) == 2 and load.ok_after(t0 + exit_s) >= 5, "recovery", 60
            )
        )
        auc = _try(lambda: api.served_auc(setting.test_lines, setting.labels))
        load.stop()
        named = any(f"Child process [{victim}] died" in line for line in api.output)
    failed = [a for a in load.answers if a[1] != 200]
    return {
        "at_request": at,
        "exit_s": round(exit_s, 1),
        "bounded": bool(gone) and exit_s <= 15,
        "named": named,
        "resumed": bool(back) and auc is not None,
        "auc_diff": abs(auc - setting.ref_auc) if auc else None,
        "version_mixes": load.mixes,
        "requests": len(load.answers),
        "failed_requests": len(failed),
        "max_latency_s": round(max(a[3] for a in load.answers), 2),
    }


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
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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
            # must fail, bounded
            failed_publish = publish(setting.versions["v2"], redis.url, "v2", timeout=120)
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
            back = ok and _try(
                lambda: wait_for(
                    lambda: api.answer_of("v2") and load.ok_after(t_back) >= 5, "v2 served", 60
                )
            )
            auc = _try(lambda: api.served_auc(setting.test_lines, setting.labels)) if back else None
            load.stop()
    finally:
        redis.stop()
    versions = [v for _, _, v, _ in load.answers if v is not None]
    regressions = sum(
        1 for a, b in zip(versions, versions[1:], strict=False) if a == "v2" and b == "v1"
    )
    outage = [a for a in load.answers if t0 <= a[0] <= t_back]
    return {
        "at_request": at,
        "exit_s": round(exit_s, 1),
        "status": failed_publish.returncode,
        "bounded": failed_publish.returncode != 0 and exit_s <= 15,
        "named": "redis" in message.lower() or "store" in message.lower(),
        "message": message,
        "resumed": bool(back) and auc is not None,
        "auc_diff": abs(auc - setting.ref_auc) if auc else None,
        "version_mixes": load.mixes,
        "version_regressions": regressions,
        "requests": len(load.answers),
        "outage_requests": len(outage),
        "outage_max_latency_s": round(max((a[3] for a in outage), default=0), 2),
        "outage_503": sum(1 for a in outage if a[1] == 503),
    }


# -- the suite -------------------------------------------------------------------------------------
