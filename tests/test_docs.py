"""The documentation builds as a site with no broken link or orphan page (``mkdocs build
--strict``), and the README stays a front door: short, and every link it has resolves."""

import re
import subprocess
import sys

from .conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)")


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "results" / "index.html").exists()


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for needed in ("make demo", "make test", "```mermaid"):
        assert needed in text
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        path = target.split("#", 1)[0]
        assert (REPO / path).exists(), f"README links to {target}, which does not exist"
