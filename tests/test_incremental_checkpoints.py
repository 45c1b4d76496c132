"""Checkpoints sized by what was trained, delta chains, background writers, elastic restarts."""

import json

import pytest
import torch

from dense_trainer.data.loader import BatchLoader
from dense_trainer.train import Trainer
from embedding_server.checkpoint.files import checkpoint_chain, latest_checkpoint, read_manifest
from embedding_server.checkpoint.snapshot import TouchedRows
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.checkpoint.writer import CheckpointWriter

from .conftest import tiny_config


def tables_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.client.export_state().items() if k != "step"}


def rows_written(path) -> int:
    return sum(w.get("rows_written", 0) for w in read_manifest(path)["writers"].values())


def test_delta_chain_restores_exactly_and_holds_only_changed_rows(synth_small, tmp_path):
    cfg = tiny_config(train={"batch_size": 256, "checkpoint_every_steps": 0})
    t = Trainer(cfg, tmp_path / "run")
    batches = iter(BatchLoader([synth_small / "train.txt"], t.spec, 256, max_rows=256 * 12))

    def train(n: int) -> None:
        for _ in range(n):
            t.train_step(next(batches))
            t.state.step += 1

    train(4)
    full = t.save_checkpoint("full")
    train(4)
    d1 = t.save_checkpoint("delta")
    train(4)
    d2 = t.save_checkpoint("delta")
    manifest = read_manifest(d2)
    assert manifest["kind"] == "delta" and manifest["base"] == d1.name
    assert checkpoint_chain(d2) == [full, d1, d2]
    trained = t.client.shard.touched.count()
    # A full checkpoint writes every trained row; a delta only the rows changed since its base.
    assert rows_written(full) < trained and rows_written(d2) < trained
    allocated = sum(tb.rows for tb in t.spec.tables)
    assert manifest["writers"]["trainer-0"]["rows_allocated"] == allocated
    assert sum(f["bytes"] for f in manifest["files"].values()) < 0.2 * 4 * 9 * allocated

    # A fresh trainer restores the chain: every table and the dense state, bit for bit.
    u = Trainer(cfg, tmp_path / "run")
    u.load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert u.state.step == 12
    mine, theirs = tables_of(t), tables_of(u)
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    for key, value in t.model.state_dict().items():
        assert torch.equal(value, u.model.state_dict()[key]), key
    # ... and so does a reader with another seed's tables (untouched rows are regenerated).
    other = Trainer(tiny_config(train={"seed": 5}), tmp_path / "other")
    CheckpointTables(d2).load_into(other.client.shard)
    assert torch.equal(other.client.export_state()["C3.weight"], mine["C3.weight"])


def test_restore_verifies_only_the_pieces_it_reads(synth_small, tmp_path):
    cfg = tiny_config(train={"max_steps": 6, "batch_size": 256})
    Trainer(cfg, tmp_path / "run").fit([synth_small / "train.txt"], [synth_small / "test.txt"])
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    victim = next(p for p in ckpt.glob("embeddings.t5.*.pt"))  # table C6
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    tables = CheckpointTables(ckpt)
    tables.read("C1", "weight", 0, 100)  # another table's piece: its file is fine
    with pytest.raises(Exception, match="corrupt"):
        tables.read("C6", "weight", 0, 100)


def test_touched_rows_generations():
    touched = TouchedRows([10])
    touched.mark(0, torch.tensor([1, 2]))
    assert touched.since(0, None).tolist() == [1, 2]
    touched.close_cut(5)
    touched.mark(0, torch.tensor([2, 7]))
    assert touched.since(0, 5).tolist() == [2, 7]  # changed since cut 5
    assert touched.since(0, 3).tolist() == [1, 2, 7]  # an unknown base: every trained row
    assert touched.since(0, None).tolist() == [1, 2, 7]


def test_writer_digests_while_writing_and_reports_errors(tmp_path):
    writer = CheckpointWriter("server-0")
    (tmp_path / "ok").mkdir()
    writer.submit(tmp_path / "ok", {"a.pt": {"w": torch.ones(3)}}, {"pieces": []})
    writer.submit(tmp_path / "missing-dir", {"b.pt": {"w": torch.ones(3)}}, {"pieces": []})
    assert writer.wait_idle(30)
    record = json.loads((tmp_path / "ok" / "writer-server-0.json").read_text())
    from embedding_server.checkpoint.files import file_digest

    assert record["files"]["a.pt"]["blake2b"] == file_digest(tmp_path / "ok" / "a.pt")
    assert not (tmp_path / "missing-dir").exists()  # its error could not even be recorded there
    writer.close(5)


@pytest.mark.slow
def test_default_model_checkpoint_is_sized_by_trained_rows_and_resumes_exactly(
    tmp_path_factory, tmp_path
):
    """The default config (26 tables x 1M rows, dim 16: 1.77 GB of tables and optimizer state)
    on 50k training rows: its checkpoints hold the trained rows only, and a run resumed from
    the mid-run one ends bit-identical."""
    import shutil

    from dense_trainer.config import load_config
    from dense_trainer.data.synth import synthesize
    from embedding_server.checkpoint.files import atomic_write_bytes

    data = tmp_path_factory.mktemp("synth50k")
    synthesize(data, train_rows=50_000, test_rows=5_000, seed=3)
    files = ([data / "train.txt"], [data / "test.txt"])
    cfg = load_config(
        None,
        [
            {
                "train": {
                    "progress": False,
                    "log_step_losses": True,
                    "checkpoint_every_steps": 49,
                    "epochs": 1,  # the 98 steps below
                    "validation": 0.0,
                },
                "data": {"num_workers": 1},
            }
        ],
    )
    a = Trainer(cfg, tmp_path / "a").fit(*files)  # 98 steps: checkpoints at 49 and 98
    stats = a["checkpoints"]["last"]
    print(
        f"default model, 50k rows: checkpoint {stats['bytes'] / 1e6:.1f} MB for "
        f"{stats['rows_written']:,} trained "
        f"rows; {stats['bytes_allocated'] / 1e9:.2f} GB allocated"
    )
    assert stats["bytes_allocated"] > 1.7e9 and stats["rows_allocated"] == 26_000_000
    assert stats["bytes"] * 10 <= 1.7e9
    # Resume from the step-49 checkpoint in another directory: the rest of the run is identical.
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "a" / "checkpoints" / "step-0000000049",
        tmp_path / "b" / "checkpoints" / "step-0000000049",
    )
    atomic_write_bytes(tmp_path / "b" / "checkpoints" / "latest", b"step-0000000049")
    b = Trainer(cfg, tmp_path / "b").fit(*files, resume=True)
    assert b["step_losses"] == a["step_losses"][49:]
    assert b["test_auc"] == a["test_auc"]
    ta = CheckpointTables(latest_checkpoint(tmp_path / "a" / "checkpoints"))
    tb = CheckpointTables(latest_checkpoint(tmp_path / "b" / "checkpoints"))
    for name in ("C1", "C9", "C26"):
        assert torch.equal(ta.saved_rows(name, 0, 1_000_000), tb.saved_rows(name, 0, 1_000_000))
        assert torch.equal(
            ta.read(name, "weight", 0, 1_000_000), tb.read(name, "weight", 0, 1_000_000)
        )
