"""The tree passes ruff's checks (line length included) and is as ``ruff format`` lays it out."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (make setup installs it)")
@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff(command):
    done = subprocess.run([RUFF, *command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"ruff {' '.join(command)}:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    )
