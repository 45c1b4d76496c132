"""The pipeline modes are classes chosen once (embedding_server/runtime/pipelining.py): each
answers the trainer (prefetch, corrections) and the server (when updates run) as the modes are
documented, and no other module compares the mode's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from embedding_server.config import DistConfig
from embedding_server.runtime.pipelining import MODES, ServerSchedule, pipelining

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("mode", "corrected", "prefetch", "corrections", "schedule"),
    [
        ("off", True, False, False, ServerSchedule(eager=True, stale=False, corrected=False)),
        ("exact", True, True, True, ServerSchedule(eager=False, stale=False, corrected=True)),
        ("exact", False, True, False, ServerSchedule(eager=False, stale=False, corrected=False)),
        ("semi-sync", True, True, False, ServerSchedule(eager=False, stale=True, corrected=False)),
    ],
)
def test_each_mode_answers_both_sides(mode, corrected, prefetch, corrections, schedule):
    m = pipelining(DistConfig(pipeline=mode, corrected_lookups=corrected))
    assert m.name == mode and m.prefetch is prefetch
    assert m.expects_corrections() is corrections
    assert m.schedule(deferrable=True, pipelined=True, has_tables=True) == schedule


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_route_that_cannot_overlap_runs_lockstep(mode):
    """The hierarchical route (transport not pipelined) and stages that cannot defer an update
    (towers) never look up early, whatever the mode."""
    m = pipelining(DistConfig(pipeline=mode))
    lock = m.schedule(deferrable=True, pipelined=False, has_tables=True)
    assert lock == ServerSchedule(eager=True, stale=False, corrected=False)
    held = m.schedule(deferrable=False, pipelined=True, has_tables=True)
    assert not held.stale and not held.corrected
    assert not m.schedule(deferrable=True, pipelined=True, has_tables=False).corrected


def test_every_configurable_mode_has_a_class():
    names = DistConfig.model_fields["pipeline"].annotation.__args__
    assert set(names) == set(MODES)


def test_no_module_compares_the_mode_name():
    pattern = re.compile(r"pipeline\s*[!=]=|[!=]=\s*\"(off|exact|semi-sync)\"")
    found = []
    for pkg in ("dlrm_core", "embedding_server", "dense_trainer", "api"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name == "pipelining.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
