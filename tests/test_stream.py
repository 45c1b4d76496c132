"""Event streams for online training (dense_trainer/data/stream, issue 37): the Redis Streams
source (at least once: a restarted consumer reads its unacknowledged entries again; shared by a
group; dead letters; lag; bounded waits), the joiner, and `dlrm stream replay` end to end."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
import redis

from dense_trainer.data.stream.joiner import Joiner
from dense_trainer.data.stream.redis_streams import RedisStreamSource
from dense_trainer.data.stream.replay import replay
from dense_trainer.data.stream.source import Entry
from dlrm_cli import main
from dlrm_core.errors import DlrmError


def names(*parts):
    tag = uuid.uuid4().hex[:8]
    return [f"{p}-{tag}" for p in parts]


def test_a_restarted_consumer_reads_what_it_never_acknowledged(redis_server):
    (stream,) = names("s")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    ids = [r.xadd(stream, {"n": str(i)}) for i in range(6)]
    a = RedisStreamSource(redis_server.url, [stream], "job", "trainer-0")
    first = a.read(4, 0.1)
    assert [e.fields["n"] for e in first] == ["0", "1", "2", "3"]
    a.ack(first[:2])
    a.close()  # dies: 2 and 3 were read, never acknowledged
    b = RedisStreamSource(redis_server.url, [stream], "job", "trainer-0")
    again = b.read(10, 0.1)
    assert [e.fields["n"] for e in again] == ["2", "3"]  # its own pending entries first
    assert [e.fields["n"] for e in b.read(10, 0.1)] == ["4", "5"]  # then new ones
    assert b.read(10, 0.05) == []
    other = RedisStreamSource(redis_server.url, [stream], "job", "trainer-1")
    r.xadd(stream, {"n": "6"})
    assert [e.fields["n"] for e in other.read(10, 0.1)] == ["6"]  # the group shares the stream
    assert b.read(10, 0.05) == []
    assert all(e.id in ids for e in again)


def test_dead_letters_lag_and_a_blocked_read(redis_server):
    (stream,) = names("s")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    for i in range(10):
        r.xadd(stream, {"n": str(i)})
    src = RedisStreamSource(redis_server.url, [stream], "job", "c")
    assert src.lag() == 10
    got = src.read(4, 0.1)
    assert src.lag() == 6
    src.dead_letter(got[0], "label 'x': expected 0 or 1")
    (dead_id, dead), *_ = r.xrange(stream + ":dead")
    assert dead == {"entry": got[0].id, "reason": "label 'x': expected 0 or 1", "n": "0"}
    assert r.xpending(stream, "job")["pending"] == 3  # the dead letter was acknowledged
    src.read(100, 0.1)
    t0 = time.monotonic()
    assert src.read(10, 0.3) == []  # waits its block, no more
    assert 0.25 < time.monotonic() - t0 < 2.0


def test_a_hung_redis_ends_in_an_error_within_the_bound():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    port = listener.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(DlrmError) as err:
        RedisStreamSource(f"redis://u:s3cret@127.0.0.1:{port}/0", ["s"], "g", "c", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert "s3cret" not in str(err.value) and "***" in str(err.value)
    listener.close()


def entry(stream, ms, **fields):
    return Entry(stream, f"{ms}-0", {k: str(v) for k, v in fields.items()})


def test_joiner_labels_by_feedback_window_and_bound():
    j = Joiner(window_s=10, max_pending=3)
    assert j.add(entry("i", 1000, impression_id="a", user="u1"), False) == ([], None)
    rows, _ = j.add(entry("c", 3000, impression_id="a", label=1), True)
    assert [(r.fields, r.label, r.joined_after_ms) for r in rows] == [({"user": "u1"}, 1, 2000)]
    j.add(entry("i", 4000, impression_id="b"), False)
    assert j.due(13_999) == [] and [r.label for r in j.due(14_000)] == [0]  # window closed
    rows, _ = j.add(entry("c", 14_500, impression_id="b", label=1), True)
    assert rows == [] and j.due(30_000) == [] and j.stats.late == 1  # after its negative
    assert len(j.take_done()) == 1
    rows, _ = j.add(entry("c", 31_000, impression_id="z", label=1), True)  # click first
    rows, _ = j.add(entry("i", 31_500, impression_id="z"), False)
    assert [r.label for r in rows] == [1]
    for k in "defg":  # over max_pending: the oldest goes out as a negative
        rows, _ = j.add(entry("i", 32_000, impression_id=k), False)
    assert [r.label for r in rows] == [0] and j.stats.evicted == 1 and j.pending == 3
    assert j.add(entry("i", 32_000, impression_id=""), False)[1] == "no impression_id"
    assert "expected 0 or 1" in j.add(entry("c", 32_000, impression_id="e", label=2), True)[1]
    assert j.stats.malformed == 2 and j.stats.joined == 2 and j.stats.expired == 1


def test_replay_then_join_gives_back_every_row(redis_server, tmp_path, capsys):
    lines = ["id,click,user,price"] + [f"{i},{i % 3 == 0:d},u{i % 7},{i}.5" for i in range(40)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    imp, clk = names("imp", "clk")
    code = main(
        ["stream", "replay", str(tmp_path / "t.csv"), "--url", redis_server.url, "--rate",
         "400", "--click-delay", "0.2", "--label", "click", "--impressions", imp, "--clicks", clk]
    )  # fmt: skip
    assert code == 0 and "replayed 40 impressions and 14 clicks" in capsys.readouterr().out
    src = RedisStreamSource(redis_server.url, [imp, clk], "job", "c")
    j, rows = Joiner(window_s=1.0), []
    for e in src.read(1000, 0.1):
        rows += j.add(e, e.stream == clk)[0]
    rows += j.due(10**15)
    got = sorted((int(r.fields["id"]), r.label, r.fields["user"]) for r in rows)
    assert got == [(i, int(i % 3 == 0), f"u{i % 7}") for i in range(40)]
    src.ack([e for r in rows for e in r.entries])
    assert redis.Redis.from_url(redis_server.url).xpending(imp, "job")["pending"] == 0


def test_replay_reads_criteo_files_at_its_rate(redis_server, criteo_sample):
    imp, clk = names("imp", "clk")
    t0 = time.monotonic()
    stats = replay([criteo_sample / "train.txt"], redis_server.url, imp, clk, rate=1000,
                   click_delay_s=0.0, max_rows=200)  # fmt: skip
    assert time.monotonic() - t0 >= 0.19  # 200 rows at 1000/s
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert r.xlen(imp) == 200 and r.xlen(clk) == stats.clicks > 0
    first = r.xrange(imp, count=1)[0][1]
    assert first["impression_id"] == "r-0" and "label" not in first and "I1" in first


def test_replay_names_a_missing_file_and_a_dead_redis_without_its_password(tmp_path, capsys):
    assert main(["stream", "replay", str(tmp_path / "none.parquet")]) != 0
    assert "none.parquet: no such file" in capsys.readouterr().err
    (tmp_path / "t.csv").write_text("label,a\n1,x\n")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://u:s3cret@127.0.0.1:{port}/0"
    with pytest.raises(DlrmError) as err:
        replay([tmp_path / "t.csv"], url, rate=1000, timeout_s=0.5)
    assert "could not publish the rows" in str(err.value) and "ConnectionError" in str(err.value)
    assert "s3cret" not in str(err.value) and "***" in str(err.value)


def test_backfill_writes_a_past_log_at_once_and_refuses_newer_streams(
    redis_server, tmp_path, capsys
):
    lines = ["id,click,user"] + [f"{i},{i % 2},u{i}" for i in range(50)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    imp, clk = names("imp", "clk")
    args = ["stream", "replay", str(tmp_path / "t.csv"), "--url", redis_server.url, "--rate",
            "10", "--click-delay", "1", "--label", "click", "--impressions", imp, "--clicks", clk,
            "--backfill"]  # fmt: skip
    t0 = time.monotonic()
    assert main(args) == 0 and time.monotonic() - t0 < 3  # 5 s of stream, written at once
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    times = [int(i.split("-")[0]) for i, _ in r.xrange(imp)]
    gaps = {b - a for a, b in zip(times, times[1:], strict=False)}
    assert len(times) == 50 and gaps == {100}  # 10 a second
    assert times[-1] <= time.time() * 1000  # the past, ending about now
    clicks = r.xrange(clk)
    assert len(clicks) == 25 and int(clicks[0][0].split("-")[0]) == times[1] + 1000
    assert main(args) != 0  # the streams now hold newer entries than a second backfill's start
    assert "holds entries newer" in capsys.readouterr().err
