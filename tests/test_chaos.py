"""A fast slice of the chaos suite (``bench/chaos.py``): a host cut off the network while its
ranks run as bare ``dlrm worker`` processes (no launcher: every rank must give up by itself,
naming the lost one), and a stopped API worker under load (uvicorn's supervisor replaces it; no
answer mixes versions). Each run must end in bounded time and resume to the uninterrupted AUC."""

import importlib.util

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", REPO / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chaos_slice(tmp_path):
    chaos = load_chaos()
    setting = chaos.Setting(tmp_path, timeout_s=8, rows=8_000, batch=32)
    for index, (role, fault) in enumerate([("host link", "link cut"), ("API worker", "SIGSTOP")]):
        run = chaos.run_one(setting, index, role, fault, seed=0)
        print(run)
        if "skipped" in run:  # no network namespaces here (not root)
            continue
        assert run["bounded"] and run["named"], run
        assert run["resumed"] and run["auc_diff"] <= chaos.AUC_TOLERANCE, run
        assert not run.get("checkpoint_problem") and not run.get("version_mixes"), run
