"""Local ranks are forks of a fork server (dense_trainer/rank_context.py): cheap to start, yet
each takes the launcher's environment and directory of the moment it starts, as a spawned
process does, not those of the launcher's first job (when the fork server started)."""

import json
import os
from pathlib import Path

from dense_trainer.rank_context import adopt_launcher_state, launcher_state, rank_context


def _report(out: str, state: tuple | None) -> None:
    """A rank's view: the variable and directory it runs with (``state``: adopted first)."""
    if state is not None:
        adopt_launcher_state(*state)
    Path(out).write_text(
        json.dumps(
            {
                "mark": os.environ.get("DLRM_TEST_MARK"),
                "gone": os.environ.get("DLRM_TEST_GONE"),
                "cwd": os.getcwd(),
            }
        )
    )


def _run(ctx, out: Path, state: tuple | None) -> dict:
    p = ctx.Process(target=_report, args=(str(out), state))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0
    return json.loads(out.read_text())


def test_ranks_take_the_launchers_environment_and_directory_of_now(tmp_path, monkeypatch):
    monkeypatch.setenv("DLRM_TEST_GONE", "old")
    ctx = rank_context(start=True)
    _run(ctx, tmp_path / "first.json", None)  # the fork server runs, with the environment of now
    monkeypatch.setenv("DLRM_TEST_MARK", "later")
    monkeypatch.delenv("DLRM_TEST_GONE")
    monkeypatch.chdir(tmp_path)
    stale = _run(ctx, tmp_path / "stale.json", None)
    fresh = _run(ctx, tmp_path / "fresh.json", launcher_state())
    assert stale["mark"] is None  # what a bare fork of the server would see: why ranks adopt
    assert fresh == {"mark": "later", "gone": None, "cwd": str(tmp_path)}
