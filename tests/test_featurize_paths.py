"""One featurising code path: a row gives identical ids and dense values whether the trainer reads
it from a file, a request sends it as a CSV line (`:predict_tsv`) or as JSON (`:predict`)."""

import csv
import io

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.featurize import featurize_instances, featurize_lines
from dlrm_core.featurize import Featurizer
from dlrm_core.formats import InputReader, LineParser
from dlrm_core.schema import CategoricalFeature, DenseFeature, build_spec

FEATURES = [
    DenseFeature(
        kind="dense",
        name="price",
        transform="standardize",
        mean=2.0,
        std=3.0,
        missing=-1.0,
        missing_flag=True,
    ),
    DenseFeature(kind="dense", name="count", transform="log1p"),
    CategoricalFeature(kind="categorical", name="user", rows=997),
    CategoricalFeature(kind="categorical", name="hour", encoding="int", rows=24),
    CategoricalFeature(kind="categorical", name="tags", separator="|", rows=101, pooling="mean"),
    CategoricalFeature(kind="categorical", name="item", table="items", rows=500),
    CategoricalFeature(kind="categorical", name="seen", table="items", separator="|"),
]
COLUMNS = ["row_id", "user", "click", "price", "hour", "count", "tags", "item", "seen"]
SPEC = build_spec(
    FEATURES,
    "csv",
    label="click",
    ignore=["row_id"],
    columns=COLUMNS,
    table_defaults={"dim": 4, "hash_size": 1000},
)

token = (
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters='|"\n\r,'),
        min_size=1,
        max_size=12,
    )
    .map(str.strip)
    .filter(bool)
)
ident = st.one_of(token, st.integers(0, 10**12))
row = st.fixed_dictionaries(
    {
        "user": st.one_of(st.none(), ident),
        "price": st.one_of(
            st.none(), st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3))
        ),
        "hour": st.one_of(st.none(), st.integers(0, 23)),
        "count": st.one_of(st.none(), st.integers(0, 10**6)),
        "tags": st.lists(token, max_size=4),
        "item": st.one_of(st.none(), ident),
        "seen": st.lists(ident, max_size=3),
    }
)


def to_csv(rows) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for i, r in enumerate(rows):
        w.writerow(
            [
                i,
                "" if r["user"] is None else r["user"],
                i % 2,
                "" if r["price"] is None else r["price"],
                "" if r["hour"] is None else r["hour"],
                "" if r["count"] is None else r["count"],
                "|".join(r["tags"]),
                "" if r["item"] is None else r["item"],
                "|".join(map(str, r["seen"])),
            ]
        )
    return out.getvalue()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(row, min_size=1, max_size=12))
def test_file_csv_line_and_json_featurise_identically(rows, tmp_path_factory):
    text = to_csv(rows)
    path = tmp_path_factory.mktemp("rows") / "data.csv"
    path.write_text(",".join(COLUMNS) + "\n" + text)
    reader = InputReader(SPEC, [path])
    (block,) = list(reader.blocks(0, 1 << 20))
    from_file = reader.parse(block)
    assert not from_file.bad and from_file.num_rows == len(rows)
    file_inputs = from_file.model_inputs()
    # The file's bag layout (multi-hot features present) is what both request paths produce.
    line_inputs, n = featurize_lines(LineParser(SPEC), text.encode(), 100)
    json_inputs = featurize_instances(
        SPEC, Featurizer(SPEC, with_label=False), [{k: v for k, v in r.items()} for r in rows]
    )
    assert n == len(rows)
    for got in (line_inputs, json_inputs):
        for a, b in zip(file_inputs, got, strict=True):
            np.testing.assert_array_equal(a, b)
