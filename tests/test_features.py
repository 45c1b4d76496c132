import numpy as np
import pyarrow as pa
import pytest

from dlrm_core.features import (
    FeatureSpec,
    TableSpec,
    criteo_spec,
    hash_to_rows,
    hex_to_uint64,
    transform_dense,
)


def test_hex_parsing_matches_python_int():
    rng = np.random.default_rng(0)
    values = [f"{v:08x}" for v in rng.integers(0, 2**32, 1000)] + ["0", "F", "aBcD", "ffffffffffffffff"]
    ints, ok = hex_to_uint64(pa.array(values))
    assert ok.all()
    assert [int(x) for x in ints] == [int(v, 16) for v in values]


def test_hex_missing_and_invalid():
    ints, ok = hex_to_uint64(pa.array(["", None, "xyz1", "12345678901234567", "0a", "1 2"]))
    assert ok.tolist() == [True, True, False, False, True, False]
    assert ints[0] == 0 and ints[1] == 0 and ints[4] == 10


def test_hex_on_sliced_array():
    arr = pa.array(["ff", "10", "a", "b"]).slice(1, 2)
    ints, ok = hex_to_uint64(arr)
    assert ints.tolist() == [16, 10] and ok.all()


@pytest.mark.parametrize("rows", [1, 7, 100_000, 10_000_000])
def test_hash_is_int_hex_mod_rows(rows):
    values = ["68fd1e64", "80e26c9b", "ffffffff", "0", "deadbeefcafebabe"]
    ints, _ = hex_to_uint64(pa.array(values))
    assert hash_to_rows(ints, rows).tolist() == [int(v, 16) % rows for v in values]
    assert hash_to_rows(ints, rows).dtype == np.int64


def test_dense_transform():
    x = np.array([0, 1, -1, 1382, np.nan])
    out = transform_dense(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0, np.log(2), 0, np.log(1383), 0], rtol=1e-6)


def test_spec_round_trip_and_validation():
    spec = criteo_spec([10] * 26, [4] * 26)
    assert spec.num_columns == 40
    assert FeatureSpec.model_validate_json(spec.model_dump_json()) == spec
    with pytest.raises(ValueError, match="duplicate"):
        FeatureSpec(dense=["a"], tables=[TableSpec(name="a", rows=2, dim=4)])
