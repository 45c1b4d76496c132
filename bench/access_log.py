"""CPU cost of the access log per request, against the serving budget of 1 ms per request.

Side by side in one run, each a fresh `dlrm serve` (1 worker, file store, the tiny model), in
interleaved rounds (the machine is shared: medians are reported):
    off    DLRM_ACCESS_LOG=false (the request context, metrics and auth still run)
    text   DLRM_ACCESS_LOG=true, text lines
    json   DLRM_ACCESS_LOG=true, JSON lines
The server's log goes to a file, as a container runtime's would. Load: one keep-alive client
sends single-instance V1 predicts back to back (closed loop). The cost is the server process's
CPU time (user + system, from /proc) per request, so the load generator's own CPU does not
count. Whole requests are noisy on a shared machine; the access log's own cost is also measured
in process (the middleware's per-request bookkeeping with and without the line, into a file).
Writes bench/results/access_log.{json,md}.
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
CONFIGS = {
    "off": {"DLRM_ACCESS_LOG": "false"},
    "text": {"DLRM_ACCESS_LOG": "true", "DLRM_LOG_FORMAT": "text"},
    "json": {"DLRM_ACCESS_LOG": "true", "DLRM_LOG_FORMAT": "json"},
}


def prepare(work: Path) -> str:
    data, run, store = work / "data", work / "run", work / "store"
    if not (store / "CURRENT").exists():
        subprocess.run(
            [
                *DLRM,
                "data",
                "synth",
                "--train-rows",
                "20000",
                "--test-rows",
                "2000",
                "--seed",
                "3",
                "--out",
                data,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            [
                *DLRM,
                "train",
                "--config",
                REPO / "configs" / "tiny.toml",
                "--train",
                data / "train.txt",
                "--test",
                data / "test.txt",
                "--out",
                run,
                "--no-progress",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            [*DLRM, "publish", "--checkpoint", run, "--store", f"file://{store}"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return f"file://{store}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children that were waited for (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(config: str, store: str, port: int, requests: int, log_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), **CONFIGS[config]}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*DLRM, "serve", "--store", store, "--port", str(port), "--workers", "1"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
            time.sleep(0.5)  # the warm-up's lines written (the access log writes in batches)
            lines_before = log_path.read_text().count("api.access")
            cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            for _ in range(requests):
                assert client.post("/v1/models/dlrm:predict", json=body).status_code == 200
            wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    # Counted once the server has stopped: the lines still buffered (up to 0.2 s of them) are
    # written at exit, so this also checks that a graceful stop loses none.
    logged = log_path.read_text().count("api.access") - lines_before
    return {
        "cpu_us_per_request": 1e6 * cpu / requests,
        "wall_us_per_request": 1e6 * wall / requests,
        "log_lines": logged,
    }


def micro(work: Path, calls: int = 20000, repeats: int = 5) -> dict:
    """The access log's own CPU per request, in process: ``RequestContext._observe`` (latency
    histogram, plus the log line when on) through the configured handler into a file."""
    import logging.config

    sys.path.insert(0, str(REPO))
    from api.metrics import ServingMetrics
    from api.middleware import RequestContext
    from dlrm_core.logs import REQUEST_ID, BufferedStreamHandler, logging_config

    class App:  # what _observe reads from the scope: the app's service and its metrics
        class state:  # noqa: N801
            class service:  # noqa: N801
                metrics = ServingMetrics()

    route = type("Route", (), {"path": "/v1/models/{name}:predict"})()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/models/dlrm:predict",
        "app": App,
        "route": route,
    }
    out = {}
    variants = {
        "off": (False, False, True),
        "text": (True, False, True),
        "json": (True, True, True),
        "text, a write per line": (True, False, False),
    }
    for name, (on, json_lines, buffered) in variants.items():
        config = logging_config(json_lines=json_lines)
        stream = open(work / f"micro-{name.replace(', ', '-').replace(' ', '-')}.log", "w")  # noqa: SIM115 - closed below
        config["handlers"]["access"] = {
            "()": BufferedStreamHandler if buffered else logging.StreamHandler,
            "stream": stream,
            # as served (logging_config), into a file
            "formatter": "dlrm",
            "filters": ["request_id"],
        }
        logging.config.dictConfig(config)
        middleware = RequestContext(None, access_log=on)
        token = REQUEST_ID.set("0123456789abcdef0123456789abcdef")
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            for _ in range(calls):
                middleware._observe(scope, 200, 0.0012)
            times.append((time.process_time() - t0) / calls * 1e6)
        REQUEST_ID.reset(token)
        out[name] = statistics.median(times)
        logging.config.dictConfig(logging_config())
        stream.close()
    return {c: {"cpu_us_per_request": v, "extra_cpu_us": v - out["off"]} for c, v in out.items()}


def report(result: dict) -> list[str]:
    """The markdown table of a result (also: ``--report`` rewrites it from the JSON)."""
    med, runs, in_process = result["median"], result["runs"], result["in_process"]
    lines = [
        "# Access log: CPU per request (`bench/access_log.py`)",
        "",
        "The access log's own cost, in process (the middleware's bookkeeping of one request with "
        "and "
        "without its line, written to a file through the configured handler, in batches as "
        "served, and "
        "with a write per line as before 2026-12-04; 20,000 calls x 5, median):",
        "",
        "| access log | CPU / request (µs) | extra vs off (µs) | share of the 1 ms budget |",
        "|---|---|---|---|",
    ]
    for c, m in in_process.items():
        lines.append(
            f"| {c} | {m['cpu_us_per_request']:.1f} | {m['extra_cpu_us']:+.1f} | "
            f"{m['extra_cpu_us'] / 10:+.1f}% |"
        )
    lines += [
        "",
        f"Whole requests: {result['requests_per_round']} single-instance V1 predicts per round on "
        "a fresh "
        f"`dlrm serve` (1 worker, file store, tiny model), {result['rounds']} interleaved rounds; "
        "server CPU "
        "(user + system, /proc) per request, median and range over the rounds (load average "
        f"{result['load_average'][0]:.1f} on {result['cpus']} cores: other tenants included; where "
        "the ranges "
        "overlap, the difference is not shown). A served line costs more than the in-process "
        "figure: "
        "the request's other work runs beside it. Lines logged are counted after the server "
        "stopped "
        "(SIGTERM): the access log writes in batches, and a graceful stop writes what waits.",
        "",
        "| access log | server CPU / request (µs), median | range over rounds (µs) | wall / "
        "request (µs) | lines logged |",
        "|---|---|---|---|---|",
    ]
    for c, m in med.items():
        cpu = [r["cpu_us_per_request"] for r in runs[c]]
        lines.append(
            f"| {c} | {m['cpu_us_per_request']:.0f} | {min(cpu):.0f}-{max(cpu):.0f} | "
            f"{m['wall_us_per_request']:.0f} | {m['log_lines']:.0f} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "access_log")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=18775)
    p.add_argument("--report", action="store_true", help="only rewrite the markdown from the JSON")
    args = p.parse_args()
    if args.report:
        result = json.loads((args.out / "access_log.json").read_text())
        (args.out / "access_log.md").write_text("\n".join(report(result)) + "\n")
        return
    args.work.mkdir(parents=True, exist_ok=True)
    in_process = micro(args.work)
    print(f"in process: {in_process}", flush=True)
    store = prepare(args.work)
    rounds: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):  # interleaved: drift of the shared machine hits every config alike
        for config in CONFIGS:
            rounds[config].append(
                one_round(config, store, args.port, args.requests, args.work / f"{config}.log")
            )
            print(f"round {r} {config}: {rounds[config][-1]}", flush=True)
    med = {
        c: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for c, runs in rounds.items()
    }
    off = med["off"]["cpu_us_per_request"]
    for c in med:
        med[c]["extra_cpu_us"] = med[c]["cpu_us_per_request"] - off
        med[c]["extra_share_of_1ms_budget"] = med[c]["extra_cpu_us"] / 1000
        med[c]["cpu_ratio_to_off"] = med[c]["cpu_us_per_request"] / off
    result = {
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "median": med,
        "runs": rounds,
        "in_process": in_process,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "access_log.json").write_text(json.dumps(result, indent=1))
    lines = report(result)
    (args.out / "access_log.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
