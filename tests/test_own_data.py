"""Bring your own data: a declared schema on CSV / Parquet, trained, distributed, served.

The data is the generic planted-teacher table (dense_trainer/data/synth_table.py): a label in the
middle, an ignored id column, string and integer categoricals, a `|`-separated multi-hot column,
numeric columns with gaps.
"""

import csv
import json
import uuid

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from dense_trainer.config import load_config
from dense_trainer.data.synth_table import synthesize_table
from dense_trainer.distributed import launch_local
from dense_trainer.metrics import roc_auc
from dense_trainer.train import Trainer
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

from .conftest import REPO

TINY = {
    "embedding": {"dim": 8, "hash_size": 20000},
    "model": {"dense_arch_layer_sizes": [32, 16], "over_arch_layer_sizes": [32, 16]},
    "train": {
        "batch_size": 256,
        "progress": False,
        "eval_every_steps": 0,
        "checkpoint_every_steps": 0,
        "validation": 0.0,  # every row trained on, once: the tests count them
        "epochs": 1,
    },
    "data": {"num_workers": 1},
}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("table")
    synthesize_table(out, train_rows=20_000, test_rows=4_000, seed=3, format="csv")
    return out


def table_config(d, **overrides):
    merged = json.loads(json.dumps(TINY))
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values) if isinstance(
            values, dict
        ) else merged.update({section: values})
    return load_config(d / "schema.toml", [merged])


def test_csv_schema_trains_single_process(table, tmp_path):
    metrics = Trainer(table_config(table), tmp_path / "run").fit(
        [table / "train.csv"], [table / "test.csv"]
    )
    bayes = json.loads((table / "bayes.json").read_text())["test_auc"]
    assert metrics["malformed_lines"] == 0 and metrics["samples_seen"] == 20_000
    assert 0.62 < metrics["test_auc"] < bayes


def named_instances(path, spec):
    """The test split as JSON named instances, values as a client would send them."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    instances, labels = [], []
    for row in rows:
        inst = {}
        for feat in spec.dense:
            cell = row[feat.column or feat.name]
            inst[feat.name] = float(cell) if cell else None
        for feat in spec.categorical:
            cell = row[feat.column or feat.name]
            if feat.separator:
                inst[feat.name] = [v for v in cell.split(feat.separator) if v]
            elif cell.lstrip("-").isdigit():
                inst[feat.name] = int(cell)  # an integer as JSON sends it: hashes as its spelling
            else:
                inst[feat.name] = cell or None
        instances.append(inst)
        labels.append(int(row[spec.label]))
    return instances, np.array(labels)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["file", "redis"])
def test_served_named_instances_reproduce_offline_auc(backend, table, tmp_path, request):
    run = tmp_path / "run"
    # price's gaps get an input of their own (missing_flag): trained and served alike
    schema = (table / "schema.toml").read_text()
    flagged = schema.replace('name = "price"\n', 'name = "price"\nmissing_flag = true\n')
    assert flagged != schema
    (tmp_path / "schema.toml").write_text(flagged)
    cfg = table_config(tmp_path)
    assert cfg.feature_spec().dense_width == len(cfg.feature_spec().dense) + 1
    metrics = Trainer(cfg, run).fit([table / "train.csv"], [table / "test.csv"])
    if backend == "redis":
        url = f"{request.getfixturevalue('redis_server').url}?prefix=own{uuid.uuid4().hex[:6]}"
    else:
        url = f"file://{tmp_path / 'store'}"
    meta = publish_checkpoint(run, open_store(url), version="v1")
    instances, labels = named_instances(table / "test.csv", meta.spec)
    scores = []
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        for lo in range(0, len(instances), 1000):
            r = client.post(
                "/v1/models/dlrm:predict", json={"instances": instances[lo : lo + 1000]}
            )
            assert r.status_code == 200, r.text
            scores += r.json()["predictions"]
        lines = (table / "test.csv").read_text().splitlines()[1:51]  # CSV lines, no header
        r = client.post("/v1/models/dlrm:predict_tsv", content="\n".join(lines))
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["predictions"], scores[:50], atol=1e-5)
        # The Open Inference Protocol: one BYTES / FP64 tensor per feature, multi-hot cells as the
        # file holds them (values joined by the separator): the V1 scores.
        with open(table / "test.csv", newline="") as f:
            rows = list(csv.DictReader(f))[:50]
        inputs = [
            {
                "name": feat.name,
                "shape": [50],
                "datatype": "FP64",
                "data": [
                    float(row[feat.column or feat.name]) if row[feat.column or feat.name] else None
                    for row in rows
                ],
            }
            for feat in meta.spec.dense
        ]
        inputs += [
            {
                "name": feat.name,
                "shape": [50, 1],
                "datatype": "BYTES",
                "data": [[row[feat.column or feat.name]] for row in rows],
            }
            for feat in meta.spec.categorical
        ]
        assert any(feat.separator for feat in meta.spec.categorical)
        r = client.post("/v2/models/dlrm/infer", json={"inputs": inputs})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], scores[:50], atol=1e-6)
        doc = client.get("/openapi.json").json()
        named = doc["components"]["schemas"]["NamedInstance"]["properties"]
        assert set(named) == {f.name for f in [*meta.spec.dense, *meta.spec.categorical]}
    assert abs(roc_auc(np.array(scores), labels) - metrics["test_auc"]) < 0.002


def shared(cfg):
    """The config with `user` and `ad` reading one table (features sharing a table)."""
    feats = [
        f.model_copy(update={"table": "ids", "rows": 50_000}) if f.name in ("user", "ad") else f
        for f in cfg.features
    ]
    return cfg.model_copy(update={"features": feats})


@pytest.mark.slow
def test_distributed_and_towers_match_one_process_on_a_csv_schema(table, tmp_path):
    over = {"train": {"log_step_losses": True, "max_steps": 40}}
    single = Trainer(
        shared(table_config(table, **over, data={"num_workers": 1, "interleave": 2})),
        tmp_path / "single",
    ).fit([table / "train.csv"], [table / "test.csv"])
    cfg = shared(
        table_config(
            table, **over, dist={"embedding_servers": 2, "trainers": 2, "sharding": "row_wise"}
        )
    )
    assert cfg.feature_spec().shares_tables
    dist = launch_local(
        cfg, [table / "train.csv"], [table / "test.csv"], tmp_path / "dist", resume=False
    )
    a, b = np.array(single["step_losses"]), np.array(dist["step_losses"])
    assert len(a) == len(b) == 40 and np.max(np.abs(a - b) / np.abs(a)) < 1e-4
    # Identity towers (features sharing a table together) are the flat model on any partition.
    spec = cfg.feature_spec()
    tables = {}
    for f in spec.categorical:
        tables.setdefault(f.table, []).append(f.name)
    groups = list(tables.values())
    plan = {"towers": [{"features": sum(groups[0::2], [])}, {"features": sum(groups[1::2], [])}]}
    (tmp_path / "towers.json").write_text(json.dumps(plan))
    cfg = shared(
        table_config(
            table,
            **over,
            dist={"embedding_servers": 2, "trainers": 1, "towers": str(tmp_path / "towers.json")},
        )
    )
    towers = launch_local(
        cfg, [table / "train.csv"], [table / "test.csv"], tmp_path / "towers", resume=False
    )
    c = np.array(towers["step_losses"])
    flat = shared(table_config(table, **over, model={"first_order": False}))  # as towers run
    one = Trainer(flat, tmp_path / "one").fit([table / "train.csv"], [table / "test.csv"])
    d = np.array(one["step_losses"])  # one trainer: the plain single-process batches
    assert len(c) == 40 and np.max(np.abs(d - c) / np.abs(d)) < 1e-4


def test_parquet_and_csv_train_identically(tmp_path):
    for fmt in ("csv", "parquet"):
        synthesize_table(tmp_path / fmt, train_rows=3000, test_rows=1000, seed=5, format=fmt)
    # The validation split picks the same rows of the table in either format.
    over = {"train": {"log_step_losses": True, "max_steps": 10, "validation": 0.1}}
    runs = {}
    for fmt, ext in (("csv", "csv"), ("parquet", "parquet")):
        d = tmp_path / fmt
        runs[fmt] = Trainer(table_config(d, **over), d / "run").fit(
            [d / f"train.{ext}"], [d / f"test.{ext}"]
        )
    assert runs["csv"]["step_losses"] == runs["parquet"]["step_losses"]
    assert runs["csv"]["test_auc"] == runs["parquet"]["test_auc"]
    assert runs["csv"]["valid_auc"] == runs["parquet"]["valid_auc"]


@pytest.mark.parametrize("keep", ["dense", "categorical"])
def test_a_schema_with_one_kind_of_feature_trains(keep, table, tmp_path):
    cfg = table_config(table)
    kind = "dense" if keep == "dense" else "categorical"
    features = [f for f in cfg.features if f.kind == kind]
    cfg = cfg.model_copy(update={"features": features})
    metrics = Trainer(cfg, tmp_path / keep).fit([table / "train.csv"], [table / "test.csv"])
    assert 0.58 < metrics["test_auc"] < 1 and metrics["samples_seen"] == 20_000


def test_config_in_repo_for_the_avazu_sample_loads():
    cfg = load_config(REPO / "configs" / "avazu.toml")
    spec = cfg.feature_spec()
    assert spec.format == "csv" and spec.label == "click" and "id" in spec.ignore
    assert len(spec.categorical) == 22 and not spec.dense
