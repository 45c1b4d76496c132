"""The generic planted-teacher table (dense_trainer/data/synth_table.py): files, gaps, quoting,
and the same featurised rows from CSV, TSV and Parquet through InputReader."""

import argparse
import json

import numpy as np
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from dense_trainer.config import load_config, prepare_config
from dense_trainer.data.cli import add_data_parser
from dense_trainer.data.synth_table import COLUMNS, ODD_TAGS, synthesize_table
from dlrm_core.formats import InputReader

TRAIN, TEST, SEED = 3000, 1000, 5


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """The same seed written as csv, tsv and parquet: {format: directory}."""
    root = tmp_path_factory.mktemp("synth_table")
    for fmt in ("csv", "tsv", "parquet"):
        synthesize_table(root / fmt, TRAIN, TEST, seed=SEED, format=fmt)
    return {fmt: root / fmt for fmt in ("csv", "tsv", "parquet")}


def read_table(out, fmt, split="train"):
    path = out / f"{split}.{fmt}"
    if fmt == "parquet":
        return pq.read_table(path)
    return pcsv.read_csv(
        path, parse_options=pcsv.ParseOptions(delimiter="," if fmt == "csv" else "\t")
    )


def reader(out, fmt, split="train"):
    spec = load_config(out / "schema.toml").feature_spec()
    r = InputReader(spec, [out / f"{split}.{fmt}"])
    r.check()
    return r


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet"])
def test_files_rows_and_label_in_the_middle(tables, fmt):
    out = tables[fmt]
    assert {p.name for p in out.iterdir()} == {
        f"train.{fmt}",
        f"test.{fmt}",
        "bayes.json",
        "schema.toml",
    }
    train, test = read_table(out, fmt), read_table(out, fmt, "test")
    assert (train.num_rows, test.num_rows) == (TRAIN, TEST)
    assert train.column_names == COLUMNS
    assert 0 < COLUMNS.index("click") < len(COLUMNS) - 1
    ids = np.concatenate([train.column("row_id").to_numpy(), test.column("row_id").to_numpy()])
    assert len(np.unique(ids)) == TRAIN + TEST
    bayes = json.loads((out / "bayes.json").read_text())
    assert {
        "test_auc",
        "test_logloss",
        "test_ctr",
        "train_rows",
        "test_rows",
        "seed",
        "note",
    } <= set(bayes)
    assert (bayes["train_rows"], bayes["test_rows"], bayes["seed"]) == (TRAIN, TEST, SEED)


def test_gaps_and_multi_hot(tables):
    t = read_table(tables["parquet"], "parquet")
    n = t.num_rows
    assert 0.10 < t.column("price").null_count / n < 0.20
    assert 0.15 < t.column("clicks_7d").null_count / n < 0.25
    assert t.column("score").null_count == 0 and t.column("user").null_count == 0
    bags = t.column("tags").to_pylist()
    sizes = np.array([len(b) for b in bags])
    assert sizes.max() == 4 and (sizes == 0).any() and (sizes >= 2).any()
    assert all(len(set(b)) == len(b) for b in bags)  # distinct tags in a bag
    assert (t.column("clicks_7d").to_numpy(zero_copy_only=False) >= 0)[
        ~np.isnan(t.column("clicks_7d").to_numpy(zero_copy_only=False))
    ].all()
    assert len(set(t.column("device").to_pylist())) <= 30
    hours = t.column("hour").to_numpy()
    assert hours.min() >= 0 and hours.max() <= 23
    assert t.column("user").to_pylist()[0].startswith("u")
    # The CSV text: empty cells, |-joined bags, quoted cells with a comma or a doubled quote.
    text = (tables["csv"] / "train.csv").read_text()
    assert ",," in text and "|" in text
    assert any(f'"{tag}' in text or f"|{tag}" in text for tag in ("food, drink", "home, garden"))
    assert '24"" screens' in text


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet"])
def test_every_block_parses(tables, fmt):
    r = reader(tables[fmt], fmt)
    blocks = [r.parse(b) for b in r.blocks(0, 1 << 14)]  # small blocks: many boundaries
    assert len(blocks) >= 3
    assert sum(len(b.bad) for b in blocks) == 0
    assert sum(b.num_rows for b in blocks) == TRAIN
    labels = np.concatenate([b.labels for b in blocks])
    assert 0.1 < labels.mean() < 0.3


def test_formats_featurise_identically(tables):
    got = {}
    for fmt, out in tables.items():
        r = reader(out, fmt)
        (block,) = [r.parse(b) for b in r.blocks(0, 1 << 24)]
        got[fmt] = (block.labels, *block.model_inputs())
    csv = got["csv"]
    dense, ids, offsets = csv[1:]
    assert dense.shape == (TRAIN, 3) and offsets.size == 5 * TRAIN + 1
    assert np.isnan(dense).sum() == 0 and ids.min() >= 0
    for fmt in ("tsv", "parquet"):
        for a, b in zip(csv, got[fmt], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=fmt)


def test_odd_tags_hash_like_parquet(tables):
    """A quoted tag ("food, drink") is one value, hashed as it is written in Parquet."""
    r = reader(tables["csv"], "csv")
    (block,) = [r.parse(b) for b in r.blocks(0, 1 << 24)]
    tags = r.spec.sparse_names.index("tags")
    lengths = block.lengths[tags]
    bags = read_table(tables["parquet"], "parquet").column("tags").to_pylist()
    np.testing.assert_array_equal(lengths, [len(b) for b in bags])
    assert any(ODD_TAGS[0] in b for b in bags) and any(ODD_TAGS[9] in b for b in bags)


def test_schema_config_trains_as_written(tables):
    out = tables["csv"]
    cfg = prepare_config(load_config(out / "schema.toml"), [out / "train.csv"])
    spec = cfg.feature_spec()
    assert spec.label == "click" and spec.ignore == ["row_id"] and spec.columns == COLUMNS
    score = next(f for f in spec.dense if f.name == "score")
    assert abs(score.mean - 50) < 2 and abs(score.std - 12) < 2  # measured from the file


def test_bayes_auc_is_sane(tmp_path):
    bayes = synthesize_table(tmp_path, 2000, 20_000, seed=0, format="parquet")
    assert 0.7 < bayes["test_auc"] < 0.95
    assert 0.17 < bayes["test_ctr"] < 0.23


def test_deterministic_per_seed(tmp_path, tables):
    synthesize_table(tmp_path / "again", TRAIN, TEST, seed=SEED, format="csv")
    synthesize_table(tmp_path / "other", TRAIN, TEST, seed=SEED + 1, format="csv")
    ref = (tables["csv"] / "train.csv").read_bytes()
    assert (tmp_path / "again" / "train.csv").read_bytes() == ref
    assert (tmp_path / "other" / "train.csv").read_bytes() != ref
    assert (tmp_path / "again" / "bayes.json").read_text() == (
        tables["csv"] / "bayes.json"
    ).read_text()


def test_cli_format_flag(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_data_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(
        [
            "data",
            "synth",
            "--format",
            "tsv",
            "--train-rows",
            "500",
            "--test-rows",
            "200",
            "--out",
            str(tmp_path),
            "--seed",
            "1",
        ]
    )
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "tsv"
    assert (tmp_path / "train.tsv").exists() and (tmp_path / "schema.toml").exists()
