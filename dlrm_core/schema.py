"""The feature schema: which columns of the input are the label, the dense features and the
categorical features, and how each becomes a model input.

A config declares it (``[[features]]``, with top-level ``label``, ``ignore``, ``format``);
``Config.feature_spec()`` resolves it into a :class:`FeatureSpec` (tables sized, shared tables
checked), which travels with checkpoints and published models, so that serving featurises
requests exactly as training did. The Criteo layout is one such schema, the default
(:func:`criteo_features`).

Columns are named (``"site_id"``, a header name) or numbered (``0``, the first column).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dlrm_core.config import Section

Column = str | int
"""A column of the input: its header name, or its 0-based position."""
FormatName = Literal["criteo", "csv", "tsv", "parquet"]


class DenseFeature(Section):
    """A numeric feature: one float per example."""

    kind: Literal["dense"]
    """``dense``."""
    name: str = Field(min_length=1, max_length=64)
    """Feature name (requests name it; default column)."""
    column: Column | None = None
    """Input column (header name or 0-based index); default: the feature's name."""
    transform: Literal["log1p", "standardize", "none"] = "log1p"
    """log1p: log(1 + max(x, 0)), for counts (Criteo's I1..I13); standardize: (x - mean) / std
    with the statistics below (measured on the training data when absent); none: x as it is."""
    missing: float = 0.0
    """The model input where the value is missing (empty cell, null), after the transform."""
    missing_flag: bool = False
    """Give the model one more input for this feature: 1 where the value is missing, else 0, so
    that a gap has its own effect rather than reading as the value ``missing`` (scikit-learn's
    ``add_indicator``; LightGBM and CatBoost treat a gap as a value of its own). ``dlrm data
    schema --missing-flags`` sets it on every column with gaps."""
    integer: bool = False
    """Values must be integers (a non-integer is a malformed line), as Criteo's counts are."""
    mean: float | None = None
    """standardize: the mean of the raw values (filled from the training data when absent)."""
    std: float | None = Field(default=None, gt=0)
    """standardize: the standard deviation of the raw values (filled from the data when absent)."""


class CategoricalFeature(Section):
    """A categorical feature: one id (or a bag of ids, multi-hot) per example, looked up in an
    embedding table."""

    kind: Literal["categorical"]
    """``categorical``."""
    name: str = Field(min_length=1, max_length=64)
    """Feature name (requests name it; default column and table)."""
    column: Column | None = None
    """Input column (header name or 0-based index); default: the feature's name."""
    encoding: Literal["string", "int", "hex"] = "string"
    """How a value becomes a 64-bit id: string (a stable 64-bit hash of its UTF-8 bytes; an
    integer is hashed as its decimal spelling), int (the value of a decimal integer) or hex (the
    value of up to 16 hex digits, Criteo's C1..C26). The row is id % rows."""
    table: str | None = None
    """Embedding table; several features may share one (a clicked and a candidate item);
    default: the feature's own table, named after it."""
    rows: int | None = Field(default=None, gt=0)
    """Rows of the table (its hash size), capped at embedding.hash_size; default: hash_size."""
    dim: int | None = Field(default=None, gt=0)
    """Embedding dim of the table; default: embedding.dim."""
    pooling: Literal["sum", "mean"] | None = None
    """How a multi-hot bag's rows are pooled; default: embedding.pooling."""
    separator: str | None = Field(default=None, min_length=1)
    """Multi-hot: the separator of several values in one cell (``|``); None: one value per cell.
    Parquet list columns and JSON lists are multi-hot as they are."""


Feature = Annotated[DenseFeature | CategoricalFeature, Field(discriminator="kind")]


IdMode = Literal["hashed", "dynamic"]
EvictPolicy = Literal["lru", "lfu", "ttl"]


class DynamicIds(BaseModel):
    """How a ``dynamic`` table gives rows to raw 64-bit ids (``embedding_server/idmap/``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    admit_after: int = Field(default=1, ge=1)
    """Occurrences (in training lookups, counted by a count-min sketch) before an id gets a row
    of its own; until then it reads and trains the table's shared default row (row 0)."""
    evict: EvictPolicy = "lru"
    """When every row is taken: lru frees the least recently used rows, lfu the least used
    (ties: least recent), ttl only rows unused for ttl_steps (none left: new ids wait)."""
    ttl_steps: int = Field(default=10_000, ge=1)
    """ttl: training lookups after which an unused id loses its row."""
    shared_rows: float = Field(default=0.0, ge=0, lt=1)
    """Fraction of the table's rows kept as hashed shared rows: an id without a row of its own
    (not admitted yet, evicted, or unseen at evaluation and serving) reads and trains shared row
    hash(id) % S, S = max(1, int(shared_rows * rows)); 0: one shared row (row 0). The rest are
    the capacity for admitted ids. The default here is what a spec written before this field
    existed means (published versions, checkpoints); configs set ``[embedding] shared_rows``,
    0.1 unless said."""
    start_from_shared: bool = False
    """An admitted id's fresh row starts as a copy of its shared row (what the id read until
    then); False: uniform(+-init bound) from a hash of (seed, table, id). Its optimizer state
    starts fresh either way. The default is that of specs written before this field existed;
    configs set ``[embedding] start_from_shared``, true unless said."""


def shared_row_count(rows: int, cfg: DynamicIds) -> int:
    """S, the shared rows of a dynamic table of ``rows`` rows: max(1, int(shared_rows * rows)),
    leaving at least one row for admitted ids."""
    return max(1, min(int(cfg.shared_rows * rows), rows - 1))


class TableSpec(BaseModel):
    """One embedding table, looked up by one or more categorical features."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """Table name (by default the name of its only feature)."""
    rows: int = Field(gt=0)
    """Number of rows: ids are hashed into ``[0, rows)``."""
    dim: int = Field(gt=0)
    """Embedding dimension of the table."""
    pooling: Literal["sum", "mean"] = "sum"
    """How the rows of a multi-hot bag are pooled into one vector."""
    dynamic: DynamicIds | None = None
    """None: hashed ids (row = id % rows); else raw 64-bit ids, each admitted id its own row
    (rows are the capacity), the rest sharing the first :attr:`shared_row_count` rows."""

    @property
    def shared_row_count(self) -> int:
        """S of a dynamic table: rows 0..S-1 are shared by ids without a row of their own (0:
        hashed)."""
        return 0 if self.dynamic is None else shared_row_count(self.rows, self.dynamic)

    @property
    def ids(self) -> IdMode:
        """``hashed`` or ``dynamic``."""
        return "hashed" if self.dynamic is None else "dynamic"

    @property
    def num_bytes(self) -> int:
        """Bytes of the fp32 weights (optimizer state not included)."""
        return self.rows * self.dim * 4


class FeatureSpec(BaseModel):
    """The model's input schema, resolved: label, features, tables and the input format.

    Shape letters: I = ``dense_width`` model inputs of the ``len(dense)`` dense features (one
    each, plus one per ``missing_flag``), F = ``len(categorical)`` categorical features, each
    looking up table ``tables[feature_tables[f]]``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: FormatName = "criteo"
    """Input format of the training files (and of ``:predict_tsv`` lines)."""
    label: Column = 0
    """The label column (0/1)."""
    ignore: list[Column] = []
    """Columns that are not features (ids, timestamps, ...)."""
    columns: list[str] | None = None
    """The input's column names in order (a header, or given for headerless files)."""
    header: bool = False
    """Delimited text: the first line of each file names the columns."""
    delimiter: str = "\t"
    """Delimited text: the field separator."""
    dense: list[DenseFeature] = []
    """Dense features, in model order."""
    categorical: list[CategoricalFeature] = []
    """Categorical features, in model order; each has its ``table`` set."""
    tables: list[TableSpec] = []
    """The embedding tables, in order of first use."""

    @model_validator(mode="after")
    def _check(self) -> FeatureSpec:
        names = [f.name for f in self.dense] + [f.name for f in self.categorical]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate feature names: {dup}")
        known = {t.name for t in self.tables}
        for f in self.categorical:
            if f.table not in known:
                raise ValueError(f"feature {f.name}: table {f.table!r} is not among the tables")
        return self

    @property
    def dense_names(self) -> list[str]:
        return [f.name for f in self.dense]

    @property
    def dense_width(self) -> int:
        """I, the dense model inputs: one per dense feature, then one per ``missing_flag``."""
        return len(self.dense) + sum(f.missing_flag for f in self.dense)

    @property
    def sparse_names(self) -> list[str]:
        """Names of the categorical features, in model order."""
        return [f.name for f in self.categorical]

    @property
    def feature_tables(self) -> list[int]:
        """Index into ``tables`` of each categorical feature's table."""
        index = {t.name: i for i, t in enumerate(self.tables)}
        return [index[f.table] for f in self.categorical]

    @property
    def feature_dims(self) -> list[int]:
        """D of each categorical feature (its table's dim)."""
        return [self.tables[t].dim for t in self.feature_tables]

    def table_of(self, feature: int) -> TableSpec:
        return self.tables[self.feature_tables[feature]]

    @property
    def shares_tables(self) -> bool:
        return len(self.tables) != len(self.categorical)


# -- the Criteo layout -----------------------------------------------------------------------------

CRITEO_DENSE = [f"I{i + 1}" for i in range(13)]
CRITEO_SPARSE = [f"C{i + 1}" for i in range(26)]
CRITEO_COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
"""A Criteo line: the label, 13 integer counts and 26 hex categoricals, tab-separated, no header."""


def criteo_features(separator: str | None = None) -> list[DenseFeature | CategoricalFeature]:
    """The Criteo Kaggle / Terabyte schema: I1..I13 as log1p of integer counts, C1..C26 as hex."""
    dense = [DenseFeature(kind="dense", name=n, integer=True) for n in CRITEO_DENSE]
    cats = [
        CategoricalFeature(kind="categorical", name=n, encoding="hex", separator=separator)
        for n in CRITEO_SPARSE
    ]
    return [*dense, *cats]


def criteo_spec(
    rows: list[int], dims: list[int], pooling: str = "sum", separator: str | None = None
) -> FeatureSpec:
    """The Criteo schema with the given table rows and dims (26 each)."""
    if len(rows) != 26 or len(dims) != 26:
        raise ValueError("the Criteo schema has 26 sparse features")
    feats = criteo_features(separator)
    tables = [
        TableSpec(name=n, rows=r, dim=d, pooling=pooling)
        for n, r, d in zip(CRITEO_SPARSE, rows, dims, strict=True)
    ]
    return FeatureSpec(
        format="criteo",
        label="label",
        columns=CRITEO_COLUMNS,
        header=False,
        delimiter="\t",
        dense=[f for f in feats if isinstance(f, DenseFeature)],
        categorical=[
            f.model_copy(update={"table": f.name})
            for f in feats
            if isinstance(f, CategoricalFeature)
        ],
        tables=tables,
    )


# -- resolving a declared schema -------------------------------------------------------------------

_ID_SETTINGS = ("admit_after", "evict", "ttl_steps", "shared_rows", "start_from_shared")


def _dynamic_ids(defaults: dict, override: dict) -> DynamicIds | None:
    """A table's id mode: its override's settings over the [embedding] defaults."""
    mode = override.get("ids") or defaults.get("ids") or "hashed"
    if mode == "hashed":
        return None
    settings = {k: override.get(k, defaults.get(k)) for k in _ID_SETTINGS}
    return DynamicIds(**{k: v for k, v in settings.items() if v is not None})


FORMAT_DEFAULTS = {
    "criteo": (False, "\t"),
    "csv": (True, ","),
    "tsv": (True, "\t"),
    "parquet": (False, "\t"),
}
"""(header, delimiter) of each format unless set."""


def build_spec(
    features: list[DenseFeature | CategoricalFeature],
    format: FormatName = "criteo",
    label: Column | None = None,
    ignore: list[Column] | None = None,
    columns: list[str] | None = None,
    header: bool | None = None,
    delimiter: str | None = None,
    table_defaults: dict | None = None,
    table_overrides: dict[str, dict] | None = None,
    force_dim: int | None = None,
) -> FeatureSpec:
    """Resolve a declared schema: fill the format's defaults, size every table, check shared tables.

    Args:
        features: the ``[[features]]`` list.
        table_defaults: ``dim``, ``hash_size``, ``pooling``, ``ids``, ``admit_after``, ``evict``,
            ``ttl_steps``, ``shared_rows``, ``start_from_shared`` for tables that do not say.
        table_overrides: per table name, ``rows`` / ``dim`` / ``pooling`` / the id settings
            (``[[embedding.tables]]``).
        force_dim: every table's dim (1 for the logistic-regression baseline).

    Raises:
        ValueError: naming the feature or table (the config loader reports it as a ConfigError).
    """
    defaults = {"dim": 16, "hash_size": 1_000_000, "pooling": "sum", **(table_defaults or {})}
    overrides = table_overrides or {}
    dense = [f for f in features if isinstance(f, DenseFeature)]
    cats = [f for f in features if isinstance(f, CategoricalFeature)]
    tables: dict[str, dict] = {}
    owner: dict[str, str] = {}
    for f in cats:
        name = f.table or f.name
        mine = {
            k: v
            for k, v in (("rows", f.rows), ("dim", f.dim), ("pooling", f.pooling))
            if v is not None
        }
        if name in tables:
            for key, value in mine.items():
                if tables[name].get(key, value) != value:
                    raise ValueError(
                        f"features {owner[name]!r} and {f.name!r} share table {name!r} but set "
                        f"{key} {tables[name][key]!r} and {value!r}"
                    )
            tables[name].update(mine)
        else:
            tables[name], owner[name] = mine, f.name
    unknown = sorted(set(overrides) - set(tables))
    if unknown:
        raise ValueError(
            f"embedding.tables: unknown table {unknown[0]!r} (tables are "
            f"{', '.join(list(tables)[:8])}"
            f"{' ...' if len(tables) > 8 else ''})"
        )
    specs = []
    for name, t in tables.items():
        o = overrides.get(name, {})
        rows = o.get("rows") or t.get("rows")
        rows = min(rows, defaults["hash_size"]) if rows else defaults["hash_size"]
        dim = force_dim or o.get("dim") or t.get("dim") or defaults["dim"]
        specs.append(
            TableSpec(
                name=name,
                rows=rows,
                dim=dim,
                pooling=o.get("pooling") or t.get("pooling") or defaults["pooling"],
                dynamic=_dynamic_ids(defaults, o),
            )
        )
    if format == "criteo" and columns is None and label is None:
        columns, label = CRITEO_COLUMNS, "label"
    if label is None:
        raise ValueError(
            f'label: a {format} input needs its label column (label = "click", or a column number)'
        )
    head, delim = FORMAT_DEFAULTS[format]
    return FeatureSpec(
        format=format,
        label=label,
        ignore=list(ignore or []),
        columns=columns,
        header=head if header is None else header,
        delimiter=delimiter or delim,
        dense=dense,
        categorical=[f.model_copy(update={"table": f.table or f.name}) for f in cats],
        tables=specs,
    )
