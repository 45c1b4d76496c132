import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dense_trainer.data.loader import BatchLoader
from dlrm_core.batch import Position
from dlrm_core.errors import DataError
from dlrm_core.schema import criteo_spec

SPEC = criteo_spec([1000] * 26, [4] * 26)


def line(label="1", ints=None, cats=None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *ints, *cats]) + "\n"


def collect(loader):
    batches = list(loader)
    return (
        torch.cat([b.labels for b in batches]),
        torch.cat([b.dense for b in batches]),
        torch.cat([b.sparse.values.view(26, -1) for b in batches], dim=1),
        batches,
    )


def test_reads_real_criteo_sample(criteo_sample):
    loader = BatchLoader([criteo_sample / "train.txt"], SPEC, 1000, num_workers=2)
    labels, dense, ids, batches = collect(loader)
    assert labels.numel() == 8000 and len(batches) == 8
    assert loader.bad_lines.count == 0
    # First line of the file: 0 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2 68fd1e64 ...
    assert labels[0] == 0
    np.testing.assert_allclose(dense[0, :5].numpy(), np.log1p([1, 1, 5, 0, 1382]), rtol=1e-6)
    assert dense[0, 11] == 0  # I12 empty -> missing -> 0
    assert ids[0, 0] == int("68fd1e64", 16) % 1000
    assert abs(labels.mean().item() - 0.216) < 1e-3


def test_gzip_and_plain_identical(tmp_path, criteo_sample):
    gz = tmp_path / "train.txt.gz"
    with open(criteo_sample / "train.txt", "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    a = collect(BatchLoader([criteo_sample / "train.txt"], SPEC, 512, block_bytes=1 << 16))
    b = collect(BatchLoader([gz], SPEC, 512, block_bytes=1 << 16))
    for x, y in zip(a[:3], b[:3], strict=True):
        assert torch.equal(x, y)


def test_several_files_are_one_stream(tmp_path, criteo_sample):
    lines = (criteo_sample / "test.txt").read_text().splitlines(keepends=True)
    (tmp_path / "a.txt").write_text("".join(lines[:700]))
    (tmp_path / "b.txt").write_text("".join(lines[700:]))
    one = collect(BatchLoader([criteo_sample / "test.txt"], SPEC, 300))
    two = collect(BatchLoader([tmp_path / "a.txt", tmp_path / "b.txt"], SPEC, 300))
    assert [b.batch_size for b in two[3]] == [300] * 6 + [200]
    for x, y in zip(one[:3], two[:3], strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_batches_do_not_depend_on_workers_or_block_size(criteo_sample, workers):
    ref = collect(BatchLoader([criteo_sample / "test.txt"], SPEC, 128, num_workers=2))
    got = collect(
        BatchLoader([criteo_sample / "test.txt"], SPEC, 128, num_workers=workers, block_bytes=5000)
    )
    for x, y in zip(ref[:3], got[:3], strict=True):
        assert torch.equal(x, y)


def write_malformed(path: Path) -> None:
    rows = [
        line(),  # 1 ok
        "1\t2\t3\n",  # 2 wrong field count
        line(ints=["x"] + [str(i) for i in range(12)]),  # 3 non-integer I1
        line(cats=["zzzz1234"] + [f"{i:08x}" for i in range(25)]),  # 4 bad hex
        line(label="7"),  # 5 bad label
        line(label="0"),  # 6 ok
        "\n",  # 7 empty line
        line(ints=[""] * 13, cats=[""] * 26),  # 8 ok: all missing
    ]
    path.write_text("".join(rows))


def test_malformed_lines_counted_and_skipped(tmp_path, caplog):
    path = tmp_path / "bad.txt"
    write_malformed(path)
    loader = BatchLoader([path], SPEC, 10)
    labels, dense, ids, _ = collect(loader)
    assert labels.tolist() == [1, 0, 1]
    assert loader.bad_lines.count == 5
    assert loader.bad_lines.by_reason == {
        "wrong field count": 1,
        "non-numeric dense value": 1,
        "bad hex categorical": 1,
        "bad label": 2,
    }
    assert f"{path}:2" in loader.bad_lines.summary()
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1 and f"{path}:2" in warnings[0].getMessage()
    assert torch.all(dense[2] == 0) and torch.all(ids[:, 2] == 0)


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("1\t2\n", "wrong field count"),
        (line(ints=["1.5"] + ["1"] * 12), "I1 is not an integer"),
        (line(cats=[f"{i:08x}" for i in range(25)] + ["g0000000"]), "C26 is not hex"),
    ],
)
def test_strict_stops_at_first_with_file_and_line(tmp_path, bad_line, reason):
    path = tmp_path / "bad.txt"
    path.write_text(line() + line() + bad_line + line())
    with pytest.raises(DataError, match=rf"{path}:3: malformed line: {reason}"):
        list(BatchLoader([path], SPEC, 2, strict=True))


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(BatchLoader([tmp_path / "nope.txt"], SPEC, 2))


def test_truncated_gzip_is_a_data_error(tmp_path, criteo_sample):
    gz = tmp_path / "t.gz"
    gz.write_bytes(gzip.compress((criteo_sample / "test.txt").read_bytes())[:5000])
    with pytest.raises(DataError, match="cannot read"):
        list(BatchLoader([gz], SPEC, 100))


def test_resume_from_any_position_continues_the_stream(criteo_sample):
    files = [criteo_sample / "test.txt", criteo_sample / "test.txt"]
    kw = dict(block_bytes=20_000, epochs=2)
    full = list(BatchLoader(files, SPEC, 300, **kw))
    for cut in [1, 5, 13, len(full) // 2 + 1]:
        start = full[cut - 1].position
        rest = list(BatchLoader(files, SPEC, 300, start=start, **kw))
        assert len(rest) == len(full) - cut
        for a, b in zip(full[cut:], rest, strict=True):
            assert torch.equal(a.labels, b.labels) and torch.equal(a.sparse.values, b.sparse.values)
            assert a.position.epoch == b.position.epoch
        # Positions taken in a resumed run resume exactly too.
        if len(rest) > 2:
            again = list(BatchLoader(files, SPEC, 300, start=rest[1].position, **kw))
            assert all(
                torch.equal(a.labels, b.labels) for a, b in zip(rest[2:], again, strict=True)
            )
    assert full[-1].position.epoch == 1


def test_epochs_and_max_rows(criteo_sample):
    batches = list(BatchLoader([criteo_sample / "test.txt"], SPEC, 600, epochs=2))
    assert [b.batch_size for b in batches] == [600, 600, 600, 200] * 2
    assert [b.position.epoch for b in batches] == [0] * 4 + [1] * 4
    capped = list(BatchLoader([criteo_sample / "test.txt"], SPEC, 600, max_rows=1000))
    assert [b.batch_size for b in capped] == [600, 400]
    assert Position().epoch == 0


def test_multi_hot_bags(tmp_path):
    spec = criteo_spec([100] * 26, [4] * 26, separator=",")
    cats = ["a,b,c", "", *[f"{i:x}" for i in range(24)]]
    path = tmp_path / "mh.txt"
    path.write_text(
        line(cats=cats) + line(cats=["ff", "1,2", *["0"] * 24]) + line(cats=["q"] + ["0"] * 25)
    )
    loader = BatchLoader([path], spec, 10)
    (batch,) = list(loader)
    assert loader.bad_lines.count == 1  # "q" is not hex
    lengths = batch.sparse.lengths()
    assert lengths[0].tolist() == [3, 1] and lengths[1].tolist() == [0, 2]  # "" is an empty bag
    v0, _ = batch.sparse.feature_values(0)
    v1, _ = batch.sparse.feature_values(1)
    assert v0.tolist() == [10, 11, 12, 255 % 100]
    assert v1.tolist() == [1, 2]
