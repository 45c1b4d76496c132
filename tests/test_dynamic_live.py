"""Live updates of dynamic tables: each push carries the ids admitted and evicted with the rows;
a slot freed from one id and given to another never serves the old id the new id's row (even on
a replica whose map lags); after a training run with churning ids, a replica that followed the
updates serves exactly what offline evaluation of the final model computes (file and Redis
stores, one process and two embedding servers, whole tables and tables split by rows)."""

import json
import time
import uuid

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from api.app import create_app
from api.lookup import embed
from api.metrics import ServingMetrics
from api.service import ModelService
from api.settings import Settings
from dense_trainer.data.loader import BatchLoader
from dense_trainer.live import LivePublisher
from dense_trainer.train import Trainer
from embedding_server.checkpoint.files import latest_checkpoint
from embedding_server.idmap.dynamic import shared_rows_of
from embedding_server.idmap.view import NO_OWNER, IdMapDelta, IdMapView
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

from .conftest import tiny_config

CHURN = {
    "ids": "dynamic",
    "hash_size": 300,
    "admit_after": 2,
    "tables": [{"name": "C2", "ids": "hashed"}],
}
"""300-row tables against vocabularies of thousands: ids are admitted and evicted all run long."""


def store_url(backend: str, tmp_path, request) -> str:
    if backend == "redis":
        return f"{request.getfixturevalue('redis_server').url}?prefix=dynlive{uuid.uuid4().hex[:6]}"
    return f"file://{tmp_path / 'store'}"


def test_id_map_view_overlay_and_folding():
    view = IdMapView(np.array([10, 20, 30]), np.array([5, 6, 7]))
    view.apply(IdMapDelta(np.array([20, 40]), np.array([-1, 6]), np.array([6]), np.array([40])))
    np.testing.assert_array_equal(view.lookup(np.array([10, 20, 30, 40, 50])), [5, -1, 7, 6, -1])
    later = IdMapDelta(np.array([20]), np.array([9]), np.array([9]), np.array([20]))
    merged = IdMapDelta(np.array([20, 40]), np.array([-1, 6]), np.array([6]), np.array([40])).then(
        later
    )
    np.testing.assert_array_equal(merged.rows, [9, 6])  # the later change wins
    assert IdMapDelta.from_bytes(merged.to_bytes()).ids.tolist() == [20, 40]
    for i in range(2000):  # past compact_at(3) the overlay is folded into the base
        view.apply(
            IdMapDelta(
                np.array([1000 + i]),
                np.array([i % 300]),
                np.zeros(0, np.int64),
                np.zeros(0, np.int64),
            )
        )
    assert view.overlay_entries < 2000
    ids, rows = view.items()
    assert len(ids) == 3 + 2000 and rows[np.searchsorted(ids, 40)] == 6


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_reused_slot_never_serves_the_old_id(backend, synth_small, tmp_path, request):
    """Slot s held id X; a push frees it and gives it to Y with Y's row. A replica that has not
    read the push yet still maps X to s: X must get its own row or its shared row, never Y's;
    once the replica follows the push, X reads its shared row and Y the new row."""
    url = store_url(backend, tmp_path, request)
    trainer = Trainer(
        tiny_config(embedding={"ids": "dynamic", "hash_size": 500, "admit_after": 1}),
        tmp_path / "run",
    )
    for batch in BatchLoader([synth_small / "train.txt"], trainer.spec, 256, max_rows=256 * 4):
        trainer.train_step(batch)
    store = open_store(url)
    version = LivePublisher(trainer, store, push_every_s=3600).start()
    service = ModelService(store, Settings(store=url, poll_interval_s=3600), ServingMetrics())
    service.refresh()
    model = service.model
    spec = model.spec
    f = next(i for i, t in enumerate(spec.feature_tables) if spec.tables[t].name == "C1")
    table = spec.tables[spec.feature_tables[f]]
    ids, rows = store.read_id_map(version, "C1")
    x, s = int(ids[0]), int(rows[0])
    y = int(ids.max()) + 12345

    def embedding(raw_id: int) -> np.ndarray:
        values = np.zeros(len(spec.feature_tables), dtype=np.int64)
        values[f] = raw_id
        out = embed(store, service.metrics, service.model, values, np.arange(len(values) + 1), 1)
        lo, hi = service.model.columns[f], service.model.columns[f + 1]
        return out[0, lo:hi].numpy()

    def stored(row: int) -> np.ndarray:
        return store.get_rows(version, "C1", np.array([row]))[0][0]

    def shared(raw_id: int) -> np.ndarray:
        return stored(int(shared_rows_of(torch.tensor([raw_id]), table.shared_row_count)[0]))

    x_row = stored(s)
    np.testing.assert_array_equal(embedding(x), x_row)  # (now cached on Redis, tagged with x)
    y_row = np.full(table.dim, 7.5, dtype=np.float32)
    delta = IdMapDelta(
        np.array(sorted([x, y])),
        np.where(np.array(sorted([x, y])) == x, -1, s),
        np.array([s]),
        np.array([y]),
    )
    store.update_rows(version, {"C1": (np.array([s]), y_row[None])}, id_maps={"C1": delta})
    np.testing.assert_array_equal(stored(s), y_row)
    assert store.read_owners(version, "C1", np.array([s])).tolist() == [y]

    # The replica has not polled: its map still says x -> s.
    assert service.model.id_maps["C1"].lookup(np.array([x])).tolist() == [s]
    lagging = embedding(x)
    assert not np.array_equal(lagging, y_row), "the old id was served the new id's row"
    assert np.array_equal(lagging, x_row) or np.array_equal(lagging, shared(x))
    if model.cache is not None:  # a cache miss of s reads y's row with its owner: x is not given it
        model.cache.invalidate("C1", np.array([s]))
        np.testing.assert_array_equal(embedding(x), shared(x))
        assert not model.cache.get("C1", np.array([s]), np.array([x]))[1].any()
    else:  # file store: the row is read from the mapping, its owner after it
        np.testing.assert_array_equal(lagging, shared(x))
    np.testing.assert_array_equal(embedding(y), shared(y))  # not in the lagging map yet

    service.refresh()  # follows the push: x evicted, y admitted at s
    assert service.model is model and model.id_maps["C1"].lookup(np.array([x, y])).tolist() == [
        -1,
        s,
    ]
    np.testing.assert_array_equal(embedding(x), shared(x))
    np.testing.assert_array_equal(embedding(y), y_row)
    reloaded = open_store(url).read_id_map(version, "C1")  # a replica loading now sees the same map
    assert x not in reloaded[0] and reloaded[1][np.searchsorted(reloaded[0], y)] == s
    assert NO_OWNER not in store.read_owners(version, "C1", np.array([s]))
    if model.cache is not None:  # s cached with y's row; a request holding the old map asks for x
        np.testing.assert_array_equal(embedding(y), y_row)
        model.id_maps["C1"] = IdMapView(ids, rows)
        np.testing.assert_array_equal(embedding(x), shared(x))


def offline_probabilities(cfg, out_dir, test_file) -> np.ndarray:
    trainer = Trainer(cfg, out_dir / "offline-eval")
    trainer.load_checkpoint(latest_checkpoint(out_dir / "checkpoints"))
    logits = [trainer.predict(b) for b in BatchLoader([test_file], trainer.spec, 4096)]
    return torch.sigmoid(torch.cat(logits)).numpy()


def caught_up(client, store, timeout_s: float = 30.0) -> dict:
    """Wait until the replica applied every live update of the store's current version."""
    service = client.app.state.service
    version = store.current_version()
    target = store.poll_updates(version, None).generation
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        model = service.model
        if model is not None and model.version == version and model.generation >= target:
            return {"model": model, "generation": target}
        time.sleep(0.1)
    raise AssertionError(f"the replica did not reach generation {target} of {version}")


def served_lines(client, test_file) -> np.ndarray:
    lines = test_file.read_text().splitlines(keepends=True)
    served = []
    for at in range(0, len(lines), 2500):  # requests of at most 4096 lines
        r = client.post(
            "/v1/models/dlrm:predict_tsv",
            content="".join(lines[at : at + 2500]),
            headers={"content-type": "text/plain"},
        )
        assert r.status_code == 200, r.text
        served += r.json()["predictions"]
    return np.array(served)


def served_equals_offline(url: str, client, data, run_dir, cfg) -> None:
    """The replica that followed the live updates serves what the final checkpoint computes:
    offline evaluation in one process, or, for tables split by rows over servers (which one
    process does not load), the checkpoint published and served afresh."""
    store = open_store(url)
    state = caught_up(client, store)
    model = state["model"]
    assert state["generation"] >= 3  # pushes happened during the run, the replica followed them
    served = served_lines(client, data / "test.txt")
    if cfg.dist.sharding == "row_wise":
        fresh = f"file://{run_dir / 'published'}"
        publish_checkpoint(run_dir, open_store(fresh), version="final")
        with TestClient(create_app(Settings(store=fresh))) as other:
            expected = served_lines(other, data / "test.txt")
    else:
        expected = offline_probabilities(cfg, run_dir, data / "test.txt")
    np.testing.assert_allclose(served, expected, atol=1e-5)
    metrics = client.get("/metrics").text
    assert (
        'dlrm_model_reloads_total{reason="lost"}' not in metrics
        or 'dlrm_model_reloads_total{reason="lost"} 0.0' in metrics
    )
    for name, view in model.id_maps.items():  # the followed map is the stored one
        ids, rows = store.read_id_map(model.version, name)
        got_ids, got_rows = view.items()
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_rows, rows)


@pytest.mark.slow
def test_live_training_with_churning_ids_serves_the_final_model(synth_small, tmp_path, request):
    """One process pushing to the file store (the distributed test below pushes to Redis: the two
    runs together cover both stores and both trainers)."""
    url = store_url("file", tmp_path, request)
    cfg = tiny_config(
        embedding=CHURN,
        train={"batch_size": 128},
        live={"store": url, "push_every_s": 0.1, "dense_every_s": 0.5},
    )
    trainer = Trainer(cfg, tmp_path / "run")
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.05))) as client:
        trainer.fit([synth_small / "train.txt"], [synth_small / "test.txt"])
        live = json.loads((tmp_path / "run" / "metrics.json").read_text())["live_updates"]
        assert (
            live["version"] == trainer.live.version
            and live["failures"] == 0
            and live["pushes"] >= 3
        )
        assert live["id_map_changes"] > 0 and live["rows_pushed"] > 0
        assert live["overlay_compactions"] > 0  # overlays were folded into their base meanwhile
        stats = trainer.client.id_stats()
        assert stats["C1"]["evicted"] > 0 and stats["C1"]["admitted"] > stats["C1"]["evicted"]
        served_equals_offline(url, client, synth_small, tmp_path / "run", cfg)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_distributed_live_training_with_churning_ids_serves_the_final_model(
    synth_small, tmp_path, request, sharding
):
    """Two embedding servers pushing to Redis: whole tables, or every table split by rows (each
    server pushing its pieces' map changes in global rows)."""
    from dense_trainer.distributed import launch_local

    url = store_url("redis", tmp_path, request)
    cfg = tiny_config(
        embedding=CHURN,
        train={"batch_size": 128},
        live={"store": url, "push_every_s": 0.1, "dense_every_s": 0.5},
        dist={"embedding_servers": 2, "trainers": 1, "sharding": sharding},
    )
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.05))) as client:
        launch_local(
            cfg,
            [synth_small / "train.txt"],
            [synth_small / "test.txt"],
            tmp_path / "run",
            resume=False,
        )
        written = json.loads((tmp_path / "run" / "metrics.json").read_text())
        assert written["embedding_ids_evicted"]["C1"] > 0  # ids churned while the servers pushed
        live = written["live_updates"]  # the master's dense pushes and both servers' row pushes
        assert live["failures"] == 0 and live["id_map_changes"] > 0 and live["rows_pushed"] > 0
        assert live["overlay_compactions"] > 0
        served_equals_offline(url, client, synth_small, tmp_path / "run", cfg)


def test_a_redis_fold_keeps_a_push_that_raced_it_and_ignores_other_tables(
    synth_small, tmp_path, request, monkeypatch
):
    """Two writers of one table's map (a table split by rows over servers): a fold of the overlay
    that a push to it overtook is left (the push's entry stays, it wins over the base); a push to
    another table's overlay does not stop it."""
    from embedding_server.stores import redis_idmaps, redis_live

    url = store_url("redis", tmp_path, request)
    trainer = Trainer(
        tiny_config(embedding={"ids": "dynamic", "hash_size": 500, "admit_after": 1}),
        tmp_path / "run",
    )
    for batch in BatchLoader([synth_small / "train.txt"], trainer.spec, 256, max_rows=256 * 2):
        trainer.train_step(batch)
    store = open_store(url)
    version = LivePublisher(trainer, store, push_every_s=3600).start()
    ids, rows = store.read_id_map(version, "C1")
    a, s = int(ids[0]), int(rows[0])

    # raw id -> slot (an existing overlay field rewritten: HLEN unchanged)
    def move(table: str, raw: int, slot: int) -> None:
        store.update_rows(
            version,
            {},
            id_maps={
                table: IdMapDelta(
                    np.array([raw]), np.array([slot]), np.array([slot]), np.array([raw])
                )
            },
        )

    move("C1", a, s)  # the overlay holds a
    monkeypatch.setattr(redis_idmaps, "compact_at", lambda n: 0)  # fold at the first entry
    real, outcomes = store._scripts["COMPACT"], []

    def racing(push):
        pending = [push]

        def compact(**kw):
            if not pending:  # the racing push's own fold, and any later one
                return real(**kw)
            pending.pop()()
            outcomes.append(real(**kw))
            return outcomes[-1]

        return compact

    # the racing pushes fold nothing
    monkeypatch.setattr(redis_live, "compact_after_push", lambda *a: None)
    # the other writer, between read and fold
    store._scripts["COMPACT"] = racing(lambda: move("C1", a, s + 1))
    redis_idmaps.maybe_compact(store, version, "C1")
    assert outcomes == [0]
    got_ids, got_rows = store.read_id_map(version, "C1")
    assert got_rows[np.searchsorted(got_ids, a)] == s + 1  # the racing push stands
    c3 = store.read_id_map(version, "C3")
    # another table's push
    store._scripts["COMPACT"] = racing(lambda: move("C3", int(c3[0][0]), int(c3[1][0])))
    redis_idmaps.maybe_compact(store, version, "C1")
    assert outcomes == [0, 1]
    got_ids, got_rows = store.read_id_map(version, "C1")
    assert got_rows[np.searchsorted(got_ids, a)] == s + 1
    # folded into the base
    assert not store.bulk.hlen(redis_idmaps.overlay_key(store, version, "C1"))
