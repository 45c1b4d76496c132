"""The value path (a few one-hot examples as Python values: ``dlrm_core/featurize_values.py``)
and the direct row gathers (``api/lookup.py``) give exactly what the general paths give; values
the value path does not take go to the column path, whose errors name the field."""

import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.errors import InputError
from api.featurize import featurize_instances
from api.metrics import ServingMetrics
from api.service import ModelService
from api.settings import Settings
from dlrm_core.featurize import Featurizer
from dlrm_core.featurize_values import ValueFeaturizer
from dlrm_core.ids import raw_ids
from dlrm_core.schema import CategoricalFeature, DenseFeature, build_spec
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

from .test_api import to_instance

FEATURES = [
    DenseFeature(
        kind="dense", name="price", transform="standardize", mean=2.0, std=3.0, missing=-1.0
    ),
    DenseFeature(kind="dense", name="count", transform="log1p", integer=True),
    DenseFeature(kind="dense", name="raw", transform="none", missing=7.0),
    CategoricalFeature(kind="categorical", name="user", rows=997),
    CategoricalFeature(kind="categorical", name="hour", encoding="int", rows=24),
    CategoricalFeature(kind="categorical", name="site", encoding="hex", rows=1000),
    CategoricalFeature(kind="categorical", name="item", table="items", rows=500),
    CategoricalFeature(kind="categorical", name="seen", table="items", encoding="hex"),
]
SPEC = build_spec(
    FEATURES,
    "csv",
    label="click",
    columns=["click", *(f.name for f in FEATURES)],
    table_defaults={"dim": 4, "hash_size": 1000},
)
COLUMN_PATH, VALUE_PATH = Featurizer(SPEC, with_label=False), ValueFeaturizer(SPEC)

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
hexes = st.integers(0, 2**64 - 1).map(lambda v: format(v, "x"))
category = st.one_of(
    st.none(),
    st.just(""),
    text,
    hexes,
    st.integers(-(2**63), 2**64 - 1),
    st.from_regex(r"-?[0-9]{1,20}", fullmatch=True),
    st.sampled_from(["+5", " 7", "0x1f", "007"]),
)
number = st.one_of(
    st.none(), st.integers(-(2**60), 2**60), st.floats(allow_nan=False, allow_infinity=False)
)
instance = st.fixed_dictionaries(
    {
        "dense": st.lists(number, min_size=3, max_size=3),
        "sparse": st.lists(category, min_size=5, max_size=5),
    }
)


def test_a_plus_sign_on_an_int_value_is_read():  # "+0" once raised inside arrow's cast (a 500)
    ids, ok = raw_ids(pa.array(["+0", "+12", "x"]), "int")
    assert ok.tolist() == [True, True, False] and ids.tolist()[:2] == [0, 12]


DYNAMIC = build_spec(
    [
        DenseFeature(kind="dense", name="x"),
        CategoricalFeature(kind="categorical", name="ad", encoding="hex"),
        CategoricalFeature(kind="categorical", name="n", encoding="int"),
    ],
    "csv",
    label="click",
    columns=["click", "x", "ad", "n"],
    table_defaults={"dim": 4, "hash_size": 100, "ids": "dynamic"},
)


@pytest.mark.parametrize("ad", ["8000000000000000", "8000000000000001"])
def test_no_raw_id_is_the_owner_maps_none_mark(ad):
    """The 64 bits of NO_OWNER (2^63 unsigned) key no dynamic row: read as the next id, by both
    paths."""
    from embedding_server.idmap.view import NO_OWNER

    column, values = Featurizer(DYNAMIC, with_label=False), ValueFeaturizer(DYNAMIC)
    # the value path takes it
    assert values([[1.0]], [[ad], ["5"]], 1)[1].tolist() == [NO_OWNER + 1, 5]
    for sparse in ([ad, "5"], ["0", str(NO_OWNER)]):
        inst = _positional({"dense": [1.0], "sparse": sparse})
        expected = [NO_OWNER + 1, 5] if sparse[1] == "5" else [0, NO_OWNER + 1]
        assert featurize_instances(DYNAMIC, column, [inst])[1].tolist() == expected
        assert featurize_instances(DYNAMIC, column, [inst], values)[1].tolist() == expected


def _positional(inst):
    from api.schemas import PositionalInstance

    return PositionalInstance.model_validate(inst)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(instances=st.lists(instance, min_size=1, max_size=4))
def test_value_path_gives_the_column_paths_inputs_or_defers(instances):
    try:
        parsed = [_positional(i) for i in instances]
    except ValueError:
        return  # the schema refuses it before featurising
    try:
        expected = featurize_instances(SPEC, COLUMN_PATH, parsed)
    except InputError as exc:
        with pytest.raises(InputError) as raised:  # the value path defers: the same error
            featurize_instances(SPEC, COLUMN_PATH, parsed, VALUE_PATH)
        assert raised.value.field == exc.field
        return
    got = featurize_instances(SPEC, COLUMN_PATH, parsed, VALUE_PATH)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype


def test_value_path_takes_clean_values_and_defers_others():
    dense, cats = [[1.5], [3], [None]], [["abc"], ["17"], ["1f2e"], [None], [""]]
    taken = VALUE_PATH(dense, cats, 1)
    assert taken is not None
    for a, b in zip(
        featurize_instances(
            SPEC,
            COLUMN_PATH,
            [_positional({"dense": [1.5, 3, None], "sparse": ["abc", "17", "1f2e", None, ""]})],
        ),
        taken,
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    for bad_cats in (
        [["abc"], ["+5"], ["1f"], [None], [None]],
        [["a"], ["1"], ["zz"], [None], [None]],
        [["a"], ["1"], [["1f"]], [None], [None]],
    ):
        assert VALUE_PATH(dense, bad_cats, 1) is None
    # a non-integer count: the column path says so
    assert VALUE_PATH([[1.5], [3.5], [None]], cats, 1) is None


@pytest.mark.parametrize(
    ("sparse", "field"),
    [
        (["a", "1", "zz", None, None], "instances.0.sparse.2"),
        (["a", "1.5", "1f", None, None], "instances.0.sparse.1"),
    ],
)
def test_bad_values_are_named(sparse, field):
    with pytest.raises(InputError) as raised:
        featurize_instances(
            SPEC, COLUMN_PATH, [_positional({"dense": [1, 2, 3], "sparse": sparse})], VALUE_PATH
        )
    assert raised.value.field == field
    with pytest.raises(InputError) as raised:
        featurize_instances(
            SPEC,
            COLUMN_PATH,
            [_positional({"dense": [1, 2.5, 3], "sparse": [None] * 5})],
            VALUE_PATH,
        )
    assert raised.value.field == "instances.0.dense.1"


def _general(model) -> None:
    """Send ``model``'s requests down the general paths only."""
    model.values.enabled = False
    model.mapped = None


@pytest.mark.parametrize("row_dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("kind", ["file", "redis"])
def test_direct_paths_predict_as_the_general_ones(
    kind, row_dtype, trained_criteo, criteo_sample, tmp_path, redis_server
):
    """The direct gathers (int8 / int4 rows dequantized with numpy) score as the general path
    (int8 / int4: fbgemm's IntNBit kernel), to float rounding."""
    url = (
        f"file://{tmp_path / 'store'}"
        if kind == "file"
        else redis_server.url + f"?prefix=fastpath-{row_dtype}"
    )
    publish_checkpoint(trained_criteo, open_store(url), version="v1", row_dtype=row_dtype)
    # 40: more than lookup.FEW (file store only)
    many = (criteo_sample / "test.txt").read_text().splitlines()[:40]
    lines = many[:12]
    bodies = [
        json.dumps({"instances": [to_instance(line, named=k % 2 == 1)]}).encode()
        for k, line in enumerate(lines)
    ]
    # a few at once
    bodies.append(json.dumps({"instances": [to_instance(line) for line in lines[:3]]}).encode())
    bodies.append(json.dumps({"instances": [to_instance(line) for line in many]}).encode())
    service = ModelService(open_store(url), Settings(store=url), ServingMetrics())
    service.refresh()
    lookups = service.metrics.lookups._value
    before = lookups.get()  # (the version's warm-up looked rows up too)
    fast = [service.predict_json("dlrm", b).predictions for b in bodies]
    if kind == "redis":  # the second pass: every row in the cache, gathered directly
        fast = [service.predict_json("dlrm", b).predictions for b in bodies]
    assert service.model.mapped is not None if kind == "file" else service.model.cache is not None
    counted = lookups.get() - before
    _general(service.model)
    slow = [service.predict_json("dlrm", b).predictions for b in bodies]
    # distinct rows counted alike
    assert lookups.get() - before - counted == counted / (2 if kind == "redis" else 1)
    if row_dtype in ("fp32", "fp16"):
        assert fast == slow
    else:
        np.testing.assert_allclose(sum(fast, []), sum(slow, []), rtol=1e-5, atol=1e-7)


CRITEO = build_spec(
    [
        *(DenseFeature(kind="dense", name=f"I{i}", integer=True) for i in range(1, 4)),
        CategoricalFeature(kind="categorical", name="C1", encoding="hex", rows=1000),
        CategoricalFeature(kind="categorical", name="C2", encoding="hex", rows=77),
    ],
    "criteo",
    label="label",
    columns=["label", "I1", "I2", "I3", "C1", "C2"],
    table_defaults={"dim": 4, "hash_size": 1000},
)
field = st.one_of(
    st.just(""),
    st.from_regex(r"-?[0-9]{1,17}", fullmatch=True),
    st.sampled_from(["1.5", "+3", "x", " 4"]),
    hexes,
    st.text(alphabet="0123456789abcdefgXYZ", max_size=18),
)
line = st.tuples(
    st.sampled_from(["0", "1", "", "2", None]), st.lists(field, min_size=5, max_size=5)
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(row=line)
def test_one_line_gives_the_line_parsers_inputs_or_defers(row):
    from api.featurize import featurize_lines
    from dlrm_core.formats import LineParser

    label, fields = row
    text = "\t".join(([label] if label is not None else []) + fields).encode() + b"\n"
    parser = LineParser(CRITEO)
    try:
        expected, _ = featurize_lines(
            type(
                "Columns",
                (),
                {"one_line": lambda self, t: None, "format": parser.format, "parse": parser.parse},
            )(),
            text,
            10,
        )
    except InputError as exc:
        with pytest.raises(InputError) as raised:
            featurize_lines(parser, text, 10)
        assert raised.value.field == exc.field
        return
    for a, b in zip(expected, featurize_lines(parser, text, 10)[0], strict=True):
        np.testing.assert_array_equal(a, b)
    if (
        label in ("0", "1", None)
        # dense: integers every parser reads alike, exact as float64 (at most 15 digits, as
        # LineParser's _PLAIN_INT); longer ones go to parse() by design
        and all(
            f == "" or (f.isdigit() and not f.startswith("0") and len(f) <= 15) for f in fields[:3]
        )
        and all(len(f) <= 16 and all(c in "0123456789abcdef" for c in f) for f in fields[3:])
    ):
        assert parser.one_line(text) is not None  # plain lines do take the value path
