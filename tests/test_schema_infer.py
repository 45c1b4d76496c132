"""Schema inference (dlrm_core/schema_inference.py, `dlrm data schema`): the decisions and their
reasons
on generated CSV, TSV and Parquet files and on the real Avazu and Criteo samples, the errors, and
a written config that loads, resolves and reads its data."""

import gzip
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dense_trainer.config import load_config, prepare_config
from dlrm_core.errors import ConfigError, DataError
from dlrm_core.formats import InputReader
from dlrm_core.schema_inference import infer_schema, looks_like_counts, table_rows
from dlrm_core.schema_sample import detect_format, looks_like_header

from .conftest import REPO, SHARED_DATA

AVAZU = SHARED_DATA / "avazu-wideresdnn" / "train.csv"
CRITEO = SHARED_DATA / "criteo-wideresdnn" / "train.txt"
ROWS = 1200  # >= 1000: enough rows for the unique-per-row (id) rule
HEADER = ["user_id", "city", "click", "tags", "visits", "price", "store", "notes", "slot"]


def table_rows_of(n: int = ROWS, seed: int = 0) -> list[list[str]]:
    """Rows of a user-style table: an id, a city, the label in the middle, '|'-separated tags,
    counts and prices with gaps, integer store codes far from 0, an empty column, a 3-value slot."""
    rng = np.random.default_rng(seed)
    cities = ["paris", "lyon", "nice", "lille", "brest"]
    tags = [f"t{i}" for i in range(12)]
    rows = []
    for i in range(n):
        bag = rng.choice(tags, size=rng.integers(0, 4), replace=False)
        visits = "" if rng.random() < 0.2 else str(int(rng.geometric(0.3)) - 1)
        # unique, yet a number, not an id
        price = "" if rng.random() < 0.1 else f"{rng.normal(20, 5):.4f}"
        rows.append(
            [
                f"u{i:05d}",
                str(rng.choice(cities)),
                str(int(rng.random() < 0.3)),
                "|".join(bag),
                visits,
                price,
                str(int(rng.integers(5000, 5040))),
                "",
                str(rng.choice([0, 2, 7])),
            ]
        )
    return rows


def write_csv(path, rows, header=HEADER, delimiter=","):
    lines = ([delimiter.join(header)] if header else []) + [delimiter.join(r) for r in rows]
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.fixture
def table_csv(tmp_path):
    return write_csv(tmp_path / "train.csv", table_rows_of())


def kinds(schema):
    return {d.column: d.kind for d in schema.decisions}


def features(schema):
    return {f["name"]: f for f in schema.config()["features"]}


def read_all(config_path, files):
    """Every row of ``files`` through the trainer's reader with the written config: (rows, bad)."""
    cfg = prepare_config(load_config(config_path), files)
    reader = InputReader(cfg.feature_spec(), files)
    reader.check()
    rows = bad = 0
    for i in range(len(files)):
        for block in reader.blocks(i, 1 << 16):
            parsed = reader.parse(block)
            rows, bad = rows + parsed.num_rows, bad + len(parsed.bad)
    return rows, bad


def test_generated_csv_decisions(table_csv):
    schema = infer_schema([table_csv], "click")
    assert kinds(schema) == {
        "user_id": "ignored",
        "city": "categorical",
        "click": "label",
        "tags": "categorical",
        "visits": "dense",
        "price": "dense",
        "store": "categorical",
        "notes": "ignored",
        "slot": "categorical",
    }
    why = {d.column: d.why for d in schema.decisions}
    assert why["user_id"].startswith("unique per row") and why["notes"] == "always empty"
    assert "codes" in why["store"] and "counts" in why["visits"]
    f = features(schema)
    assert f["tags"]["separator"] == "|" and f["tags"]["encoding"] == "string"
    assert f["visits"]["transform"] == "log1p" and f["price"]["transform"] == "standardize"
    # 5x distinct, rounded up
    assert f["city"]["rows"] == 50 and f["slot"]["rows"] == 20 and f["store"]["rows"] == 200
    assert f["tags"]["rows"] == 100  # 12 distinct tags
    assert all("column" not in feat for feat in f.values())  # names are the header's
    doc = schema.config()
    assert (doc["format"], doc["label"], doc["ignore"]) == ("csv", "click", ["user_id", "notes"])
    assert "header" not in doc  # csv's default


def test_written_config_loads_resolves_and_reads_the_data(table_csv, tmp_path):
    schema = infer_schema([table_csv], "click")
    out = tmp_path / "schema.toml"
    out.write_text(schema.to_toml("dlrm data schema train.csv --label click --out schema.toml"))
    text = out.read_text()
    assert text.startswith("# Written by `dlrm data schema train.csv --label click")
    assert f"from all {ROWS:,} rows of {table_csv}" in text and "[[features]]" in text
    spec = load_config(out).feature_spec()
    assert spec.format == "csv" and spec.label == "click" and spec.header
    assert spec.dense_names == ["visits", "price"]
    assert spec.sparse_names == ["city", "tags", "store", "slot"]
    assert {t.name: t.rows for t in spec.tables}["tags"] == 100
    assert read_all(out, [table_csv]) == (ROWS, 0)


def test_gzip_and_headerless_tsv(tmp_path):
    rows = table_rows_of(300)
    gz = infer_schema([write_csv(tmp_path / "train.csv.gz", rows)], "click")
    assert kinds(gz) == kinds(infer_schema([write_csv(tmp_path / "plain.csv", rows)], "click"))
    tsv = write_csv(tmp_path / "data.txt", rows, header=None, delimiter="\t")
    schema = infer_schema([tsv], "2")
    doc = schema.config()
    assert (doc["format"], doc["label"], doc["header"]) == ("tsv", 2, False)
    f = features(schema)
    assert f["c3"] == {
        "kind": "categorical",
        "name": "c3",
        "column": 3,
        "encoding": "string",
        "rows": 100,
        "separator": "|",
    }
    assert f["c4"]["transform"] == "log1p" and 7 in doc["ignore"]
    out = tmp_path / "tsv.toml"
    out.write_text(schema.to_toml("test"))
    assert read_all(out, [tsv]) == (300, 0)


def test_sample_spans_files_and_a_test_file_without_header(tmp_path):
    rows = table_rows_of(100)
    train = write_csv(tmp_path / "train.csv", rows[:60])
    test = write_csv(tmp_path / "test.csv", rows[60:], header=None)
    schema = infer_schema([train, test], "click", sample_rows=80)
    assert schema.sample.counts == [60, 20] and schema.sample.headers == [True, False]
    assert schema.sample.truncated and "the first 80 rows" in schema.markdown()


def test_overrides(table_csv):
    schema = infer_schema(
        [table_csv], "click", ignore=["city"], categorical=["user_id", "visits"], dense=["slot"]
    )
    k, why = kinds(schema), {d.column: d.why for d in schema.decisions}
    assert (k["city"], k["user_id"], k["visits"], k["slot"]) == (
        "ignored",
        "categorical",
        "categorical",
        "dense",
    )
    assert why["user_id"] == "forced by --categorical" and why["slot"] == "forced by --dense"
    assert features(schema)["user_id"]["rows"] == 1_000_000  # every value new: the cap
    capped = infer_schema([table_csv], "click", categorical=["user_id"], max_rows=5000)
    assert features(capped)["user_id"]["rows"] == 5000
    with pytest.raises(
        DataError, match=r"column 'city' is not numeric \(e.g. '\w+'\): it cannot be --dense"
    ):
        infer_schema([table_csv], "click", dense=["city"])
    with pytest.raises(ConfigError, match="given to both --ignore and --dense"):
        infer_schema([table_csv], "click", ignore=["price"], dense=["price"])


def test_unknown_column_suggests_a_name(table_csv):
    with pytest.raises(DataError, match=r"train.csv: no column 'clik' \(did you mean 'click'\?\)"):
        infer_schema([table_csv], "clik")
    with pytest.raises(
        DataError, match=r"no column 'prise' \(did you mean 'price'\?\); --dense takes one of"
    ):
        infer_schema([table_csv], "click", dense=["prise"])


def test_label_not_0_1_names_file_line_and_value(tmp_path):
    rows = table_rows_of(20)
    rows[4][2] = "2"  # data row 5: line 7 below the header and one malformed line
    path = tmp_path / "bad.csv"
    lines = [",".join(HEADER), "only,three,fields"] + [",".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad.csv:7: the label 'click' is '2', not 0 or 1"):
        infer_schema([path], "click")


def test_parquet_lists_ints_floats(tmp_path):
    rng = np.random.default_rng(1)
    n = 500
    tags = [
        [f"t{j}" for j in rng.choice(8, size=rng.integers(0, 3), replace=False)] for _ in range(n)
    ]
    table = pa.table(
        {
            "item": pa.array(rng.integers(100_000, 100_050, n), pa.int64()),
            "label": pa.array(rng.random(n) < 0.2),
            "tags": pa.array(tags, pa.list_(pa.string())),
            "score": pa.array(rng.lognormal(0, 1.5, n), pa.float64()),
            "country": pa.array(rng.choice(["fr", "de", None], n), pa.string()),
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path, row_group_size=128)
    schema = infer_schema([path], "label")
    assert kinds(schema) == {
        "item": "categorical",
        "label": "label",
        "tags": "categorical",
        "score": "dense",
        "country": "categorical",
    }
    f = features(schema)
    # a list column is multi-hot as it is
    assert "separator" not in f["tags"] and f["tags"]["rows"] == 50
    assert f["score"]["transform"] == "log1p" and f["item"]["rows"] == 500
    assert "missing_flag" not in f["score"]  # no gaps: no flag
    assert schema.config()["format"] == "parquet" and "header" not in schema.config()
    assert {d.column: d.details for d in schema.decisions}["tags"] == "string, 50 rows, lists"
    out = tmp_path / "pq.toml"
    out.write_text(schema.to_toml("test"))
    assert read_all(out, [path]) == (n, 0)
    with pytest.raises(DataError, match="column 'score' is double, which cannot be categorical"):
        infer_schema([path], "label", categorical=["score"])


@pytest.mark.skipif(not AVAZU.exists(), reason="the Avazu sample is not in shared/data")
def test_avazu_sample_is_all_categorical():
    schema = infer_schema([AVAZU], "click")
    k = kinds(schema)
    assert (k.pop("id"), k.pop("click")) == ("ignored", "label")
    assert len(k) == 22 and set(k.values()) == {"categorical"}
    assert schema.config()["ignore"] == ["id"]


@pytest.mark.skipif(not CRITEO.exists(), reason="the Criteo sample is not in shared/data")
def test_criteo_sample_counts_and_categoricals():
    schema = infer_schema([CRITEO], "0")
    assert schema.sample.format == "criteo" and schema.config()["label"] == 0
    k = [d.kind for d in schema.decisions]
    assert k == ["label"] + ["dense"] * 13 + ["categorical"] * 26
    assert features(schema)["c5"] == {
        "kind": "dense",
        "name": "c5",
        "column": 5,
        "transform": "log1p",
    }
    flagged = infer_schema([CRITEO], "0", missing_flags=True)
    assert features(flagged)["c5"]["missing_flag"] is True  # c5 has gaps


def test_table_rows():
    assert table_rows(3, 100, 10**6) == 20 and table_rows(361, 8999, 10**6) == 2000
    assert table_rows(7000, 9000, 10**6) == 50_000 and table_rows(7000, 9000, 5000) == 5000
    assert table_rows(50, 50, 10**6) == 10**6 and table_rows(1, 1, 10**6) == 5


def test_header_format_and_counts_heuristics():
    assert looks_like_header(["id", "click", "site"], [["1", "0", "a"], ["2", "1", "b"]])
    assert not looks_like_header(["1", "0", "a"], [["2", "1", "b"]])
    # a "name" recurring as a value
    assert not looks_like_header(["a", "b"], [["a", "c"], ["a", "d"]])
    assert [
        detect_format(Path(p)) for p in ("a.csv.gz", "b.pq", "c.txt", "d.tsv.gz", "e.parquet")
    ] == ["csv", "parquet", "tsv", "tsv", "parquet"]
    rng = np.random.default_rng(2)
    counts = rng.geometric(0.4, 5000) - 1.0
    daily = 1.1 + np.sin(2 * np.pi * (np.arange(24) - 9) / 24)
    hours = rng.choice(24, 5000, p=daily / daily.sum()).astype(float)
    assert looks_like_counts(counts, len(np.unique(counts))) and not looks_like_counts(hours, 24)
    codes = np.repeat([0.0, 1, 2, 3, 4], [70, 1, 12, 19, 30])  # frequencies that do not fall: codes
    assert not looks_like_counts(codes, 5)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "dlrm_cli.py", "data", "schema", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_prints_the_table_and_writes_a_config(table_csv, tmp_path):
    out = tmp_path / "cfg.toml"
    proc = run_cli(
        table_csv, "--label", "click", "--ignore", "city", "--dense", "slot", "--out", out
    )
    assert proc.returncode == 0, proc.stderr
    assert "| column | kind | details | why |" in proc.stdout
    assert "| tags | categorical | string, 100 rows, separator '\\|' | multi-hot:" in proc.stdout
    assert "| city | ignored |  | forced by --ignore |" in proc.stdout
    assert f"wrote {out}" in proc.stdout
    assert "--ignore city --dense slot --out" in out.read_text().splitlines()[0]
    assert load_config(out).feature_spec().dense_names == ["visits", "price", "slot"]


def test_cli_bad_label_is_one_line_exit_2(table_csv, tmp_path):
    proc = run_cli(table_csv, "--label", "clik", "--out", tmp_path / "cfg.toml")
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "no column 'clik' (did you mean 'click'?)" in errors[0]
    assert not (tmp_path / "cfg.toml").exists()
