"""Online training, `dlrm train --stream` (dense_trainer/online.py, issue 37): rows joined from
the impression and click streams, trained on, acknowledged after checkpoints; malformed entries
dead-lettered; a SIGKILLed trainer resumed with every impression trained on at least once and
twice only after the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import redis

from dense_trainer.data.stream.replay import rows_of
from dense_trainer.distributed import free_port
from dlrm_cli import main

ROWS = 3000
WINDOW_S = 1.0


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("stream-data")
    assert (
        main(["data", "synth", "--train-rows", str(ROWS), "--test-rows", "10", "--out", str(out)])
        == 0
    )
    return list(rows_of(out / "train.txt", "label"))


def publish(
    url: str, rows, tag: str, every_ms: int = 2, delay_ms: int = 300, extra=None
) -> tuple[str, str]:
    """The rows as impression entries ``every_ms`` apart in stream time (explicit ids: an hour
    of stream is written in a moment), clicks ``delay_ms`` after theirs; -> stream names."""
    imp, clk = f"imp-{tag}", f"clk-{tag}"
    r = redis.Redis.from_url(url, decode_responses=True)
    pipe = r.pipeline(transaction=False)
    clicks, start_ms = [], int(time.time() * 1000) - 3_600_000  # an hour ago
    for n, row in enumerate(rows):
        row = dict(row)
        y = row.pop("label", "0")
        ms = start_ms + n * every_ms
        fields = {"impression_id": f"{tag}-{n}", **row, **((extra or {}).get(n, {}))}
        pipe.xadd(imp, fields, id=f"{ms}-0")
        if y == "1":
            clicks.append((ms + delay_ms, n))
    for seq, (ms, n) in enumerate(clicks):
        pipe.xadd(clk, {"impression_id": f"{tag}-{n}", "label": "1"}, id=f"{ms}-{seq}")
    pipe.execute()
    return imp, clk


def train_args(url, imp, clk, out, *more):
    return [
        "train",
        "--stream",
        url,
        "--out",
        str(out),
        "--hash-size",
        "4096",
        "--no-progress",
        "--batch-size",
        "256",
        "--set",
        f"stream.impressions={imp}",
        "--set",
        f"stream.clicks={clk}",
        "--set",
        f"stream.join_window_s={WINDOW_S}",
        "--set",
        "stream.idle_exit_s=1.5",
        "--set",
        "stream.max_batch_wait_s=0.2",
        *more,
    ]


def scrape(port: int, out: list[str], seconds: float = 60.0) -> None:
    """Read /metrics until it has counted rows (or ``seconds`` pass)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
            out.append(text)
            if "dlrm_stream_rows_total 0.0" not in text:
                return
        except OSError:
            pass
        time.sleep(0.05)


def test_stream_training_joins_trains_and_acknowledges(redis_server, rows, tmp_path):
    tag = uuid.uuid4().hex[:8]
    imp, clk = publish(redis_server.url, rows * 4, tag)
    log, port = tmp_path / "trained.tsv", free_port()
    scraped: list[str] = []
    scraper = threading.Thread(target=scrape, args=(port, scraped), daemon=True)
    scraper.start()
    more = ["--set", f"stream.trained_log={log}", "--set", f"stream.metrics_port={port}"]
    assert main(train_args(redis_server.url, imp, clk, tmp_path / "out", *more)) == 0
    scraper.join(timeout=10)
    assert scraped, "no /metrics answered while training"
    text = scraped[-1]
    for name in (
        "dlrm_stream_rows_total",
        "dlrm_stream_lag_entries",
        "dlrm_join_pending",
        "dlrm_join_late_total",
        'dlrm_join_rows_total{how="joined"}',
    ):
        assert name in text
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    clicks = 4 * sum(r.get("label") == "1" for r in rows)
    assert m["rows"] == 4 * ROWS and m["join"]["joined"] == clicks
    assert m["join"]["expired"] == 4 * ROWS - clicks and m["join"]["late"] == 0
    assert m["dead_letters"] == {}
    assert 0.6 < m["progressive_auc"] < 1.0  # learns from the stream (Bayes AUC ~0.86)
    assert m["config"]["embedding"]["ids"] == "dynamic"  # the default for streams
    trained = [line.split("\t")[1] for line in log.read_text().splitlines()]
    assert sorted(trained) == sorted(f"{tag}-{n}" for n in range(4 * ROWS))  # each exactly once
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert r.xpending(imp, "dlrm-train")["pending"] == 0  # all acknowledged at the end
    assert r.xpending(clk, "dlrm-train")["pending"] == 0
    assert (tmp_path / "out" / "checkpoints").is_dir()


def test_malformed_entries_go_to_the_dead_letters_and_training_goes_on(
    redis_server, rows, tmp_path
):
    tag = uuid.uuid4().hex[:8]
    bad = {  # 1% of the stream, in varied ways
        **{n: {"I1": "abc"} for n in range(3, ROWS, 500)},  # not a number
        **{n: {"I2": "1e300"} for n in range(5, ROWS, 500)},  # out of range
        **{n: {"colour": "red"} for n in range(7, ROWS, 500)},  # a column the schema lacks
        **{n: {"C1": "zz-not-hex"} for n in range(11, ROWS, 500)},  # a bad hex id
    }
    imp, clk = publish(redis_server.url, rows, tag, extra=bad)
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.xadd(imp, {"I1": "3"})  # no impression_id
    r.xadd(clk, {"impression_id": f"{tag}-0", "label": "yes"})  # a label other than 0/1
    assert main(train_args(redis_server.url, imp, clk, tmp_path / "out")) == 0
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    dead_imp = r.xrange(imp + ":dead")
    reasons = {f["reason"] for _, f in dead_imp} | {f["reason"] for _, f in r.xrange(clk + ":dead")}
    bad_rows = len(bad)
    # every malformed impression is dead-lettered with its reason; a click of one goes too
    assert {f["impression_id"] for _, f in dead_imp if "impression_id" in f} == {
        f"{tag}-{n}" for n in bad
    }
    assert any("I1 is not a number" in x for x in reasons)
    assert any("out of range" in x for x in reasons)
    assert "unknown column 'colour'" in reasons
    assert any("C1" in x for x in reasons)
    assert "no impression_id" in reasons and any("expected 0 or 1" in x for x in reasons)
    assert m["rows"] == ROWS - bad_rows  # the rest trained on
    assert r.xpending(imp, "dlrm-train")["pending"] == 0


def _steps_of(log: Path) -> list[tuple[int, str]]:
    return [(int(s), i) for s, i in (line.split("\t") for line in log.read_text().splitlines())]


def start_training(url, rows, tmp_path, *more):
    """12,000 impressions published, and `dlrm train --stream` started on them (a checkpoint
    every 7 steps, every row trained on logged)."""
    tag = uuid.uuid4().hex[:8]
    imp, clk = publish(url, rows * 4, tag)
    log, out = tmp_path / "trained.tsv", tmp_path / "out"
    args = [
        *train_args(url, imp, clk, out, "--set", f"stream.trained_log={log}"),
        *("--set", "train.checkpoint_every_steps=7", "--train.threads", "1"),
        *more,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrm_cli", *args],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return tag, imp, clk, log, args, proc


def test_a_killed_trainer_resumes_with_nothing_lost_and_duplicates_after_its_checkpoint(
    redis_server, rows, tmp_path
):
    kill_and_resume(redis_server.url, rows, tmp_path, "trainer")


def test_a_killed_embedding_server_ends_the_job_and_resume_loses_nothing(
    redis_server, rows, tmp_path
):
    kill_and_resume(redis_server.url, rows, tmp_path, "server")


def kill_and_resume(url, rows, tmp_path, victim: str) -> None:
    """SIGKILL the trainer (one process) or the embedding server (a job of one of each) once a
    checkpoint is written, resume, and count from the trained-rows log: every impression trained
    at least once, twice only those after the checkpoint the job resumed from."""
    more = ["--embedding-servers", "1"] if victim == "server" else []
    tag, imp, clk, log, args, proc = start_training(url, rows, tmp_path, *more)
    cli, out = [sys.executable, "-m", "dlrm_cli"], tmp_path / "out"
    deadline = time.monotonic() + 180
    while not list((out / "checkpoints").glob("step-*[0-9]")) or len(_steps_of(log)) < 5000:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if victim == "server":
        pid = json.loads((out / "ranks" / "rank-1.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "embedding server" in err  # the job ends naming it
    else:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    first = _steps_of(log)
    done = subprocess.run([*cli, *args, "--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    both = _steps_of(log)
    resumed_at = both[len(first)][0] - 1  # the step of the checkpoint it resumed from
    assert f"(step {resumed_at}," in done.stderr
    trained: dict[str, list[int]] = {}
    for step, i in first:
        trained.setdefault(i, []).append(step)
    for _, i in both[len(first) :]:
        trained.setdefault(i, []).append(-1)
    assert set(trained) == {f"{tag}-{n}" for n in range(4 * ROWS)}  # each at least once
    twice = {i: s for i, s in trained.items() if len(s) > 1}
    # rows trained after that checkpoint are trained again, those before it never
    assert bool(twice) == (first[-1][0] > resumed_at)
    assert all(len(s) == 2 and s[0] > resumed_at for s in twice.values())  # after it only


def test_training_outlives_a_redis_restart_from_its_append_only_file(rows, tmp_path):
    from .redis_server import RedisServer

    server = RedisServer(tmp_path / "redis", aof=True)
    (tmp_path / "redis").mkdir()
    server.start()
    try:
        tag, imp, clk, log, _, proc = start_training(server.url, rows, tmp_path)
        deadline = time.monotonic() + 120
        while not log.exists() or len(_steps_of(log)) < 3000:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.kill()  # SIGKILL mid-stream
        time.sleep(1.0)
        server.start()  # from its append-only file
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "retrying" in err
        trained = [i for _, i in _steps_of(log)]
        assert sorted(trained) == sorted(f"{tag}-{n}" for n in range(4 * ROWS))  # once each
        r = redis.Redis.from_url(server.url, decode_responses=True)
        assert r.xpending(imp, "dlrm-train")["pending"] == 0
    finally:
        server.stop(save=False)


def _e(stream, ms):
    from dense_trainer.data.stream.source import Entry

    return Entry(stream, f"{ms}-0", {})


def test_time_merge_releases_entries_in_the_order_they_happened():
    from dense_trainer.data.stream.batches import TimeMerge

    m = TimeMerge(["imp", "clk"], hold=3)
    # a backlog: the sparse click stream's first read reaches further in time
    out = m.add(["imp", "clk"], [_e("imp", 1), _e("imp", 2), _e("clk", 3), _e("clk", 9)])
    assert [(e.stream, e.time_ms) for e in out] == [("imp", 1), ("imp", 2)]
    out = m.add(["imp", "clk"], [_e("imp", 5), _e("imp", 10)])  # clicks: nothing new (dry)
    assert [(e.stream, e.time_ms) for e in out] == [("clk", 3), ("imp", 5), ("clk", 9), ("imp", 10)]
    m.add(["clk"], [_e("clk", 20), _e("clk", 21), _e("clk", 22)])
    assert m.wanted() == ["imp"]  # the clicks wait for the impressions to catch up (bounded)


def test_acknowledgements_wait_for_the_checkpoint_that_holds_them():
    from dense_trainer.online import AckLog

    class Source:
        acked: list = []
        fail = False

        def ack(self, entries):
            if self.fail:
                raise RuntimeError("down")
            self.acked += [e.id for e in entries]

    src, log = Source(), AckLog()
    log.add([_e("imp", 1), _e("clk", 1)])
    recorded = log.cut(step=10)
    assert recorded == {"imp": "1-0", "clk": "1-0"}
    log.add([_e("imp", 2)])
    assert log.durable(None, src) == 0 and log.durable(9, src) == 0  # not yet durable
    src.fail = True
    with pytest.raises(RuntimeError):
        log.durable(10, src)
    src.fail = False
    assert log.durable(10, src) == 2 and sorted(src.acked) == ["1-0", "1-0"]  # kept, then acked
    log.cut(step=20)
    assert log.durable(20, src) == 1 and src.acked[-1] == "2-0"
