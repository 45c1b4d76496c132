"""Online training from a stream (issue 37), three parts, each against a redis-server of its own:

* ``freshness``: ``dlrm stream replay`` publishes a Criteo-layout file at ``--rate`` impressions
  a second (clicks 1 s after theirs), ``dlrm train --stream`` (``configs/tiny.toml``, live
  updates to Redis db 1) trains from it and ``dlrm serve`` serves the live model. Every few
  seconds a burst of ``--burst`` impressions of a new id, every one clicked, enters the streams;
  the served score of a row with that id is polled (every 50 ms) beside the same row with a
  never-seen control id, until the two part by 0.02: the time from the burst entering the stream
  to the served prediction reflecting training on it. p50 / p99 over ``--bursts``.
* ``throughput``: the same rows trained from a file (``dlrm train``'s loop) and from a backlog of
  the streams (``--backfill``), default model, dynamic ids for both; rows/s of each (data waits
  included in both), medians over ``--repeats`` alternating runs, and their ratio.
* ``drift``: ``dlrm data synth --drift 4`` (preferences move and new ids arrive between
  segments): online training's progressive AUC on segments 1-3 against a model trained once on
  segment 0 (one pass, from the file) and served unchanged, scored on the same rows, with each
  segment's Bayes-optimal AUC beside.
* ``memory`` (not in the default parts: minutes): ``--events`` impressions of ever-new ids
  through 100,000-row dynamic tables, the trainer's RSS sampled (``online_memory.py``).

Usage: python bench/online.py [--parts freshness,throughput,drift,memory] [--rate 4000]
       [--rows 60000] [--events 1000000]
Writes bench/results/online.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from online_kit import (
    DLRM,
    REPO,
    Redis,
    config,
    file_auc,
    file_training,
    instance_of,
    online,
    pct,
    predict,
    stream_settings,
    wait_ready,
)
from online_memory import memory

from dense_trainer.data.drift import synthesize_drifting
from dense_trainer.data.stream.replay import replay, rows_of
from dense_trainer.data.synth import synthesize
from dense_trainer.distributed import free_port

HERE = Path(__file__).resolve().parent
TINY = REPO / "configs" / "tiny.toml"


def freshness(work: Path, rate: float, bursts: int, burst: int) -> dict:
    seconds = 30 + bursts * 6
    data = work / "fresh-data"
    synthesize(data, int(rate * seconds), 10, seed=5)
    pool = []  # rows for the bursts: only their new id is common to a burst
    for row in rows_of(data / "train.txt", "label"):
        row.pop("label", None)  # an impression carries no label (the schema reads no such field)
        pool.append(row)
        if len(pool) == 20 * burst:
            break
    template = pool[0]
    server = Redis()
    procs: list[subprocess.Popen] = []
    try:
        names = ["--impressions", "imp", "--clicks", "clk"]
        replay = [*DLRM, "stream", "replay", str(data / "train.txt"), "--url", server.url()]
        procs.append(subprocess.Popen([*replay, *names, "--rate", str(rate), "--click-delay", "1"]))
        log = (work / "fresh-train.log").open("w")
        train = [*DLRM, "train", "--stream", server.url(), "--config", str(TINY)]
        train += ["--live-store", server.url(1), "--out", str(work / "fresh-run"), "--no-progress"]
        train += ["--set", "stream.join_window_s=5", "--set", "stream.report_every_s=5"]
        train += ["--set", "stream.impressions=imp", "--set", "stream.clicks=clk"]
        procs.append(subprocess.Popen(train, stderr=log))
        deadline = time.monotonic() + 120
        while "live updates: published" not in (work / "fresh-train.log").read_text():
            assert time.monotonic() < deadline and procs[-1].poll() is None, "training failed"
            time.sleep(0.2)
        port = free_port()
        serve = [*DLRM, "serve", "--store", server.url(1), "--port", str(port)]
        procs.append(subprocess.Popen([*serve, "--log-level", "warning"]))
        wait_ready(port, procs[-1])
        time.sleep(10)  # training under way
        rng = np.random.default_rng(0)
        lat: list[float] = []
        missed, traces = 0, []
        for k in range(bursts):
            new, ctl = (f"{int(x):08x}" for x in rng.integers(0, 2**32, size=2))
            inst_new, inst_ctl = (instance_of({**template, "C1": v}) for v in (new, ctl))
            base_new, base_ctl = predict(port, inst_new), predict(port, inst_ctl)
            pipe = server.client.pipeline(transaction=False)
            for i, j in enumerate(rng.choice(len(pool), size=burst, replace=False)):
                key = f"burst{k}-{i}"
                pipe.xadd("imp", {"impression_id": key, **{**pool[j], "C1": new}})
                pipe.xadd("clk", {"impression_id": key, "label": "1"})
            t0 = time.time()
            pipe.execute()
            trace = []
            while True:
                dn, dc = predict(port, inst_new) - base_new, predict(port, inst_ctl) - base_ctl
                trace.append((round(time.time() - t0, 2), round(dn, 4), round(dc, 4)))
                moved = dn - dc
                if moved > 0.02:
                    lat.append(time.time() - t0)
                    break
                if time.time() - t0 > 30:
                    missed += 1
                    break
                time.sleep(0.05)
            traces.append(trace[:: max(1, len(trace) // 40)])
            time.sleep(2)
        lag = server.client.xinfo_groups("imp")[0].get("lag")
        procs[1].terminate()
        procs[1].wait(timeout=120)
        m = json.loads((work / "fresh-run" / "metrics.json").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    clicks = m["join"]["joined"]
    return {
        "impressions_per_s": rate,
        "events_per_s": rate * (1 + clicks / max(m["rows"], 1)),
        "bursts": bursts,
        "burst_rows": burst,
        "moved": len(lat),
        "missed": missed,
        "p50_s": pct(lat, 0.5),
        "p99_s": pct(lat, 0.99),
        "max_s": max(lat) if lat else None,
        "latencies_s": lat,
        "traces": traces,
        "trainer_rows_per_s": m["rows_per_s"],
        "trainer_freshness_s": m["freshness_s"],
        "lag_at_end": lag,
        "progressive_auc": m["progressive_auc"],
    }


def throughput(work: Path, rows: int, repeats: int) -> dict:
    data = work / "tp-data"
    synthesize(data, rows, 10, seed=6)
    server = Redis()
    files, streams = [], []
    try:
        for r in range(repeats):
            m, _ = file_training(config([]), [data / "train.txt"], work / f"tp-file-{r}")
            files.append(m["train_samples_per_s"])
            tag = f"tp{r}"
            # a backlog whose windows have all closed (a trainer catching up): rows/s, not the
            # wait of a finite stream's last windows
            replay([data / "train.txt"], server.url(), f"imp-{tag}", f"clk-{tag}", rate=5000,
                   click_delay_s=1.0, backfill=True, ago_s=10.0)  # fmt: skip
            cfg = config([stream_settings(server.url(), tag)])
            m, _ = online(cfg, work / f"tp-stream-{r}")
            assert m["rows"] == rows, m["rows"]
            streams.append(m["rows_per_s"])
    finally:
        server.close()
    f, s = statistics.median(files), statistics.median(streams)
    return {"rows": rows, "file_rows_per_s": files, "stream_rows_per_s": streams,
            "file_median": f, "stream_median": s, "ratio": s / f}  # fmt: skip


def drift(work: Path, rows: int) -> dict:
    data = work / "drift-data"
    record = synthesize_drifting(data, rows, 10, segments=4, seed=7)
    segs = [data / s["file"] for s in record["segments"]]
    per = record["segments"][0]["rows"]
    server = Redis()
    try:
        replay(segs, server.url(), "imp-d", "clk-d", rate=1000, click_delay_s=1.0, backfill=True)
        m, run = online(config([stream_settings(server.url(), "d")]), work / "drift-online", per)
    finally:
        server.close()
    _, frozen = file_training(config([]), [segs[0]], work / "drift-frozen")
    out = {"rows": rows, "segments": [], "online_progressive_auc": m["progressive_auc"]}
    for k, seg in enumerate(record["segments"]):
        row = {"segment": k, "bayes_auc": seg["bayes_auc"], "online": run.segments[k].auc()}
        if k:
            row["frozen"] = file_auc(frozen, segs[k])
        out["segments"].append(row)
    later = out["segments"][1:]
    out["online_mean_1_3"] = float(np.mean([r["online"] for r in later]))
    out["frozen_mean_1_3"] = float(np.mean([r["frozen"] for r in later]))
    out["margin"] = out["online_mean_1_3"] - out["frozen_mean_1_3"]
    return out


def render(results: dict, meta: dict) -> str:
    lines = [f"# Online training (bench/online.py, {meta['date']})", "", f"`{meta['command']}`"]
    lines += ["", f"Machine: {meta['machine']}.", ""]
    if f := results.get("freshness"):
        lines += [
            "## Freshness: a burst entering the stream -> the served prediction moved", "",
            "| load | bursts moved | p50 | p99 | max | trainer rows/s | lag at end |",
            "|---|---|---|---|---|---|---|",
            f"| {f['impressions_per_s']:,.0f} impressions/s ({f['events_per_s']:,.0f} events/s)"
            f" | {f['moved']} of {f['bursts']} | {f['p50_s']:.2f} s | {f['p99_s']:.2f} s | "
            f"{f['max_s']:.2f} s | {f['trainer_rows_per_s']:,.0f} | {f['lag_at_end']} |", "",
        ]  # fmt: skip
    if t := results.get("throughput"):
        lines += [
            "## Throughput: the same rows from a file and from the streams", "",
            "| rows | file rows/s (median) | stream rows/s (median) | stream / file |",
            "|---|---|---|---|",
            f"| {t['rows']:,} | {t['file_median']:,.0f} | {t['stream_median']:,.0f} | "
            f"{t['ratio']:.2f} |", "",
        ]  # fmt: skip
    if d := results.get("drift"):
        lines += [
            "## Drift: online training against a model trained once on segment 0", "",
            "| segment | Bayes-optimal | frozen | online (progressive) |", "|---|---|---|---|",
        ]  # fmt: skip
        for r in d["segments"]:
            frozen = f"{r['frozen']:.4f}" if "frozen" in r else "(trained on it)"
            lines.append(
                f"| {r['segment']} | {r['bayes_auc']:.4f} | {frozen} | {r['online']:.4f} |"
            )
        lines += [
            f"| 1-3 mean | | {d['frozen_mean_1_3']:.4f} | {d['online_mean_1_3']:.4f} "
            f"(+{d['margin']:.4f}) |", "",
        ]  # fmt: skip
    if mem := results.get("memory"):
        lines += [
            "## Memory: ever-new ids through 100,000-row dynamic tables", "",
            "| impressions | rate | rows trained | trainer RSS half way | max in the second half "
            "| growth | freshness p50 / p99 |",
            "|---|---|---|---|---|---|---|",
            f"| {mem['events']:,} | {mem['rate']:,.0f}/s | {mem['rows_trained']:,} | "
            f"{mem['rss_at_half_mb']:,.0f} MB | {mem['rss_max_second_half_mb']:,.0f} MB | "
            f"{100 * mem['growth_second_half']:.1f}% | {mem['freshness_s']['p50']:.2f} s / "
            f"{mem['freshness_s']['p99']:.2f} s |",
            "",
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="freshness,throughput,drift")
    p.add_argument("--rate", type=float, default=4000.0, help="freshness: impressions/s")
    p.add_argument("--bursts", type=int, default=12)
    p.add_argument("--burst", type=int, default=200, help="impressions per burst")
    p.add_argument("--rows", type=int, default=60_000, help="throughput rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drift-rows", type=int, default=160_000)
    p.add_argument("--events", type=int, default=1_000_000, help="memory: impressions")
    p.add_argument("--memory-rate", type=float, default=5000.0, help="memory: impressions/s")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    parts = args.parts.split(",")
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/online.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"
        ),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
    }  # fmt: skip
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-online-") as tmp:
        work = Path(tmp)
        if "freshness" in parts:
            results["freshness"] = freshness(work, args.rate, args.bursts, args.burst)
            print(json.dumps(results["freshness"], indent=1, default=str), flush=True)
        if "throughput" in parts:
            results["throughput"] = throughput(work, args.rows, args.repeats)
            print(json.dumps(results["throughput"], indent=1), flush=True)
        if "drift" in parts:
            results["drift"] = drift(work, args.drift_rows)
            print(json.dumps(results["drift"], indent=1), flush=True)
        if "memory" in parts:
            results["memory"] = memory(work, args.events, args.memory_rate)
            print(json.dumps(results["memory"], indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = (
        "online" if parts == ["freshness", "throughput", "drift"] else "online-" + "-".join(parts)
    )
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out / f"{name}.md").write_text(render(results, meta))
    print(render(results, meta))


if __name__ == "__main__":
    main()
