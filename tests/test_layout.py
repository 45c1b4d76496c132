"""The layout rules hold for the tree (scripts/check_layout.py), and the checker catches breaks."""

import importlib.util
import textwrap

from .conftest import REPO

spec = importlib.util.spec_from_file_location("check_layout", REPO / "scripts" / "check_layout.py")
check_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_layout)


def test_the_tree_follows_the_layout_rules():
    errors = check_layout.check(REPO)
    assert errors == [], "\n".join(errors)


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_the_checker_reports_each_kind_of_violation(tmp_path):
    for pkg in ("dlrm_core", "embedding_server", "dense_trainer", "api"):
        _write(tmp_path, f"{pkg}/__init__.py", "")
    _write(
        tmp_path,
        "dlrm_core/up.py",
        """
        def f():
            from embedding_server import shard  # upward, inside a function
    """,
    )
    _write(tmp_path, "embedding_server/shard.py", "x = 1\n" * 501)
    _write(tmp_path, "api/a.py", "from api import b\nimport dense_trainer.train\n")
    _write(
        tmp_path,
        "api/b.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from api.a import x\n",
    )
    body = "\n".join(f"    y = {i}" for i in range(130))
    _write(tmp_path, "dense_trainer/long.py", f"def long():\n{body}\n")
    _write(tmp_path, "tests/huge.py", "x = 1\n" * 900)  # tests are exempt
    errors = "\n".join(check_layout.check(tmp_path, import_check=False))
    assert "dlrm_core.up imports embedding_server" in errors
    assert "embedding_server/shard.py: 501 lines" in errors
    assert "api.a imports dense_trainer.train" in errors
    assert "import cycle: api.a <-> api.b" in errors
    assert "function long has 131 lines" in errors
    assert "huge" not in errors


def test_the_checker_holds_embedding_server_to_its_layers(tmp_path):
    for rel in (
        "embedding_server/__init__.py",
        "embedding_server/kernels/__init__.py",
        "embedding_server/runtime/__init__.py",
        "embedding_server/idmap/__init__.py",
    ):
        _write(tmp_path, rel, "")
    _write(
        tmp_path, "embedding_server/kernels/tbe.py", "from embedding_server.runtime import server\n"
    )
    _write(
        tmp_path,
        "embedding_server/kernels/rows.py",
        "from embedding_server.sharding import row_wise\n",
    )
    _write(
        tmp_path, "embedding_server/runtime/server.py", "from embedding_server.idmap import remap\n"
    )
    _write(tmp_path, "embedding_server/newwing/x.py", "from embedding_server.idmap import remap\n")
    errors = "\n".join(check_layout.check(tmp_path, import_check=False))
    assert "embedding_server.kernels.tbe imports embedding_server.runtime" in errors  # upward
    assert "embedding_server.kernels.rows imports embedding_server.sharding" in errors  # beside
    assert "may import only idmap, local_table, wire" in errors
    assert "embedding_server.runtime.server imports" not in errors  # downward: fine
    assert "embedding_server.newwing is in no layer" in errors
