"""The `dlrm` command as a user runs it: exit codes and one-line errors."""

import json
import signal
import subprocess
import sys
import time

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]


def run(*args, **kw):
    return subprocess.run(
        [*DLRM, *map(str, args)], capture_output=True, text=True, cwd=REPO, **{"timeout": 120, **kw}
    )


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in errors[0], errors[0]


def test_synth_writes_files_and_bayes(tmp_path):
    proc = run(
        "data", "synth", "--train-rows", 1000, "--test-rows", 500, "--out", tmp_path, "--seed", 3
    )
    assert proc.returncode == 0, proc.stderr
    bayes = json.loads((tmp_path / "bayes.json").read_text())
    assert 0.6 < bayes["test_auc"] < 1 and bayes["test_rows"] == 500
    lines = (tmp_path / "test.txt").read_text().splitlines()
    assert len(lines) == 500 and all(len(line.split("\t")) == 40 for line in lines)
    again = tmp_path / "again"
    run("data", "synth", "--train-rows", 1000, "--test-rows", 500, "--out", again, "--seed", 3)
    assert (again / "test.txt").read_bytes() == (tmp_path / "test.txt").read_bytes()


def test_missing_train_file(tmp_path):
    proc = run(
        "train",
        "--train",
        tmp_path / "nope.txt",
        "--test",
        tmp_path / "nope.txt",
        "--out",
        tmp_path / "o",
    )
    assert_one_line_error(proc, "nope.txt", "no such file")


def test_unwritable_out(tmp_path, synth_small):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run(
        "train",
        "--train",
        synth_small / "train.txt",
        "--test",
        synth_small / "test.txt",
        "--out",
        blocker / "sub",
        "--config",
        "configs/tiny.toml",
    )
    assert_one_line_error(proc, "--out", "not writable")


def test_bad_store_urls_are_one_line_errors(tmp_path):
    """Before anything starts: the API's workers never see it, the URL's password is not shown."""
    proc = run("serve", "--store", "bogus://user:hunter2@host/0", "--port", 1)
    assert_one_line_error(proc, "store URL", "unknown scheme 'bogus'")
    assert "hunter2" not in proc.stderr + proc.stdout
    proc = run("publish", "--checkpoint", tmp_path, "--store", "bogus://x")
    assert_one_line_error(proc, "unknown scheme 'bogus'")


def test_config_typo(tmp_path, synth_small):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\ninteraction = 'dot'\nover_arch_layers = [4]\n")
    proc = run(
        "train",
        "--train",
        synth_small / "train.txt",
        "--test",
        synth_small / "test.txt",
        "--out",
        tmp_path / "o",
        "--config",
        cfg,
    )
    assert_one_line_error(
        proc, "model.over_arch_layers", "unknown setting", "over_arch_layer_sizes"
    )


def test_strict_malformed_names_file_and_line(tmp_path, synth_small):
    bad = tmp_path / "bad.txt"
    lines = (synth_small / "test.txt").read_text().splitlines(keepends=True)[:50]
    lines[41] = "1\tnot\ta\tline\n"
    bad.write_text("".join(lines))
    proc = run(
        "train",
        "--train",
        bad,
        "--test",
        bad,
        "--out",
        tmp_path / "o",
        "--config",
        "configs/tiny.toml",
        "--strict",
        "--no-progress",
    )
    assert_one_line_error(proc, f"{bad}:42", "wrong field count")


@pytest.mark.skipif(sys.platform != "linux", reason="signals")
def test_sigterm_checkpoints_and_resume_completes(tmp_path, synth_medium):
    out = tmp_path / "run"
    args = [
        "train",
        "--train",
        synth_medium / "train.txt",
        "--test",
        synth_medium / "test.txt",
        "--out",
        out,
        "--config",
        "configs/tiny.toml",
        "--batch-size",
        "64",
        "--patience",
        "0",  # every row trained: early stopping would end the epoch sooner
        "--no-progress",
    ]
    proc = subprocess.Popen([*DLRM, *map(str, args)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(out.glob("checkpoints/step-*")) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "continue with --resume" in err
    resumed = run(*args, "--resume", timeout=300)  # 100k rows; a loaded machine takes minutes
    assert resumed.returncode == 0, resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    # every training row but the validation split's, once
    assert metrics["samples_seen"] + metrics["valid_rows"] == 100_000 and metrics["completed"]
