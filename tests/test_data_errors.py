"""Bad input on your own data ends `dlrm train` with one line naming file, line or column (exit
2)."""

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
HEADER = "id,user,click,price,tags\n"
ROWS = "".join(f"{i},u{i % 7},{i % 2},{i * 0.5},a|b{i % 3}\n" for i in range(60))
SCHEMA = """format = "csv"
label = "click"
ignore = ["id"]
[embedding]
dim = 4
hash_size = 100
[[features]]
name = "user"
kind = "categorical"
[[features]]
name = "price"
kind = "dense"
transform = "standardize"
[[features]]
name = "tags"
kind = "categorical"
separator = "|"
"""


def train(tmp_path, schema=SCHEMA, data=HEADER + ROWS, name="d.csv", extra=()):
    cfg = tmp_path / "schema.toml"
    cfg.write_text(schema)
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data)
    return path, subprocess.run(
        [
            *DLRM,
            "train",
            "--config",
            cfg,
            "--train",
            path,
            "--test",
            path,
            "--out",
            tmp_path / "o",
            "--no-progress",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in errors[0], errors[0]


def test_the_schema_trains(tmp_path):
    _, proc = train(tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_unknown_column_is_named_with_a_suggestion(tmp_path):
    path, proc = train(tmp_path, SCHEMA.replace('name = "user"', 'name = "usr"'))
    one_line_error(proc, str(path), "no column 'usr'", "did you mean 'user'?")


def test_a_header_without_a_configured_column(tmp_path):
    path, proc = train(tmp_path, data=HEADER.replace(",tags", ",labels") + ROWS)
    one_line_error(proc, str(path), "no column 'tags'")


def test_a_label_that_is_not_0_or_1(tmp_path):
    path, proc = train(
        tmp_path,
        SCHEMA.replace('label = "click"', 'label = "price"').replace(
            'name = "price"\nkind = "dense"', 'name = "p"\ncolumn = "click"\nkind = "dense"'
        ),
    )
    one_line_error(proc, f"{path}:3", "label is not 0 or 1")


def test_a_schema_typo_gets_did_you_mean(tmp_path):
    _, proc = train(tmp_path, SCHEMA.replace('separator = "|"', 'seperator = "|"'))
    one_line_error(proc, "features.2.seperator", "unknown setting", "did you mean 'separator'?")


def test_a_parquet_column_of_the_wrong_type(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.table(
            {
                "id": list(range(40)),
                "user": [0.5] * 40,
                "click": [i % 2 for i in range(40)],
                "price": [1.0] * 40,
                "tags": [["a"]] * 40,
            }
        ),
        path,
    )
    _, proc = train(
        tmp_path,
        SCHEMA.replace('format = "csv"', 'format = "parquet"'),
        data=None,
        name="d.parquet",
    )
    one_line_error(proc, str(path), "column 'user'", "categorical feature 'user'")
