"""Elastic restarts read every row of the epoch once, whatever the numbers of trainers."""

from collections import Counter

import numpy as np
import pytest

from dense_trainer.data.loader import BatchLoader
from dense_trainer.data.steps import Steps, resume_positions
from dlrm_core.schema import criteo_spec

SPEC = criteo_spec([1000] * 26, [4] * 26)
ROWS = 3000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("elastic") / "train.txt"
    with path.open("w") as f:
        for i in range(ROWS):  # I1 = the row's number (log1p on the way in)
            f.write(
                "\t".join(
                    [str(i % 2), str(i), *["1"] * 12, *[f"{i * 7 + j:08x}" for j in range(26)]]
                )
                + "\n"
            )
    return path


def run(path, parts: int, steps: int | None, saved, consumed, epochs: int):
    """Take ``steps`` agreed steps (None: to the end) as ``parts`` trainers would; -> (row numbers
    read, positions, consumed)."""
    starts, consumed = resume_positions(saved, parts, consumed)
    loaders = [
        BatchLoader(
            [path],
            SPEC,
            96 // parts,
            num_workers=0,
            block_bytes=9_000,
            epochs=epochs,
            start=starts[t],
            part=t,
            parts=parts,
            consumed=consumed,
        )
        for t in range(parts)
    ]
    it = Steps(loaders, 13, 26, lambda v: v, min(p.epoch for p in starts))
    read, positions, taken = [], saved, 0
    while steps is None or taken < steps:
        step = it.next()
        if step is None:
            break
        read += [(step.epoch, int(r)) for r in np.rint(np.expm1(step.batch.dense[:, 0].numpy()))]
        positions, taken = step.positions, taken + 1
    it.close()
    return read, positions, consumed


@pytest.mark.parametrize(
    "plan",
    [[(2, 7), (3, 5), (2, None)], [(3, 11), (1, 4), (4, 9), (2, None)], [(4, 40), (3, None)]],
)
def test_every_row_once_across_elastic_restarts(data, plan):
    read, saved, consumed = [], None, None
    for parts, steps in plan:
        rows, saved, consumed = run(data, parts, steps, saved, consumed, epochs=2)
        read += rows
    counts = Counter(read)
    assert set(counts.values()) == {1}, [k for k, v in counts.items() if v > 1][:5]
    assert len(counts) == 2 * ROWS
