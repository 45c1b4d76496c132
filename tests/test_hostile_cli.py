"""What a hostile review and a first-time user tried against the commands (issue 38): a store
password with every character URLs reserve never shows in any output of publish, store or serve
(tracebacks included), malformed store URLs get our own message, a file of the wrong format is
named as what it is, and CSV and Parquet copies of one table get one schema. The serving API's
side is in ``test_hostile.py``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from dense_trainer.distributed import free_port
from dlrm_cli import main as dlrm
from dlrm_core.errors import ConfigError, DataError
from dlrm_core.schema_inference import infer_schema
from dlrm_core.secrets import redact_url, scrub, url_password
from dlrm_core.store_url import check_store_url

from .conftest import REPO
from .test_hostile import _serve_log

SPECIAL = "/?#@:[]%&=+ ;,!$'\"\\`*~<>{}|^"
HEAD, TAIL = "Zq7sec", "ret9X"  # no piece of a password may show: neither half of it


def _password(c: str) -> str:
    return f"{HEAD}{c}{TAIL}"


def _urls(c: str, port: int) -> list[str]:
    pw = _password(c)
    return [
        f"redis://default:{pw}@127.0.0.1:{port}/0",  # as a user would write it
        f"redis://default:{quote(pw, safe='')}@127.0.0.1:{port}/0",  # percent-encoded: valid
        f"rediss://u:{pw}@127.0.0.1:{port}/0?ssl_ca_certs=/nowhere.pem",
    ]


def _clean(text: str) -> None:
    assert HEAD not in text and TAIL not in text, text[-3000:]


@pytest.mark.parametrize("c", list(SPECIAL))
def test_redaction_hides_every_piece_of_the_password(c):
    for url in _urls(c, 6379):
        _clean(redact_url(url))
        password = url_password(url)
        assert password and HEAD in password and TAIL in password, (url, password)
        _clean(scrub(f"library said {url} and {password}", [password]))


def test_malformed_redis_urls_get_our_message():
    pw = _password("/")
    for url, says in [
        (f"redis://default:{pw}@127.0.0.1:1/0", "percent-encode it"),
        (f"redis://u:{_password('#')}@h:1/0", "--store-password-file"),
        (f"redis://u:{HEAD}{TAIL}@h:xx/0", "the port is not a number"),
        (f"redis://u:{HEAD}{TAIL}@h:99999/0", "the port is not a number"),
        (f"redis://u:{HEAD}{TAIL}@:1/0", "no host"),
        (f"redis://u:{HEAD}{TAIL}@h:1/db0", "the database 'db0' is not a number"),
        (f"redis://u:{_password('[')}@h:1/0", "cannot be read as a URL"),
        ("unix://", "no socket path"),
    ]:
        with pytest.raises(ConfigError, match=says) as err:
            check_store_url(url)
        _clean(str(err.value))
        # urllib's message (quoting the port) is not passed on
        assert "could not be cast" not in str(err.value)


def test_a_password_in_the_url_logs_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dlrm_core.store_url"):
        assert check_store_url(f"redis://u:{HEAD}w{TAIL}@127.0.0.1:1/3") == "redis"
    assert "--store-password-file" in caplog.text
    _clean(caplog.text)


def _run(args: list[str], debug: bool, capfd, monkeypatch) -> str:
    """One command in this process: its output, and the traceback DLRM_DEBUG=1 lets out."""
    monkeypatch.setenv("DLRM_DEBUG", "1") if debug else monkeypatch.delenv(
        "DLRM_DEBUG", raising=False
    )
    try:
        code = dlrm(["-v", *args])  # debug logging on: nothing may leak there either
        tb = ""
    except Exception:  # noqa: BLE001 (DLRM_DEBUG re-raises: its traceback is output too)
        code, tb = 2, traceback.format_exc()
    out, err = capfd.readouterr()
    assert code == 2, (args, out, err)
    return out + err + tb


@pytest.mark.parametrize("c", list(SPECIAL))
def test_no_store_password_shows_in_publish_or_store(
    c, trained_criteo, tmp_path, capfd, monkeypatch
):
    dead = free_port()  # nothing listens: every store call fails, and says so
    seen = []
    for url in _urls(c, dead):
        for debug in (False, True):
            for args in (
                ["publish", "--checkpoint", str(trained_criteo), "--store", url],
                ["store", "list", "--store", url],
                ["store", "gc", "--store", url],
            ):
                seen.append(_run(args, debug, capfd, monkeypatch))
    text = "\n".join(seen)
    _clean(text)
    assert "***" in text  # the URL was shown, redacted


@pytest.mark.slow
def test_no_store_password_shows_when_serving(trained_criteo, tmp_path):
    dead = free_port()
    # the URL cannot be read: refused at once, through --store and DLRM_STORE alike
    for c in "/#?@":
        url = _urls(c, dead)[0]
        for args, env in (
            (["--store", url], {}),
            ([], {"DLRM_STORE": url}),
            ([], {"DLRM_STORE": url, "DLRM_DEBUG": "1"}),
        ):
            proc = subprocess.run(
                [sys.executable, str(REPO / "dlrm_cli.py"), "serve", "--port", "1", *args],
                env={**os.environ, "PYTHONPATH": str(REPO), **env},
                capture_output=True,
                text=True,
                timeout=60,
            )
            output = proc.stdout + proc.stderr
            assert proc.returncode != 0 and "percent-encode" in output
            # one line, no 29-line traceback
            assert "DLRM_DEBUG" in env or len(output.splitlines()) == 1, output
            _clean(output)
    # percent-encoded: it starts, the store is down, every log line redacted
    url = _urls("/#?@", dead)[1]
    log = _serve_log(
        ["--log-level", "debug", "--access-log"],
        {
            "DLRM_STORE": url,
            "DLRM_DEBUG": "1",
            "DLRM_STORE_TIMEOUT_S": "0.2",
            "DLRM_POLL_INTERVAL_S": "0.1",
        },
        b"503",
    )
    assert "carries a password" in log and "unavailable" in log, log[-2000:]
    _clean(log)


# -- format mismatches and schema inference --------------------------------------------------------


@pytest.fixture(scope="module")
def table_files(tmp_path_factory):
    """One table as CSV and as Parquet: ids as integers, as hex text and as floats (pandas writes an
    integer column holding a null as float64)."""
    out = tmp_path_factory.mktemp("hostile-table")
    rng, n = np.random.default_rng(0), 3000
    ids = rng.permutation(10**6)[:n]
    table = pa.table(
        {
            "id": np.arange(n),
            "uid": ids,
            "hid": [f"{x:08x}" for x in ids],
            "fid": ids.astype(float),
            "click": rng.integers(0, 2, n),
            "x": rng.normal(size=n),
            "c": rng.choice(["a", "b", "c"], n),
        }
    )
    pcsv.write_csv(table, out / "t.csv")
    pq.write_table(table, out / "t.parquet")
    return out


def test_csv_and_parquet_get_one_schema(table_files):
    kinds = [
        {d.column: d.kind for d in infer_schema([table_files / name], "click").decisions}
        for name in ("t.csv", "t.parquet")
    ]
    assert kinds[0] == kinds[1]
    assert all(kinds[1][c] == "ignored" for c in ("id", "uid", "hid", "fid")), kinds[1]


def test_a_file_of_another_format_is_named_as_what_it_is(table_files, tmp_path, capsys):
    csv_cfg, parquet_cfg = tmp_path / "csv.toml", tmp_path / "parquet.toml"
    assert (
        dlrm(
            [
                "data",
                "schema",
                str(table_files / "t.csv"),
                "--label",
                "click",
                "--out",
                str(csv_cfg),
            ]
        )
        == 0
    )
    parquet_cfg.write_text(csv_cfg.read_text().replace('format = "csv"', 'format = "parquet"'))
    capsys.readouterr()
    for cfg, data, says in [
        (
            csv_cfg,
            "t.parquet",
            "is Parquet (PAR1 magic), but the schema's format is 'csv'; "
            'set format = "parquet" in the config',
        ),
        (parquet_cfg, "t.csv", 'the file is a text file (CSV or TSV); set format = "csv"'),
    ]:
        path = str(table_files / data)
        assert (
            dlrm(
                [
                    "train",
                    "--config",
                    str(cfg),
                    "--train",
                    path,
                    "--test",
                    path,
                    "--out",
                    str(tmp_path / "o"),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert says in err and "PAR1\\x" not in err and "\x00" not in err, err
    assert (
        dlrm(
            [
                "data",
                "schema",
                str(table_files / "t.parquet"),
                "--format",
                "csv",
                "--label",
                "click",
                "--out",
                str(tmp_path / "x.toml"),
            ]
        )
        == 2
    )
    assert "set --format parquet" in capsys.readouterr().err
    (tmp_path / "noise.csv").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(DataError, match="the file is binary"):
        infer_schema([tmp_path / "noise.csv"], "click")
