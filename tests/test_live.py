"""Live updates: rows a running trainer changes reach predictions within seconds, no restart."""

import time
import uuid

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from dense_trainer.data.loader import BatchLoader
from dense_trainer.live import LivePublisher
from dense_trainer.train import Trainer
from embedding_server.stores import open_store

from .conftest import tiny_config

pytestmark = pytest.mark.slow


def test_row_updates_visible_in_predictions_within_5s(redis_server, synth_small, tmp_path):
    url = f"{redis_server.url}?prefix=live{uuid.uuid4().hex[:6]}"
    trainer = Trainer(tiny_config(), tmp_path / "run")
    live = LivePublisher(trainer, open_store(url), push_every_s=0.5, dense_every_s=3600)
    version = live.start()
    batches = list(BatchLoader([synth_small / "train.txt"], trainer.spec, 256, max_rows=256 * 40))
    line = (synth_small / "train.txt").open().readline()  # the first row of batches[0]

    def predict(client):
        r = client.post("/v1/models/dlrm:predict_tsv", content=line)
        assert r.status_code == 200, r.text
        return r.json()

    with TestClient(create_app(Settings(store=url, poll_interval_s=0.1))) as client:
        before = predict(client)
        assert before["model_version"] == version
        assert predict(client) == before  # stable while nothing trains (and now cached)
        t_step = time.time()
        visible = None
        for i, batch in enumerate(batches):  # noqa: B007 (i is reported below)
            trainer.train_step(batch)
            live.after_step(batch.sparse)
            now = predict(client)
            if now["predictions"] != before["predictions"]:
                visible = time.time()
                break
            time.sleep(0.05)
        live.close()
    assert visible is not None, "the update never became visible"
    latency = visible - t_step
    print(f"live update visible {latency:.2f}s after the optimizer step ({i + 1} steps)")
    assert latency < 5.0
    assert now["model_version"] == version  # the same version, updated in place
    assert live.failures == 0 and live.rows_pushed > 0


def test_dlrm_train_with_live_store_publishes_and_pushes(redis_server, synth_small, tmp_path):
    url = f"{redis_server.url}?prefix=livecli{uuid.uuid4().hex[:6]}"
    cfg = tiny_config(live={"store": url, "push_every_s": 0.2, "dense_every_s": 0.5})
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.fit([synth_small / "train.txt"], [synth_small / "test.txt"])
    store = open_store(url)
    version = store.current_version()
    assert version and version.startswith("live-")
    assert trainer.live.pushes >= 2 and trainer.live.failures == 0
    # After close() the store holds the final rows: they equal the trainer's tables.
    import numpy as np

    weights = trainer.client.export_state()["C1.weight"]
    rows, present = store.get_rows(version, "C1", np.arange(50))
    assert present.all()
    np.testing.assert_array_equal(rows, weights[:50].numpy())


def test_distributed_training_pushes_live_updates_from_the_servers(
    redis_server, synth_small, tmp_path
):
    import numpy as np
    import torch

    from dense_trainer.distributed import launch_local
    from embedding_server.checkpoint.files import latest_checkpoint, load_file
    from embedding_server.checkpoint.tables import CheckpointTables

    url = f"{redis_server.url}?prefix=livedist{uuid.uuid4().hex[:6]}"
    cfg = tiny_config(
        live={"store": url, "push_every_s": 0.2, "dense_every_s": 0.5},
        dist={"embedding_servers": 2, "trainers": 2, "sharding": "row_wise"},
    )
    launch_local(
        cfg, [synth_small / "train.txt"], [synth_small / "test.txt"], tmp_path / "run", resume=False
    )
    store = open_store(url)
    version = store.current_version()
    assert version.startswith("live-")
    updates = store.client.xlen(store.key("v", version, "updates"))
    assert updates >= 4  # both servers pushed rows during training, the master dense weights
    final = latest_checkpoint(tmp_path / "run" / "checkpoints")
    tables = CheckpointTables(final)
    for name in ["C1", "C10", "C26"]:  # the store ends with the final rows of every piece
        rows, present = store.get_rows(version, name, np.arange(20_000))
        assert present.all()
        np.testing.assert_array_equal(rows, tables.read(name, "weight", 0, 20_000).numpy())
    dense = load_file(final, "dense.pt")
    served = store.read_dense(version)
    assert all(torch.equal(served[k], v) for k, v in dense.items())
