"""`dlrm data synth --drift K` (dense_trainer/data/drift.py): a click log whose preferences move
and whose ids are renewed between segments."""

from __future__ import annotations

import json

import pyarrow.csv as pcsv

from dlrm_cli import main
from dlrm_core.schema import CRITEO_COLUMNS


def _read(path):
    opts = pcsv.ReadOptions(column_names=CRITEO_COLUMNS)
    return pcsv.read_csv(path, opts, pcsv.ParseOptions(delimiter="\t")).to_pydict()


def test_drifting_segments_renew_ids_and_keep_the_click_rate(tmp_path, capsys):
    code = main(["data", "synth", "--train-rows", "6000", "--test-rows", "100", "--drift", "3",
                 "--drift-new-ids", "0.5", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    record = json.loads((tmp_path / "drift.json").read_text())
    assert [s["rows"] for s in record["segments"]] == [2000, 2000, 2000]
    segs = [_read(tmp_path / s["file"]) for s in record["segments"]]
    for seg, s in zip(segs, record["segments"], strict=True):
        assert 0.18 < sum(seg["label"]) / len(seg["label"]) < 0.32  # recalibrated: CTR 0.25
        assert 0.6 < s["bayes_auc"] < 1.0
    c1 = [set(seg["C1"]) - {None} for seg in segs]  # 1,000 values; half renewed per segment
    assert len(c1[1] - c1[0]) > 0.2 * len(c1[1])  # new ids arrive
    assert len(c1[1] & c1[0]) > 0.2 * len(c1[1])  # and the others stay
    assert (tmp_path / "test.txt").exists()


def test_drift_refuses_what_it_cannot_write(tmp_path, capsys):
    assert main(["data", "synth", "--train-rows", "10", "--test-rows", "1", "--drift", "1",
                 "--out", str(tmp_path)]) != 0  # fmt: skip
    assert "at least 2 segments" in capsys.readouterr().err
    assert main(["data", "synth", "--train-rows", "10", "--test-rows", "1", "--drift", "2",
                 "--format", "csv", "--out", str(tmp_path)]) != 0  # fmt: skip
    assert "Criteo layout" in capsys.readouterr().err
