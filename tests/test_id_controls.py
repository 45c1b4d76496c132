"""The quality bench's controls for hashed vs dynamic ids (bench/id_controls.py) rewrite a split
as they claim: an equivalent hash keeps every collision and moves only rows; the offline stand-in
gives the most frequent training ids rows of their own and every other id a shared row."""

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from id_controls import CATEGORICAL, equivalent_hash, stand_in  # noqa: E402

ROWS, SHARED = 50, 5


def _split(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    paths = []
    for name, n in (("train.txt", 400), ("test.txt", 100)):
        lines = []
        for _ in range(n):
            ids = [
                format(int(rng.zipf(1.3)) * 7919 + j, "x") if rng.random() > 0.05 else ""
                for j in range(26)
            ]
            lines.append(
                "\t".join(
                    [str(int(rng.random() < 0.3))] + [str(int(rng.integers(0, 9)))] * 13 + ids
                )
            )
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        paths.append(tmp_path / name)
    return paths[0], paths[1]


def _cells(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def _row(cell: str, rows: int = ROWS) -> int:
    return (int(cell, 16) if cell else 0) % rows


def test_an_equivalent_hash_keeps_every_collision(tmp_path):
    train, test = _split(tmp_path)
    got = equivalent_hash(train, test, tmp_path / "perm", ROWS, seed=3)
    for src, dst in zip((train, test), got, strict=True):
        a, b = _cells(src), _cells(dst)
        assert [r[:14] for r in a] == [r[:14] for r in b]  # labels and counts untouched
        for j in CATEGORICAL:
            before, after = defaultdict(set), defaultdict(set)
            for x, y in zip(a, b, strict=True):
                before[_row(x[j])].add(x[j])
                after[_row(y[j])].add(x[j])
            assert sorted(map(sorted, before.values())) == sorted(map(sorted, after.values()))
            # rows did move
            assert set(before) != set(after) or any(before[r] != after[r] for r in before)


def test_the_stand_in_gives_frequent_ids_their_own_rows(tmp_path):
    train, test = _split(tmp_path)
    got_train, got_test = stand_in(train, test, tmp_path / "stand-in", ROWS, SHARED)
    a, b = _cells(train), _cells(got_train)
    for j in CATEGORICAL:
        holders = defaultdict(set)
        for x, y in zip(a, b, strict=True):
            holders[_row(y[j])].add(x[j])
        own = {r: ids for r, ids in holders.items() if r >= SHARED}
        assert all(len(ids) == 1 for ids in own.values())  # an own row holds one id
        counts = defaultdict(int)
        for x in a:
            counts[x[j]] += 1
        distinct = len(counts)
        assert len(own) == min(distinct, ROWS - SHARED)
        least_own = min(counts[next(iter(ids))] for ids in own.values())
        shared_ids = set().union(*(ids for r, ids in holders.items() if r < SHARED))
        assert all(counts[i] <= least_own for i in shared_ids)  # only the less frequent share
        row_of = {x[j]: _row(y[j]) for x, y in zip(a, b, strict=True)}
        for x, y in zip(_cells(test), _cells(got_test), strict=True):  # a test id: its training row
            want = row_of.get(x[j])
            assert (
                _row(y[j]) == want if want is not None and want >= SHARED else _row(y[j]) < SHARED
            )
