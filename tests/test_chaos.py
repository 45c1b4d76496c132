"""A fast slice of the chaos suite (``bench/chaos.py``): a host cut off the network (no TCP reset)
while the job's four ranks run as bare ``dlrm worker`` processes in four network namespaces: no
launcher watches them, so every rank must give up by itself within dist.timeout_s + 30 s, the
survivors naming the lost one; the job then resumes to the uninterrupted run's AUC. (The serving
roles of the suite, API worker and Redis, are exercised by the bench's 30 runs and by
tests/test_api.py's Redis outage test.)"""

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
    run = chaos.run_one(setting, 0, "host link", "link cut", seed=0)
    print(run)
    if "skipped" in run:
        pytest.skip(run["skipped"])  # no network namespaces here (not root)
    assert run["bounded"] and run["named"], run
    assert run["resumed"] and run["auc_diff"] <= chaos.AUC_TOLERANCE, run
    assert not run.get("checkpoint_problem"), run
