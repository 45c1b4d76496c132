"""The access log's buffered handler (dlrm_core/logs.py): lines written in batches, none lost."""

import io
import json
import logging
import time

from dlrm_core.logs import BufferedStreamHandler, JsonFormatter, TextFormatter, logging_config


def _buffered(
    name: str, capacity: int, interval_s: float
) -> tuple[io.StringIO, BufferedStreamHandler, logging.Logger]:
    """A logger ``name`` writing bare messages into a string through a buffered handler."""
    stream = io.StringIO()
    handler = BufferedStreamHandler(stream, capacity=capacity, interval_s=interval_s)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(name)
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    return stream, handler, log


def test_lines_wait_for_a_batch_then_come_in_order():
    stream, handler, log = _buffered("test.logs.batch", capacity=3, interval_s=60)
    log.info("a")
    log.info("b")
    assert stream.getvalue() == ""  # buffered
    log.info("c")  # the third: the batch is full
    assert stream.getvalue() == "a\nb\nc\n"
    log.info("d")
    log.warning("e")  # a warning goes out at once, with what waited before it
    assert stream.getvalue() == "a\nb\nc\nd\ne\n"
    log.info("f")
    handler.close()  # logging.shutdown closes every handler at exit: nothing is lost
    assert stream.getvalue().endswith("e\nf\n")


def test_a_lone_line_is_written_within_the_interval():
    stream, handler, log = _buffered("test.logs.interval", capacity=1000, interval_s=0.05)
    log.info("alone")
    deadline = time.monotonic() + 5
    while stream.getvalue() == "" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.getvalue() == "alone\n"  # by the writer thread, no further line needed
    handler.close()


def test_served_config_sends_the_access_log_through_the_buffered_handler():
    """The access log has its own (buffered) handler; its lines still propagate (handlers added
    to ``api`` or the root see them) and the root's stderr handler drops them (no line twice)."""
    config = logging_config()
    assert config["handlers"]["access"]["()"] is BufferedStreamHandler
    access = config["loggers"]["api.access"]
    assert access["handlers"] == ["access"] and access.get("propagate", True)
    assert "not_access" in config["handlers"]["stderr"]["filters"]
    drop = config["filters"]["not_access"]["()"]()
    record = lambda name: logging.LogRecord(name, logging.INFO, __file__, 1, "m", None, None)  # noqa: E731
    assert not drop.filter(record("api.access")) and drop.filter(record("api.service"))


def test_time_stamps_follow_the_clock_and_the_format():
    """One strftime a second, cached: a later second and another date format each get their own."""
    fmt = TextFormatter()
    first = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    same = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    same.created = int(first.created) + 0.999
    later = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    later.created = first.created + 3600
    for record in (first, same, later):
        for datefmt in ("%H:%M:%S", "%Y-%m-%d %H:%M:%S"):
            assert fmt.formatTime(record, datefmt) == time.strftime(
                datefmt, time.localtime(record.created)
            )
    line = json.loads(JsonFormatter().format(later))
    assert line["time"].startswith(time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(later.created)))


def test_the_default_time_format_keeps_its_milliseconds():
    """formatTime without a date format is logging's own (milliseconds included), never cached."""
    fmt = TextFormatter()
    a = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    b = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    a.created, a.msecs = 1_000_000.25, 250.0
    b.created, b.msecs = 1_000_000.75, 750.0
    assert fmt.formatTime(a).endswith(",250") and fmt.formatTime(b).endswith(",750")
