"""bench/online.py's memory part: a long stream of ever-new ids through a bounded dynamic table.

The producer (this process) writes impressions whose C1..C4 are new ids on every row (and the
other features drawn from small vocabularies), clicks on a share of them 1 s later, at a rate,
trimming each stream to ``MAXLEN`` entries (the trainer acknowledges far sooner). The trainer,
``dlrm train --stream`` in its own process (``configs/tiny.toml``, dynamic tables of 100,000
rows: ids are admitted and evicted all the time, a 5 s join window), is sampled for its RSS
(``/proc/PID/status``) every 2 s. Flat: the RSS of the last half of the run grows by less than
5% of what it was half way.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
from online_kit import DLRM, REPO, Redis

MAXLEN = 300_000
CHUNK = 1_000


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _rows(rng: np.random.Generator, start: int, n: int) -> tuple[list[dict], np.ndarray]:
    """n impressions (ids ``start``.. are new in C1..C4) and their labels."""
    small = rng.integers(0, 50, size=(n, 22))
    dense = rng.integers(0, 100, size=(n, 13))
    labels = rng.random(n) < 0.2 + 0.3 * (small[:, 0] < 10)  # a learnable signal
    out = []
    for i in range(n):
        row = {f"I{j + 1}": str(dense[i, j]) for j in range(13)}
        for j in range(4):
            row[f"C{j + 1}"] = f"{(start + i) * 4 + j:08x}"
        for j in range(22):
            row[f"C{j + 5}"] = f"{j:02x}{small[i, j]:06x}"
        out.append(row)
    return out, labels


def memory(work: Path, events: int, rate: float) -> dict:
    server = Redis()
    log = (work / "mem-train.log").open("w")
    train = [*DLRM, "train", "--stream", server.url(), "--config", str(REPO / "configs/tiny.toml")]
    train += ["--hash-size", "100000", "--set", "embedding.ids=dynamic", "--out", str(work / "mem")]
    train += ["--set", "stream.join_window_s=5", "--set", "stream.idle_exit_s=10", "--no-progress"]
    proc = subprocess.Popen(train, stderr=log)
    rng = np.random.default_rng(0)
    samples: list[tuple[int, float]] = []  # (impressions written, trainer RSS MB)
    written, clicks, t0, last = 0, [], time.monotonic(), 0.0
    try:
        while written < events:
            rows, labels = _rows(rng, written, CHUNK)
            pipe = server.client.pipeline(transaction=False)
            for i, row in enumerate(rows):
                key = f"m-{written + i}"
                pipe.xadd("impressions", {"impression_id": key, **row}, maxlen=MAXLEN)
                if labels[i]:
                    clicks.append((time.monotonic() + 1.0, key))
            while clicks and clicks[0][0] <= time.monotonic():
                _, key = clicks.pop(0)
                pipe.xadd("clicks", {"impression_id": key, "label": "1"}, maxlen=MAXLEN)
            pipe.execute()
            written += CHUNK
            wait = t0 + written / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if time.monotonic() - last >= 2.0:
                last = time.monotonic()
                rss = _rss_mb(proc.pid)
                if rss is not None:
                    samples.append((written, rss))
            if proc.poll() is not None:
                raise RuntimeError(f"the trainer exited: see {work / 'mem-train.log'}")
        seconds = time.monotonic() - t0
        proc.terminate()
        proc.wait(timeout=120)
        m = json.loads((work / "mem" / "metrics.json").read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
        server.close()
    half = [r for w, r in samples if w >= events // 2]
    at_half, peak_end = (half[0], max(half)) if half else (None, None)
    return {
        "events": events,
        "rate": events / seconds,
        "rss_mb": samples[:: max(1, len(samples) // 20)],
        "rss_at_half_mb": at_half,
        "rss_max_second_half_mb": peak_end,
        "growth_second_half": (peak_end - at_half) / at_half if half else None,
        "rows_trained": m["rows"],
        "lag_at_end": m["lag_entries"],
        "join": m["join"],
        "join_pending_at_end": m["join_pending"],
        "freshness_s": m["freshness_s"],
    }
