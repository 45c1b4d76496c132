"""Featurising: ids, hashing, dense transforms, the featuriser on a schema, spec validation."""

import numpy as np
import pyarrow as pa
import pytest

from dlrm_core.featurize import LABEL, Featurizer, transform_dense, transform_dense_block
from dlrm_core.ids import hash_strings, hex_to_uint64, raw_ids, to_rows
from dlrm_core.schema import (
    CategoricalFeature,
    DenseFeature,
    FeatureSpec,
    TableSpec,
    build_spec,
    criteo_spec,
)


def test_hex_parsing_matches_python_int():
    rng = np.random.default_rng(0)
    values = [f"{v:08x}" for v in rng.integers(0, 2**32, 1000)] + [
        "0",
        "F",
        "aBcD",
        "ffffffffffffffff",
    ]
    ints, ok = hex_to_uint64(pa.array(values))
    assert ok.all()
    assert [int(x) for x in ints] == [int(v, 16) for v in values]


def test_hex_missing_and_invalid():
    ints, ok = hex_to_uint64(pa.array(["", None, "xyz1", "12345678901234567", "0a", "1 2"]))
    assert ok.tolist() == [True, True, False, False, True, False]
    assert ints[0] == 0 and ints[1] == 0 and ints[4] == 10


def test_hex_rejects_non_ascii_without_disturbing_the_rest():
    ints, ok = hex_to_uint64(pa.array(["é", "ff", "10"]))
    assert ok.tolist() == [False, True, True] and ints.tolist() == [0, 255, 16]


def test_unsigned_integers_above_int64_keep_their_value():
    ids, ok = raw_ids(pa.array([2**64 - 1, 5], type=pa.uint64()), "int")
    assert ok.all() and ids.tolist() == [2**64 - 1, 5]


def test_hex_on_sliced_array():
    arr = pa.array(["ff", "10", "a", "b"]).slice(1, 2)
    ints, ok = hex_to_uint64(arr)
    assert ints.tolist() == [16, 10] and ok.all()


@pytest.mark.parametrize("rows", [1, 7, 100_000, 10_000_000])
def test_rows_are_id_mod_rows(rows):
    values = ["68fd1e64", "80e26c9b", "ffffffff", "0", "deadbeefcafebabe"]
    ints, _ = hex_to_uint64(pa.array(values))
    assert to_rows(ints, rows).tolist() == [int(v, 16) % rows for v in values]
    assert to_rows(ints, rows).dtype == np.int64


def reference_hash(text: str) -> int:
    """The documented hash, in plain Python (module docstring of dlrm_core/ids.py)."""
    m = (1 << 64) - 1
    data = text.encode()
    h = 0x243F6A8885A308D3 ^ (len(data) * 0xBF58476D1CE4E5B9 & m)
    for k in range(0, len(data), 8):
        w = int.from_bytes(data[k : k + 8].ljust(8, b"\0"), "little")
        h = ((h ^ w) * 0x9E3779B97F4A7C15) & m
        h ^= h >> 29
    for mult in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        h ^= h >> 33
        h = (h * mult) & m
    return h ^ (h >> 33)


def test_string_hash_is_the_documented_one_and_stable():
    values = ["", "a", "abcdefgh", "abcdefghi", "1fbe01fe", "näive", "x" * 70]
    assert hash_strings(pa.array(values)).tolist() == [reference_hash(v) for v in values]
    # Golden values: little-endian words, the same on every machine and in every process.
    assert hash_strings(pa.array(["", "a", "1fbe01fe"])).tolist() == [
        8848935107335307795,
        18278461659354269303,
        15947942886332323542,
    ]


def test_string_hash_paths_agree_and_spread():
    rng = np.random.default_rng(1)
    ascii_ = [
        str(x) * int(k)
        for x, k in zip(rng.integers(0, 10**6, 2000), rng.integers(1, 12, 2000), strict=True)
    ]
    fast = hash_strings(pa.array(ascii_))
    # A non-ASCII value sends the whole array down the general path: the hashes must not change.
    slow = hash_strings(pa.array(ascii_ + ["é"]))[:-1]
    assert (fast == slow).all()
    long = ["x" * 100 + str(i) for i in range(50)]  # longer than the fast path's 64 bytes
    assert len(set(hash_strings(pa.array(long)).tolist())) == 50
    assert len(np.unique(hash_strings(pa.array([str(i) for i in range(200_000)])))) == 200_000


def test_integers_hash_as_their_decimal_spelling():
    as_text, _ = raw_ids(pa.array(["14102100", "7", None, ""]), "string")
    as_int, _ = raw_ids(pa.array([14102100, 7, None, None], type=pa.int64()), "string")
    assert as_text.tolist() == as_int.tolist() and as_text[2] == 0 and as_text[3] == 0
    ints, ok = raw_ids(pa.array(["12", "-3", "x", ""]), "int")
    assert (
        ok.tolist() == [True, True, False, True]
        and ints[0] == 12
        and ints[1] == np.uint64(2**64 - 3)
    )


def test_dense_transforms():
    x = np.array([0, 1, -1, 1382, np.nan])
    log = transform_dense(x, DenseFeature(kind="dense", name="a"))
    assert log.dtype == np.float32
    np.testing.assert_allclose(log, [0, np.log(2), 0, np.log(1383), 0], rtol=1e-6)
    std = transform_dense(
        x,
        DenseFeature(
            kind="dense", name="a", transform="standardize", mean=1.0, std=2.0, missing=-9
        ),
    )
    np.testing.assert_allclose(std, [-0.5, 0, -1, 690.5, -9], rtol=1e-6)


def test_missing_flags_follow_the_dense_values():
    feats = [
        DenseFeature(kind="dense", name="a", missing_flag=True),
        DenseFeature(kind="dense", name="b", transform="none", missing=-1),
        DenseFeature(kind="dense", name="c", transform="none", missing_flag=True),
    ]
    x = np.array([[np.nan, 2.0, 3.0], [1.0, np.nan, np.nan]])
    y = transform_dense_block(x, feats)  # a, b, c, then the flags of a and c
    np.testing.assert_allclose(y, [[0, 2, 3, 1, 0], [np.log(2), -1, 0, 0, 1]], rtol=1e-6)
    spec = build_spec(feats, "csv", label="y", columns=["y", "a", "b", "c"])
    assert spec.dense_width == 5 and len(spec.dense) == 3


def _spec():
    feats = [
        DenseFeature(kind="dense", name="price", transform="none"),
        CategoricalFeature(kind="categorical", name="site", rows=1000),
        CategoricalFeature(kind="categorical", name="tags", separator="|", rows=50),
        CategoricalFeature(kind="categorical", name="clicked", table="item", rows=500),
        CategoricalFeature(kind="categorical", name="candidate", table="item"),
    ]
    return build_spec(feats, "csv", label="y", table_defaults={"dim": 8, "hash_size": 10_000})


def test_featurizer_multi_hot_and_shared_tables():
    spec = _spec()
    assert [t.name for t in spec.tables] == ["site", "tags", "item"] and spec.feature_tables == [
        0,
        1,
        2,
        2,
    ]
    cols = {
        LABEL: pa.array(["1", "0", "2"]),
        "price": pa.array(["3.5", "", "1"]),
        "site": pa.array(["abc", None, "abc"]),
        "tags": pa.array(["a|b", "", "c||a"]),
        "clicked": pa.array(["i1", "i2", "i3"]),
        "candidate": pa.array(["i1", "i9", "i3"]),
    }
    parsed = Featurizer(spec)(cols, 3, np.arange(1, 4), "f.csv")
    assert parsed.num_rows == 2 and [(b.line, b.reason, b.field) for b in parsed.bad] == [
        (3, "label is not 0 or 1", "label")
    ]
    assert parsed.lengths[:, 0].tolist() == [1, 2, 1, 1] and parsed.lengths[:, 1].tolist() == [
        1,
        0,
        1,
        1,
    ]
    assert parsed.dense[:, 0].tolist() == [3.5, 0.0]
    assert parsed.values[3][0] == parsed.values[2][0]  # one id, one row of the shared table
    assert parsed.values[1].tolist() == to_rows(hash_strings(pa.array(["a", "b"])), 50).tolist()


def test_spec_round_trip_and_validation():
    spec = criteo_spec([10] * 26, [4] * 26)
    assert len(spec.columns) == 40 and spec.label == "label"
    assert FeatureSpec.model_validate_json(spec.model_dump_json()) == spec
    with pytest.raises(ValueError, match="duplicate"):
        FeatureSpec(
            dense=[DenseFeature(kind="dense", name="a")],
            categorical=[CategoricalFeature(kind="categorical", name="a", table="a")],
            tables=[TableSpec(name="a", rows=2, dim=4)],
        )
    with pytest.raises(ValueError, match="share table 'item' but set dim 8 and 16"):
        build_spec(
            [
                CategoricalFeature(kind="categorical", name="a", table="item", dim=8),
                CategoricalFeature(kind="categorical", name="b", table="item", dim=16),
            ],
            "csv",
            label="y",
        )
    with pytest.raises(ValueError, match="needs its label column"):
        build_spec([CategoricalFeature(kind="categorical", name="a")], "csv")
