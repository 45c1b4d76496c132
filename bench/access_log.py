"""CPU cost of the access log per request, against the serving budget of 1 ms per request.

Side by side in one run, each a fresh `dlrm serve` (1 worker, file store, the tiny model), in
interleaved rounds (the machine is shared: medians are reported):
    off    DLRM_ACCESS_LOG=false (the request context, metrics and auth still run)
    text   DLRM_ACCESS_LOG=true, text lines
    json   DLRM_ACCESS_LOG=true, JSON lines
The server's log goes to a file, as a container runtime's would. Load: one keep-alive client
sends single-instance V1 predicts back to back (closed loop). The cost is the server process's
CPU time (user + system, from /proc) per request, so the load generator's own CPU does not
count. Writes bench/results/access_log.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
CONFIGS = {"off": {"DLRM_ACCESS_LOG": "false"},
           "text": {"DLRM_ACCESS_LOG": "true", "DLRM_LOG_FORMAT": "text"},
           "json": {"DLRM_ACCESS_LOG": "true", "DLRM_LOG_FORMAT": "json"}}


def prepare(work: Path) -> str:
    data, run, store = work / "data", work / "run", work / "store"
    if not (store / "CURRENT").exists():
        subprocess.run([*DLRM, "data", "synth", "--train-rows", "20000", "--test-rows", "2000", "--seed", "3",
                        "--out", data], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([*DLRM, "train", "--config", REPO / "configs" / "tiny.toml", "--train", data / "train.txt",
                        "--test", data / "test.txt", "--out", run, "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([*DLRM, "publish", "--checkpoint", run, "--store", f"file://{store}"], check=True,
                       stdout=subprocess.DEVNULL)
    return f"file://{store}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children that were waited for (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(config: str, store: str, port: int, requests: int, log_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), **CONFIGS[config]}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*DLRM, "serve", "--store", store, "--port", str(port), "--workers", "1"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"server not ready: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        body = {"instances": [{"dense": [1] * 13, "sparse": ["68fd1e64"] * 26}]}
        with httpx.Client(base_url=base, timeout=10) as client:
            for _ in range(200):  # warm-up
                client.post("/v1/models/dlrm:predict", json=body)
            lines_before = log_path.read_text().count("\n")
            cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            for _ in range(requests):
                assert client.post("/v1/models/dlrm:predict", json=body).status_code == 200
            wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
        logged = log_path.read_text().count("\n") - lines_before
        return {"cpu_us_per_request": 1e6 * cpu / requests, "wall_us_per_request": 1e6 * wall / requests,
                "log_lines": logged}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "access_log")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=18775)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    store = prepare(args.work)
    rounds: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):  # interleaved: drift of the shared machine hits every config alike
        for config in CONFIGS:
            rounds[config].append(one_round(config, store, args.port, args.requests, args.work / f"{config}.log"))
            print(f"round {r} {config}: {rounds[config][-1]}", flush=True)
    med = {c: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for c, runs in rounds.items()}
    off = med["off"]["cpu_us_per_request"]
    for c in med:
        med[c]["extra_cpu_us"] = med[c]["cpu_us_per_request"] - off
        med[c]["extra_share_of_1ms_budget"] = med[c]["extra_cpu_us"] / 1000
        med[c]["cpu_ratio_to_off"] = med[c]["cpu_us_per_request"] / off
    result = {"requests_per_round": args.requests, "rounds": args.rounds, "median": med, "runs": rounds,
              "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "access_log.json").write_text(json.dumps(result, indent=1))
    lines = ["# Access log: server CPU per request (`bench/access_log.py`)", "",
             f"{args.requests} single-instance V1 predicts per round, {args.rounds} interleaved rounds, medians; "
             "server CPU (user + system) per request, 1 worker, file store, tiny model.", "",
             "| access log | server CPU / request (µs) | extra vs off (µs) | share of the 1 ms budget | wall / request (µs) | lines logged |",
             "|---|---|---|---|---|---|"]
    for c, m in med.items():
        lines.append(f"| {c} | {m['cpu_us_per_request']:.0f} | {m['extra_cpu_us']:+.0f} | "
                     f"{100 * m['extra_share_of_1ms_budget']:+.1f}% | {m['wall_us_per_request']:.0f} | {m['log_lines']:.0f} |")
    (args.out / "access_log.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
