"""Requests -> model inputs: JSON instances and delimited lines, through the training code path.

Featurising (hashing categoricals into rows, transforming dense values) is the very code the
trainer runs (``dlrm_core/featurize.py``), so a row scores the same offline and online: JSON
values become the same arrow columns a file's parser would produce (an integer of a ``hex``
feature as its hex spelling, of others as its decimal spelling; a list as a multi-hot bag),
lines go through the model's own input format.
"""

from __future__ import annotations

import difflib

import numpy as np
import pyarrow as pa

from api.errors import InputError
from dlrm_core.errors import DataError
from dlrm_core.featurize import Featurizer, ParsedBlock
from dlrm_core.featurize_values import ValueFeaturizer
from dlrm_core.formats import LineParser
from dlrm_core.schema import CategoricalFeature, FeatureSpec

ModelInputs = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(dense float32 [B, I], ids int64 of all bags, feature-major, offsets int64 [F*B + 1])."""


def _text(value, feat: CategoricalFeature) -> str:
    if isinstance(value, str):
        return value
    return format(value, "x") if feat.encoding == "hex" and value >= 0 else str(value)


def _bag(value, feat: CategoricalFeature) -> list[str]:
    """A multi-hot value as the list of its values (a delimited string split as the file's)."""
    if value is None:
        return []
    if isinstance(value, list):
        return [_text(v, feat) for v in value]
    text = _text(value, feat)
    if feat.separator is None:
        return [text]
    return text.split(feat.separator)


def _rows(spec: FeatureSpec, instances: list) -> tuple[list[list], list[list]]:
    """Named or positional instances -> per example, its dense and categorical values in spec
    order."""
    n_dense, n_cat = len(spec.dense), len(spec.categorical)
    index = None  # feature name -> (kind, position): built for the first named instance
    dense_rows, cat_rows = [], []
    for i, inst in enumerate(instances):
        if isinstance(inst, dict):  # named
            if index is None:
                index = {f.name: ("dense", j) for j, f in enumerate(spec.dense)}
                index.update({f.name: ("categorical", j) for j, f in enumerate(spec.categorical)})
            dense, cats = [None] * n_dense, [None] * n_cat
            for key, value in inst.items():
                kind = index.get(key)
                if kind is None:
                    close = difflib.get_close_matches(key, list(index), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise InputError(f"instances.{i}.{key}", f"unknown feature name{hint}")
                if kind[0] == "dense":
                    if value is not None and (
                        not isinstance(value, float | int) or isinstance(value, bool)
                    ):
                        raise InputError(
                            f"instances.{i}.{key}", "a dense feature must be a number or null"
                        )
                    dense[kind[1]] = value
                else:
                    if isinstance(value, float | bool):
                        raise InputError(
                            f"instances.{i}.{key}",
                            "a categorical must be a string, an integer, a list or null",
                        )
                    cats[kind[1]] = value
        else:
            dense, cats = inst.dense, inst.sparse
            if len(dense) != n_dense:
                raise InputError(
                    f"instances.{i}.dense", f"expected {n_dense} values, got {len(dense)}"
                )
            if len(cats) != n_cat:
                raise InputError(
                    f"instances.{i}.sparse", f"expected {n_cat} values, got {len(cats)}"
                )
        dense_rows.append(dense)
        cat_rows.append(cats)
    return dense_rows, cat_rows


_TEXT = {str, type(None)}


def columns_of(
    spec: FeatureSpec, dense: list[list], cats: list[list]
) -> tuple[dict[str, pa.Array], bool]:
    """Per feature (spec order) its values for every example -> (one arrow column per feature,
    whether any is a bag). Dense values are numbers or None; categoricals as in ``_bag``."""
    columns: dict[str, pa.Array] = {}
    for feat, values in zip(spec.dense, dense, strict=True):
        try:
            columns[feat.name] = pa.array(values, type=pa.float64())
        except pa.ArrowInvalid:  # an integer beyond 2**53 (JSON allows any): taken as its float
            columns[feat.name] = pa.array(
                [float(v) if type(v) is int else v for v in values], type=pa.float64()
            )
    any_bag = False
    for feat, values in zip(spec.categorical, cats, strict=True):
        kinds = set(map(type, values))
        if feat.separator is not None or list in kinds:
            columns[feat.name] = pa.array(
                [_bag(v, feat) for v in values], type=pa.list_(pa.string())
            )
            any_bag = True
        elif kinds <= _TEXT:  # strings and nulls as they are (one C call, no per-value Python)
            columns[feat.name] = pa.array(values, type=pa.string())
        else:
            columns[feat.name] = pa.array(
                [None if v is None else _text(v, feat) for v in values], type=pa.string()
            )
    return columns, any_bag


def featurize_columns(
    featurizer: Featurizer, columns: dict[str, pa.Array], any_bag: bool, n: int, where
) -> ModelInputs:
    """Arrow columns of ``n`` examples -> model inputs; the first bad value is a 422 at the
    field ``where(example index, feature name or None)`` names."""
    parsed = featurizer(
        columns,
        n,
        np.arange(1, n + 1, dtype=np.int64),
        "request",
        multi_hot=any_bag or featurizer.multi_hot,
    )
    if parsed.bad:
        b = parsed.bad[0]
        raise InputError(where(b.line - 1, b.field), b.reason)
    return parsed.model_inputs()


def featurize_instances(
    spec: FeatureSpec,
    featurizer: Featurizer,
    instances: list,
    values: ValueFeaturizer | None = None,
) -> ModelInputs:
    """JSON instances -> model inputs; a bad value is a 422 naming ``instances.<i>.<feature>``.
    A few one-hot instances go through ``values`` (the value path) when given, when it takes
    them."""
    dense_rows, cat_rows = _rows(spec, instances)
    dense = _transposed(dense_rows, len(spec.dense))  # per feature, its values of every example
    cats = _transposed(cat_rows, len(spec.categorical))
    if values is not None:
        inputs = values(dense, cats, len(instances))
        if inputs is not None:
            return inputs
    columns, any_bag = columns_of(spec, dense, cats)
    return featurize_columns(
        featurizer,
        columns,
        any_bag,
        len(instances),
        lambda i, feature: _field(spec, instances, i, feature),
    )


def _transposed(rows: list[list], width: int) -> list[list]:
    """Per example its ``width`` values -> per position its values of every example."""
    return (
        [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]
    )


def _field(spec: FeatureSpec, instances: list, i: int, feature: str | None) -> str:
    """Where a bad value is: ``instances.3.site_id``, or ``instances.3.sparse.5`` when
    positional."""
    if feature is None:
        return f"instances.{i}"
    if isinstance(instances[i], dict):
        return f"instances.{i}.{feature}"
    if feature in spec.dense_names:
        return f"instances.{i}.dense.{spec.dense_names.index(feature)}"
    return f"instances.{i}.sparse.{spec.sparse_names.index(feature)}"


def featurize_lines(parser: LineParser, text: bytes, max_lines: int) -> tuple[ModelInputs, int]:
    """Lines in the model's input layout -> (model inputs, rows); a bad line is a 422 naming it."""
    single = parser.one_line(text)  # one plain line: the value path
    if single is not None:
        return single, 1
    if text.count(b"\n") > max_lines + 1:
        raise InputError("body", f"more than {max_lines} lines, at most {max_lines} per request")
    if parser.format.quoted and b'"' in text:
        for n, line in enumerate(text.split(b"\n"), 1):
            # "" escapes a quote: an odd count leaves one open at the break
            if line.count(b'"') % 2:
                raise InputError(
                    f"line {n}",
                    "a quoted value runs past the end of the line: line breaks "
                    "inside quotes are not taken here, nor in training files",
                )
    try:
        parsed: ParsedBlock = parser.parse(text, "body")
    except DataError as exc:
        message = str(exc)
        field, _, reason = message.partition(": ")
        raise InputError(field if field.startswith("line") else "body", reason or message) from None
    if parsed.bad:
        b = parsed.bad[0]
        raise InputError(f"line {b.line}", b.reason)
    return parsed.model_inputs(), parsed.num_rows
