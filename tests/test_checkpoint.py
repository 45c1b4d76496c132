import json
import os
import pickle

import pytest
import torch

import embedding_server.checkpoint.files as ckpt
from dlrm_core.errors import CheckpointError
from embedding_server.checkpoint.files import (
    atomic_write_bytes,
    latest_checkpoint,
    load_file,
    read_manifest,
    write_checkpoint,
)


def test_round_trip_and_latest(tmp_path):
    t = {"w": torch.arange(6.0).view(2, 3), "n": torch.tensor(3)}
    path = write_checkpoint(
        tmp_path, 5, {"a.pt": t, "b.pt": {"step": 5, "hist": [{"x": 1.0}]}}, {"k": "v"}
    )
    assert latest_checkpoint(tmp_path) == path
    assert read_manifest(path)["step"] == 5 and read_manifest(path)["meta"] == {"k": "v"}
    loaded = load_file(path, "a.pt")
    assert torch.equal(loaded["w"], t["w"])
    assert load_file(path, "b.pt")["hist"] == [{"x": 1.0}]


def test_keeps_only_the_newest(tmp_path):
    for step in range(1, 5):
        write_checkpoint(tmp_path, step, {"a.pt": {"s": torch.tensor(step)}}, {}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000000003", "step-0000000004"]
    assert latest_checkpoint(tmp_path).name == "step-0000000004"


def test_corruption_is_detected(tmp_path):
    path = write_checkpoint(tmp_path, 1, {"a.pt": {"w": torch.zeros(100)}}, {})
    data = bytearray((path / "a.pt").read_bytes())
    data[-40] ^= 0xFF
    (path / "a.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_file(path, "a.pt")


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dlrm-pwned",))


def test_pickled_code_is_never_executed(tmp_path):
    path = write_checkpoint(tmp_path, 1, {"a.pt": {"w": torch.zeros(1)}}, {})
    # Replace the file with a malicious pickle and fix up the manifest's checksum.
    (path / "a.pt").write_bytes(pickle.dumps(Evil()))
    from embedding_server.checkpoint.files import file_digest

    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["a.pt"]["blake2b"] = file_digest(path / "a.pt")
    (path / "manifest.json").write_text(json.dumps(manifest))
    if os.path.exists("/tmp/dlrm-pwned"):
        os.remove("/tmp/dlrm-pwned")
    with pytest.raises(CheckpointError, match="cannot load"):
        load_file(path, "a.pt")
    assert not os.path.exists("/tmp/dlrm-pwned")


def test_failed_write_leaves_previous_checkpoint_current(tmp_path, monkeypatch):
    good = write_checkpoint(tmp_path, 1, {"a.pt": {"w": torch.ones(2)}}, {})
    real_save = ckpt._save_file
    calls = []

    def disk_full_on_second_file(path, obj, *args):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(path, obj, *args)

    monkeypatch.setattr(ckpt, "_save_file", disk_full_on_second_file)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*No space"):
        write_checkpoint(
            tmp_path, 2, {"a.pt": {"w": torch.ones(2)}, "b.pt": {"w": torch.ones(2)}}, {}
        )
    assert latest_checkpoint(tmp_path) == good
    assert not list(tmp_path.glob(".step-*")) and not (tmp_path / "step-0000000002").exists()
    assert torch.equal(load_file(good, "a.pt")["w"], torch.ones(2))


def test_stale_partial_files_never_join_a_checkpoint(tmp_path):
    from embedding_server.checkpoint.files import finalize_checkpoint, partial_dir, save_file

    stale = partial_dir(tmp_path, 7)
    (stale / "embeddings-server-2.pt").write_bytes(b"left by a crashed run with 3 servers")
    fresh = partial_dir(tmp_path, 7, fresh=True)  # the master starts the checkpoint
    save_file(fresh, "dense.pt", {"w": torch.ones(1)})
    path = finalize_checkpoint(tmp_path, 7, {})
    assert sorted(read_manifest(path)["files"]) == ["dense.pt"]


def test_atomic_write_bytes(tmp_path):
    p = tmp_path / "x"
    atomic_write_bytes(p, b"one")
    atomic_write_bytes(p, b"two")
    assert p.read_bytes() == b"two" and [f.name for f in tmp_path.iterdir()] == ["x"]


def test_missing_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        read_manifest(tmp_path)
