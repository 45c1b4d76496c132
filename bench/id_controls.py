"""Controls for the hashed-vs-dynamic comparison of ``bench/quality.py --parts ids``.

Hashed ids put a fixed, arbitrary set of ids in each row (``id % rows``). Every seed of a split
reuses that one mapping, so a comparison paired by split and seed still carries its luck: a
mapping whose rows happen to start well for this data sits above the mode's average, and no
number of seeds averages that away. Two controls, each a rewritten copy of a Criteo-format
split (label, 13 counts, 26 hex ids) trained by the very same hashed config:

* **equivalent hashes**: every id's hashed row r moved to row perm[r] (a fixed random
  permutation per control): exactly the same collisions, other rows; the spread of these
  copies' AUC around the original is the luck of one mapping, and their mean with the
  original's is hashed's own average (what dynamic is compared with beside the original);
* **the offline stand-in** (the issue's): each feature's ``rows - S`` most frequent training
  ids get rows of their own, every other id (and every test id not among them) one of S
  shared rows by its hash (S as dynamic's ``shared_rows``): what an id map that knew the whole
  training set's counts in advance would do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

CATEGORICAL = range(14, 40)
"""Columns of the hex ids in a Criteo-format line (label, 13 counts, then 26 ids)."""


def _value(cell: str) -> int:
    return int(cell, 16) if cell else 0  # an empty cell is id 0, as the featuriser reads it


def _rewrite(src: Path, dst: Path, row_of: Callable[[int, str], int]) -> None:
    """``src`` with each categorical cell replaced by the hex of ``row_of(column, cell)`` (a row
    below the table's rows, where ``id % rows`` puts it back)."""
    out = []
    for line in src.read_text().splitlines():
        cells = line.split("\t")
        for j in CATEGORICAL:
            cells[j] = format(row_of(j, cells[j]), "x")
        out.append("\t".join(cells) + "\n")
    dst.write_text("".join(out))


def _copy(
    train: Path, test: Path, out: Path, row_of: Callable[[int, str], int]
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "done").exists():
        for src in (train, test):
            _rewrite(src, out / src.name, row_of)
        (out / "done").write_text("")
    return out / train.name, out / test.name


def equivalent_hash(train: Path, test: Path, out: Path, rows: int, seed: int) -> tuple[Path, Path]:
    """A copy of the split whose hashed rows are permuted (seed ``seed``): the same collisions
    at ``rows`` rows per table, other rows -> (train, test) paths under ``out``."""
    perm = np.random.default_rng(seed).permutation(rows)
    return _copy(train, test, out, lambda _, cell: int(perm[_value(cell) % rows]))


def stand_in(train: Path, test: Path, out: Path, rows: int, shared: int) -> tuple[Path, Path]:
    """A copy of the split remapped as the offline stand-in does: per feature, the ``rows -
    shared`` most frequent training ids (ties: first seen) rows ``shared``.. of their own, the
    rest rows ``id % shared`` -> (train, test) paths under ``out``."""
    counts = {j: Counter() for j in CATEGORICAL}
    for line in train.read_text().splitlines():
        cells = line.split("\t")
        for j in CATEGORICAL:
            counts[j][cells[j]] += 1
    own = {
        j: {cell: shared + i for i, (cell, _) in enumerate(c.most_common(rows - shared))}
        for j, c in counts.items()
    }
    return _copy(train, test, out, lambda j, cell: own[j].get(cell, _value(cell) % shared))
