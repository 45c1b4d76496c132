#!/usr/bin/env python3
"""Check the tree's layout rules; exit 1 naming every violation (run by tests/test_layout.py).

1. No Python file outside tests/, bench/ and scripts/ is over MAX_FILE_LINES lines.
2. No function or method there is over MAX_FUNCTION_LINES lines (decorators and docstring included).
3. Imports flow one way, counting every import statement (module level, inside functions, under
   ``TYPE_CHECKING``): ``dlrm_core`` imports none of our packages; ``embedding_server`` only
   ``dlrm_core``; ``dense_trainer`` those two; ``api`` those two and, sideways, only the network
   definitions (``dense_trainer.model``, ``dense_trainer.config``). ``dlrm_cli`` may import all.
4. No import cycle between our modules (any import statement counts).
5. Inside ``embedding_server`` imports flow down its layers (``ES_LAYERS``): a wing or top-level
   module imports only those of lower layers, never one beside or above it.
6. Importing the serving app loads no training kernel: ``import api.app`` leaves ``fbgemm_gpu``
   out of ``sys.modules``.

Usage: python scripts/check_layout.py [ROOT]
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 120  # formatted lines (ruff format: one argument per line)
PACKAGES = ("dlrm_core", "embedding_server", "dense_trainer", "api")
ALLOWED = {
    "dlrm_core": set(),
    "embedding_server": {"dlrm_core"},
    "dense_trainer": {"dlrm_core", "embedding_server"},
    "api": {"dlrm_core", "embedding_server"},
    "dlrm_cli": set(PACKAGES),
}
SIDEWAYS = {"api": ("dense_trainer.model", "dense_trainer.config")}
"""The serving API builds the trainer's network (and reads its model config), nothing else."""
ES_LAYERS = (
    ("local_table", "wire"),  # table pieces and their rows; what crosses a process boundary
    ("idmap",),  # dynamic ids -> rows
    ("kernels", "sharding"),  # fused kernels and optimizers; placement schemes
    ("checkpoint", "config"),  # table checkpoints; the typed config sections
    # serving stores and live updates; placement; a process's tables
    ("stores", "planner", "shard"),
    ("runtime",),  # the server loop, transport, exchange, watchdog
    ("towers",),  # DMT towers (plug into the runtime and the client)
    ("client", "publish"),  # what trainers use to reach the tables; checkpoint -> serving version
    ("cli",),  # `dlrm publish`, `dlrm store`
)
"""The parts of ``embedding_server`` (wings and top-level modules), bottom up."""
ES_LAYER = {unit: i for i, layer in enumerate(ES_LAYERS) for unit in layer}
EXCLUDED_DIRS = (
    "tests",
    "bench",
    "scripts",
    ".venv",
    ".venv-bench",
    "build",
    ".git",
    ".gl",
    ".whl",
)


def source_files(root: Path) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in EXCLUDED_DIRS or any(p.startswith(".") for p in rel.parts):
            continue
        out.append(path)
    return out


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) of every import statement, relative imports resolved."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")
                parent = parent[: len(parent) - node.level + (1 if is_package else 0)]
                base = ".".join(parent + ([base] if base else []))
            out.append((base, node.lineno))
            # `from pkg import mod`
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def check_sizes(root: Path, path: Path, tree: ast.AST, lines: int) -> list[str]:
    rel = path.relative_to(root)
    errors = []
    if lines > MAX_FILE_LINES:
        errors.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            if length > MAX_FUNCTION_LINES:
                errors.append(
                    f"{rel}:{node.lineno}: function {node.name} has {length} lines "
                    f"(at most {MAX_FUNCTION_LINES})"
                )
    return errors


def check_direction(module: str, imported: str, where: str) -> str | None:
    mine, theirs = module.split(".")[0], imported.split(".")[0]
    if theirs not in PACKAGES or theirs == mine:
        return None
    if theirs in ALLOWED.get(mine, set()):
        return None
    if any(imported == s or imported.startswith(s + ".") for s in SIDEWAYS.get(mine, ())):
        return None
    if imported == theirs and any(s.startswith(theirs + ".") for s in SIDEWAYS.get(mine, ())):
        return None  # `from dense_trainer import model` resolves to the package first
    return (
        f"{where}: {module} imports {imported} ({mine} may import "
        f"{sorted(ALLOWED.get(mine, set()))}"
        f"{' and ' + ', '.join(SIDEWAYS[mine]) if mine in SIDEWAYS else ''})"
    )


def check_layers(module: str, imported: str, where: str) -> str | None:
    """Rule 5: within ``embedding_server``, a part imports only parts of lower layers."""
    mine, theirs = module.split("."), imported.split(".")
    if (
        mine[0] != "embedding_server"
        or theirs[0] != "embedding_server"
        or len(mine) < 2
        or len(theirs) < 2
    ):
        return None
    a, b = mine[1], theirs[1]
    if a == b or b not in ES_LAYER:
        return None
    if a not in ES_LAYER:
        return (
            f"{where}: embedding_server.{a} is in no layer of ES_LAYERS (scripts/check_layout.py)"
        )
    if ES_LAYER[b] < ES_LAYER[a]:
        return None
    below = sorted(u for u, i in ES_LAYER.items() if i < ES_LAYER[a])
    return (
        f"{where}: {module} imports {imported} (embedding_server.{a} may import only "
        f"{', '.join(below) or 'none'})"
    )


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check_api_imports_no_kernels(root: Path) -> list[str]:
    code = "import sys, api.app; sys.exit(1 if 'fbgemm_gpu' in sys.modules else 0)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 1:
        return [
            "import api.app loads fbgemm_gpu: the serving process must not load training kernels"
        ]
    if proc.returncode != 0:
        return [
            "import api.app failed: "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}"
        ]
    return []


def check(root: Path, import_check: bool = True) -> list[str]:
    files = source_files(root)
    modules = {module_name(root, p): p for p in files}
    errors: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        errors += check_sizes(root, path, tree, len(text.splitlines()))
        for imported, line in imports_of(tree, module, path.name == "__init__.py"):
            where = f"{path.relative_to(root)}:{line}"
            for problem in (
                check_direction(module, imported, where),
                check_layers(module, imported, where),
            ):
                if problem:
                    errors.append(problem)
            if imported in modules and imported != module:
                graph[module].add(imported)
    for cycle in find_cycles(graph):
        errors.append(f"import cycle: {' <-> '.join(cycle)}")
    if import_check:
        errors += check_api_imports_no_kernels(root)
    return sorted(set(errors), key=errors.index)


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    errors = check(root)
    for e in errors:
        print(e)
    print(f"check_layout: {len(errors)} violation(s) in {len(source_files(root))} files")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
