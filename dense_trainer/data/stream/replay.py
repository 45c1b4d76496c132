"""``dlrm stream replay``: a file published into the impression and click streams, at a rate.

Each row becomes an impression entry (its columns by name, the label left out, and an
``impression_id``); a row labelled 1 also becomes a click entry (``impression_id``, ``label`` =
1) ``click_delay_s`` later, as a live click log would deliver it; a row labelled 0 gets no
feedback (the joiner's window makes it a negative). Rows are read in chunks (any file size) from
any input format the trainer reads: Criteo TSV (columns ``label``, ``I1``..``I13``,
``C1``..``C26``), CSV / TSV with a header, Parquet. The rate holds on average over each second;
entries are written in pipelined batches.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import redis

from dense_trainer.data.stream.joiner import IMPRESSION_ID, LABEL
from dense_trainer.data.stream.redis_streams import RedisErrors
from dlrm_core.errors import ConfigError, DataError
from dlrm_core.formats import check_files
from dlrm_core.schema import CRITEO_COLUMNS
from dlrm_core.secrets import redact_url, url_password

BATCH = 500
"""Entries written per pipelined round trip at most."""


@dataclass
class ReplayStats:
    impressions: int = 0
    clicks: int = 0
    seconds: float = 0.0


def rows_of(path: Path, label: str, chunk_rows: int = 65_536) -> Iterator[dict[str, str]]:
    """The file's rows as column -> text (empty cells left out)."""
    if path.suffix == ".parquet":
        batches = pq.ParquetFile(path).iter_batches(batch_size=chunk_rows)
    else:
        criteo = path.suffix in (".txt", ".gz") or path.name.endswith(".txt.gz")
        read = pcsv.ReadOptions(column_names=CRITEO_COLUMNS if criteo else None, block_size=1 << 22)
        parse = pcsv.ParseOptions(delimiter="\t" if criteo or path.suffix == ".tsv" else ",")
        convert = pcsv.ConvertOptions(strings_can_be_null=True, quoted_strings_can_be_null=False)
        try:
            batches = pcsv.open_csv(path, read, parse, convert)
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"{path}: cannot read ({exc})") from None
    for batch in batches:
        names = batch.schema.names
        if label not in names:
            raise DataError(f"{path}: no label column {label!r} (columns: {', '.join(names)})")
        columns = [
            [None if v is None else _text(v) for v in batch.column(i).to_pylist()]
            for i in range(batch.num_columns)
        ]
        for values in zip(*columns, strict=True):
            yield {n: v for n, v in zip(names, values, strict=True) if v is not None and v != ""}


def _text(v) -> str:
    if isinstance(v, list):
        return "|".join(str(x) for x in v)
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def replay(
    files: list[Path],
    url: str,
    impressions: str = "impressions",
    clicks: str = "clicks",
    label: str = "label",
    rate: float = 1000.0,
    click_delay_s: float = 2.0,
    max_rows: int = 0,
    run: str = "r",
    timeout_s: float = 5.0,
    backfill: bool = False,
    ago_s: float = 0.0,
) -> ReplayStats:
    """Publish the files' rows; returns what was written. ``run`` prefixes the impression ids
    (a second replay of the same file makes other impressions).

    ``backfill``: publish every row at once, as a log of the past: each entry's id carries the
    time ``rate`` would have given it, the last click ``ago_s`` seconds before now (for
    benchmarks and tests of a backlog: an hour of stream written in seconds); the streams must
    be empty or hold only older entries.
    """
    if rate <= 0:
        raise ConfigError(f"--rate {rate}: must be positive")
    check_files(files, "input")
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, decode_responses=True)
    except (ValueError, TypeError):
        raise ConfigError(f"stream URL {redact_url(url)}: not a valid Redis URL") from None
    rows = (row for path in files for row in rows_of(path, label))
    if max_rows:
        rows = itertools.islice(rows, max_rows)
    streams = (impressions, clicks, label, run)
    t0 = time.monotonic()
    with client, RedisErrors(redact_url(url), [url_password(url)], "publish the rows"):
        if backfill:
            stats = _backfill(client, list(rows), streams, rate, click_delay_s, ago_s)
        else:
            stats = _at_rate(client, rows, streams, rate, click_delay_s)
    stats.seconds = time.monotonic() - t0
    return stats


def _at_rate(client, rows, streams, rate: float, click_delay_s: float) -> ReplayStats:
    impressions, clicks, label, run = streams
    stats, t0 = ReplayStats(), time.monotonic()
    delayed: list[tuple[float, int, dict]] = []  # (due, n, click fields), a heap
    pipe, queued = client.pipeline(transaction=False), 0
    for n, row in enumerate(rows):
        due = t0 + n / rate
        queued += _flush_clicks(pipe, clicks, delayed, time.monotonic(), stats)
        wait = due - time.monotonic()
        if wait > 0:
            queued = _send(pipe, queued)
            time.sleep(wait)
        y = row.pop(label, "0")
        key = f"{run}-{n}"
        pipe.xadd(impressions, {IMPRESSION_ID: key, **row})
        stats.impressions += 1
        queued += 1
        if y == "1":
            heapq.heappush(delayed, (due + click_delay_s, n, {IMPRESSION_ID: key, LABEL: "1"}))
        if queued >= BATCH:
            queued = _send(pipe, queued)
    while delayed:
        wait = delayed[0][0] - time.monotonic()
        if wait > 0:
            queued = _send(pipe, queued)
            time.sleep(min(wait, 0.05))
        queued += _flush_clicks(pipe, clicks, delayed, time.monotonic(), stats)
    _send(pipe, queued)
    return stats


def _backfill(client, rows: list, streams, rate: float, click_delay_s: float, ago_s: float):
    impressions, clicks, label, run = streams
    step_ms = 1000.0 / rate
    start_ms = int(1000 * (time.time() - ago_s - click_delay_s) - len(rows) * step_ms)
    for stream in (impressions, clicks):
        top = client.xrevrange(stream, count=1)
        if top and int(top[0][0].split("-")[0]) >= start_ms:
            raise ConfigError(
                f"--backfill: stream {stream} holds entries newer than the backfill's start "
                "(use new stream names, or replay without --backfill)"
            )
    pipe, queued, later = client.pipeline(transaction=False), 0, []
    for n, row in enumerate(rows):
        ms = start_ms + int(n * step_ms)
        y = row.pop(label, "0")
        key = f"{run}-{n}"
        pipe.xadd(impressions, {IMPRESSION_ID: key, **row}, id=f"{ms}-{n}")
        if y == "1":
            later.append((ms + int(1000 * click_delay_s), n, key))
        queued += 1
        if queued >= BATCH:
            queued = _send(pipe, queued)
    for ms, n, key in later:
        pipe.xadd(clicks, {IMPRESSION_ID: key, LABEL: "1"}, id=f"{ms}-{n}")
        queued += 1
        if queued >= BATCH:
            queued = _send(pipe, queued)
    _send(pipe, queued)
    return ReplayStats(impressions=len(rows), clicks=len(later))


def _flush_clicks(pipe, stream: str, delayed: list, now: float, stats: ReplayStats) -> int:
    sent = 0
    while delayed and delayed[0][0] <= now:
        _, _, fields = heapq.heappop(delayed)
        pipe.xadd(stream, fields)
        stats.clicks += 1
        sent += 1
    return sent


def _send(pipe, queued: int) -> int:
    if queued:
        pipe.execute()
    return 0
