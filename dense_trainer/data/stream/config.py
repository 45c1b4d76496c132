"""``[stream]``: training from event streams (``dlrm train --stream URL``)."""

from __future__ import annotations

from pydantic import Field

from dlrm_core.config import Section, flag


class StreamConfig(Section):
    """Online training: impressions and their feedback read from Redis Streams, joined into
    labelled rows and trained on as they come (``dense_trainer/online.py``)."""

    url: str | None = flag(None, "--stream")
    """The Redis holding the streams (``redis://[user[:password]@]host:port/db``); set: train from
    the streams instead of files, until stopped (SIGTERM: checkpoint, acknowledge, exit 0),
    ``max_rows`` or ``idle_exit_s``."""
    impressions: str = "impressions"
    """The impression stream: one row's feature columns by name, and an ``impression_id``."""
    clicks: str = "clicks"
    """The feedback stream: ``impression_id`` and ``label`` (1: a click)."""
    group: str = "dlrm-train"
    """The consumer group of this training job (a second job with another group reads every
    entry again)."""
    consumer: str = "trainer"
    """This trainer's name in the group (rank appended): a restarted trainer with the same name
    first reads the entries it had read but not acknowledged."""
    join_window_s: float = Field(default=30.0, gt=0)
    """How long an impression waits for its click before it is trained on as a negative."""
    max_pending: int = Field(default=1_000_000, ge=1)
    """Impressions waiting for feedback, at most (over it the oldest become negatives, counted)."""
    max_rows: int = flag(0, "--max-rows", ge=0)
    """Stop after training on this many rows (0: run until stopped)."""
    idle_exit_s: float = Field(default=0.0, ge=0)
    """Stop once no entry has arrived for this long and every pending impression is trained on
    (0: wait for entries forever: a live stream)."""
    max_batch_wait_s: float = Field(default=0.5, gt=0)
    """A batch waits at most this long for more rows before a short one is trained on (how
    fresh a quiet stream's rows are trained)."""
    read_count: int = Field(default=2048, ge=1)
    """Entries read from each stream per round trip, at most."""
    checkpoint_every_s: float = Field(default=30.0, gt=0)
    """Checkpoint (and then acknowledge the entries trained on) every this many seconds, unless
    ``train.checkpoint_every_s`` sets its own interval: a crash retrains at most this much."""
    strict_columns: bool = True
    """An impression with a field the schema does not read is malformed (dead-lettered, named
    in the reason); False: extra fields are ignored."""
    trained_log: str | None = None
    """Append ``step<TAB>impression_id`` of every row trained on to this file (an audit of what
    was trained, and how often: the crash tests count duplicates from it)."""
    reconnect_s: float = Field(default=60.0, ge=0)
    """A failing Redis call is retried for this long (a broker restarting) before training stops
    with the error (a checkpoint holds what was acknowledged; ``--resume`` goes on)."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Serve Prometheus ``/metrics`` of the run on this port (0: none): ``dlrm_stream_*`` (rows,
    lag, freshness, progressive AUC, dead letters) and ``dlrm_join_*`` (pending, late, rows)."""
    metrics_host: str = "127.0.0.1"
    """The address ``/metrics`` listens on (0.0.0.0: every interface)."""
    report_every_s: float = Field(default=10.0, gt=0)
    """Seconds between progress lines (progressive AUC and log loss, rows/s, lag, joins)."""
