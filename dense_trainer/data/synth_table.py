"""``dlrm data synth --format csv|tsv|parquet``: a user's own table drawn from a planted teacher.

Where ``synth.py`` writes the Criteo layout, this writes a "bring your own data" table that looks
like a real export, so that the schema-driven path (``[[features]]``) can be measured against a
known Bayes-optimal AUC. Its columns, in order:

    row_id     int, unique per row (not a feature: ``ignore``)
    user       "u1234": ~20k users, Zipf
    hour       0..23, a daily cycle
    ad         "ad567": ~5k ads, Zipf
    click      the 0/1 label, in the middle of the row
    price      float, ~15% empty
    clicks_7d  non-negative integer count, log-normal, ~20% empty
    tags       0..4 tags from 200, ``|``-separated (a Parquet list<string>); a few tag names hold
               a comma or a double quote, so that CSV quoting is exercised
    device     integer code, one of 30 (1001, 1007, ...)
    score      float around 50 (std 12), no gaps: worth standardizing

The teacher (seeded): logit = intercept + per-value biases of user, ad, hour, device and each tag
of the bag + rank-``RANK`` latent interactions user x ad, ad x hour, device x (sum of the tags) +
smooth functions of price and clicks_7d (a missing value has its own effect) + a small linear
term in score; the intercept is solved for the target click rate. Labels are
Bernoulli(sigmoid(logit)); ``bayes.json`` holds the AUC and log loss of the true probabilities on
the test split. ``schema.toml`` is the hand-written config that reads the files. Rows are drawn
and written in chunks of ``CHUNK_ROWS`` (one Parquet row group each), so any size fits in
memory; the same seed gives the same rows in every format. Popularity, calibration, labels,
chunked writing and the Bayes record are the teacher's, shared with the Criteo layout
(``teacher.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dense_trainer.data.teacher import bayes_record, draw, solve_intercept, write_split, zipf_cdf

COLUMNS = ["row_id", "user", "hour", "ad", "click", "price", "clicks_7d", "tags", "device", "score"]
FORMATS = ("csv", "tsv", "parquet")
DELIMITERS = {"csv": ",", "tsv": "\t"}
CHUNK_ROWS = 65_536
"""Rows drawn and written at once: one Parquet row group."""
NUM_USERS, NUM_ADS, NUM_TAGS, NUM_DEVICES = 20_000, 5_000, 200, 30
MAX_TAGS = 4
TAG_COUNT_P = [0.2, 0.3, 0.25, 0.15, 0.1]
"""Probability of 0, 1, ..., 4 tags drawn for a row (repeats are dropped)."""
ODD_TAGS = {0: "food, drink", 3: "home, garden", 9: '24" screens'}
"""Tag names that CSV must quote, at popular ranks so that small files hold them."""
RANK = 4
PRICE_MISSING, CLICKS_MISSING = 0.15, 0.20
ROW_ID_BASE = 1_000_000_000


@dataclass
class Teacher:
    """The planted model's parameters (V: a vocabulary, R: ``RANK``)."""

    user_cdf: np.ndarray  # float [V_user], Zipf CDF over popularity ranks
    user_of_rank: np.ndarray  # int [V_user], a permutation: popular users are not small ids
    ad_cdf: np.ndarray
    ad_of_rank: np.ndarray
    tag_cdf: np.ndarray
    tag_of_rank: np.ndarray
    hour_p: np.ndarray  # float [24]
    device_p: np.ndarray  # float [30]
    device_codes: np.ndarray  # int [30], the codes written
    user_bias: np.ndarray  # float [V_user]
    ad_bias: np.ndarray
    hour_bias: np.ndarray
    device_bias: np.ndarray
    tag_bias: np.ndarray
    user_lat: np.ndarray  # float [V_user, R]
    ad_lat: np.ndarray
    hour_lat: np.ndarray
    device_lat: np.ndarray
    tag_lat: np.ndarray
    pair_w: np.ndarray  # float [3]: user x ad, ad x hour, device x tags
    intercept: float = 0.0


def make_teacher(seed: int, zipf: float = 1.1) -> Teacher:
    rng = np.random.default_rng([seed, 0])
    hours = np.arange(24)
    hour_p = 1.0 + 0.7 * np.sin(2 * np.pi * (hours - 9) / 24)  # quiet at night, busy in the evening

    def lat(v: int) -> np.ndarray:
        return rng.normal(0, 1 / np.sqrt(RANK), (v, RANK))

    return Teacher(
        user_cdf=zipf_cdf(NUM_USERS, zipf),
        user_of_rank=rng.permutation(NUM_USERS),
        ad_cdf=zipf_cdf(NUM_ADS, zipf),
        ad_of_rank=rng.permutation(NUM_ADS),
        tag_cdf=zipf_cdf(NUM_TAGS, 0.8),
        tag_of_rank=np.arange(NUM_TAGS),  # ODD_TAGS stay popular
        hour_p=hour_p / hour_p.sum(),
        device_p=zipf_cdf(NUM_DEVICES, 1.3) - np.r_[0, zipf_cdf(NUM_DEVICES, 1.3)[:-1]],
        device_codes=np.sort(rng.choice(np.arange(1001, 2000), NUM_DEVICES, replace=False)),
        user_bias=rng.normal(0, 0.5, NUM_USERS),
        ad_bias=rng.normal(0, 0.5, NUM_ADS),
        hour_bias=rng.normal(0, 0.25, 24),
        device_bias=rng.normal(0, 0.25, NUM_DEVICES),
        tag_bias=rng.normal(0, 0.2, NUM_TAGS),
        user_lat=lat(NUM_USERS),
        ad_lat=lat(NUM_ADS),
        hour_lat=lat(24),
        device_lat=lat(NUM_DEVICES),
        tag_lat=lat(NUM_TAGS),
        pair_w=np.array([0.8, 0.4, 0.4]),
    )


@dataclass
class Rows:
    """n drawn rows, as indices and raw values (before any file format)."""

    user: np.ndarray  # int [n], index into the users
    ad: np.ndarray
    hour: np.ndarray
    device: np.ndarray  # int [n], index into device_codes
    tags: np.ndarray  # int [n, MAX_TAGS], tag indices, -1 past the row's bag
    price: np.ndarray  # float [n], NaN where empty
    clicks: np.ndarray  # int [n], -1 where empty
    score: np.ndarray  # float [n]
    logit: np.ndarray  # float [n]


def _sample(t: Teacher, n: int, rng: np.random.Generator) -> Rows:
    user = draw(t.user_cdf, t.user_of_rank, n, rng)
    ad = draw(t.ad_cdf, t.ad_of_rank, n, rng)
    hour = rng.choice(24, n, p=t.hour_p)
    device = rng.choice(NUM_DEVICES, n, p=t.device_p)
    tags = draw(t.tag_cdf, t.tag_of_rank, (n, MAX_TAGS), rng)
    count = rng.choice(MAX_TAGS + 1, n, p=TAG_COUNT_P)
    keep = np.arange(MAX_TAGS)[None, :] < count[:, None]
    for j in range(1, MAX_TAGS):  # a repeated tag is dropped: bags hold distinct tags
        keep[:, j] &= ~(tags[:, :j] == tags[:, j : j + 1]).any(axis=1)
    order = np.argsort(~keep, axis=1, kind="stable")  # kept tags first, in drawn order
    tags = np.where(np.take_along_axis(keep, order, 1), np.take_along_axis(tags, order, 1), -1)
    price = np.round(np.exp(rng.normal(3.0, 0.8, n)), 2)
    price[rng.random(n) < PRICE_MISSING] = np.nan
    clicks = np.floor(np.exp(rng.normal(1.0, 1.2, n))).astype(np.int64)
    clicks[rng.random(n) < CLICKS_MISSING] = -1
    score = np.round(rng.normal(50.0, 12.0, n), 3)

    valid = tags >= 0
    tag_idx = np.maximum(tags, 0)
    tag_bias = (t.tag_bias[tag_idx] * valid).sum(axis=1)
    tag_sum = (t.tag_lat[tag_idx] * valid[:, :, None]).sum(axis=1)  # n x R
    z_price = (np.log(np.nan_to_num(price, nan=1.0)) - 3.0) / 0.8
    f_price = np.where(np.isnan(price), 0.15, -0.6 * np.tanh(z_price))
    f_clicks = np.where(
        clicks < 0, -0.2, 0.9 * (1 - np.exp(-np.log1p(np.maximum(clicks, 0)) / 1.5)) - 0.45
    )
    w = t.pair_w
    logit = (
        t.intercept
        + t.user_bias[user]
        + t.ad_bias[ad]
        + t.hour_bias[hour]
        + t.device_bias[device]
        + tag_bias
        + w[0] * np.einsum("nr,nr->n", t.user_lat[user], t.ad_lat[ad])
        + w[1] * np.einsum("nr,nr->n", t.ad_lat[ad], t.hour_lat[hour])
        + w[2] * np.einsum("nr,nr->n", t.device_lat[device], tag_sum)
        + f_price
        + f_clicks
        + 0.3 * (score - 50.0) / 12.0
    )
    return Rows(user, ad, hour, device, tags, price, clicks, score, logit)


def _calibrate(t: Teacher, ctr: float, seed: int) -> None:
    """Solve the intercept so that the mean click probability is ``ctr``."""
    t.intercept = solve_intercept(_sample(t, 50_000, np.random.default_rng([seed, 7])).logit, ctr)


# -- rows -> an arrow table -> a file --------------------------------------------------------------


class Names:
    """The strings written for users, ads and tags (built once)."""

    def __init__(self) -> None:
        self.user = pa.array([f"u{i + 1}" for i in range(NUM_USERS)])
        self.ad = pa.array([f"ad{i + 1}" for i in range(NUM_ADS)])
        self.tag = pa.array([ODD_TAGS.get(i, f"tag{i + 1}") for i in range(NUM_TAGS)])


def _table(rows: Rows, labels: np.ndarray, first_id: int, t: Teacher, names: Names) -> pa.Table:
    n = len(labels)
    valid = rows.tags >= 0
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    tags = pa.ListArray.from_arrays(pa.array(offsets), names.tag.take(pa.array(rows.tags[valid])))
    cols = {
        "row_id": pa.array(ROW_ID_BASE + first_id + np.arange(n, dtype=np.int64)),
        "user": names.user.take(pa.array(rows.user)),
        "hour": pa.array(rows.hour.astype(np.int64)),
        "ad": names.ad.take(pa.array(rows.ad)),
        "click": pa.array(labels.astype(np.int64)),
        "price": pa.array(rows.price, mask=np.isnan(rows.price)),
        "clicks_7d": pa.array(rows.clicks, mask=rows.clicks < 0),
        "tags": tags,
        "device": pa.array(t.device_codes[rows.device].astype(np.int64)),
        "score": pa.array(rows.score),
    }
    return pa.Table.from_pydict(cols)


def _quote(values: pa.Array, delimiter: str) -> pa.Array:
    """Minimal CSV quoting: a value holding the delimiter, a quote or a line break is quoted,
    its quotes doubled (what Python's csv module and pandas write)."""
    needs = pc.fill_null(pc.match_substring_regex(values, f'[{delimiter}"\r\n]'), False)
    if not pc.any(needs).as_py():
        return values
    quoted = pc.binary_join_element_wise('"', pc.replace_substring(values, '"', '""'), '"', "")
    return pc.if_else(needs, quoted, values)


def _text(table: pa.Table, delimiter: str) -> bytes:
    """The table's rows as delimited lines; empty cells for nulls, multi-hot cells ``|``-joined."""
    cells = []
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type):
            col = _quote(pc.binary_join(col, "|"), delimiter)
        elif pa.types.is_string(col.type):
            col = _quote(col, delimiter)
        else:
            col = pc.cast(col, pa.string())
        cells.append(col)
    lines = pc.binary_join_element_wise(
        *cells, delimiter, null_handling="replace", null_replacement=""
    )
    lines = pc.binary_join_element_wise(lines, "", "\n")  # each line + "\n"
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32)[
        lines.offset : lines.offset + len(lines) + 1
    ]
    return lines.buffers()[2].to_pybytes()[offsets[0] : offsets[-1]]


class _TextSink:
    """Delimited text: a header line, then each chunk's lines."""

    def __init__(self, path: Path, delimiter: str) -> None:
        self.delimiter = delimiter
        self.file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.file.write((delimiter.join(COLUMNS) + "\n").encode())

    def write(self, table: pa.Table) -> None:
        self.file.write(_text(table, self.delimiter))

    def close(self) -> None:
        self.file.close()


class _ParquetSink:
    """Parquet: one row group per chunk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(str(self.path), table.schema)
        self.writer.write_table(table, row_group_size=CHUNK_ROWS)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _write_split(
    t: Teacher,
    names: Names,
    path: Path,
    fmt: str,
    rows: int,
    first_id: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Write ``rows`` rows to ``path``; return (true probabilities, labels)."""

    def sample(n: int, rng: np.random.Generator):
        drawn = _sample(t, n, rng)
        return drawn, drawn.logit

    return write_split(
        sample,
        lambda drawn, labels, start: _table(drawn, labels, first_id + start, t, names),
        _ParquetSink(path) if fmt == "parquet" else _TextSink(path, DELIMITERS[fmt]),
        rows,
        CHUNK_ROWS,
        rng,
    )


SCHEMA = """\
# The reference config of `dlrm data synth --format {fmt}`: the schema a user would write for
# this table. Sizes: tables about twice the vocabularies (users 20k, ads 5k, tags 200); hour and
# device are integer codes (device % 1000 keeps the 30 codes apart).
format = "{fmt}"
label = "click"
ignore = ["row_id"]

[[features]]
kind = "categorical"
name = "user"
rows = 40000

[[features]]
kind = "categorical"
name = "hour"
encoding = "int"
rows = 24

[[features]]
kind = "categorical"
name = "ad"
rows = 10000

[[features]]
kind = "dense"
name = "price"
transform = "log1p"

[[features]]
kind = "dense"
name = "clicks_7d"
transform = "log1p"
integer = true

[[features]]
kind = "categorical"
name = "tags"
separator = "|"
rows = 1000

[[features]]
kind = "categorical"
name = "device"
encoding = "int"
rows = 1000

[[features]]
kind = "dense"
name = "score"
transform = "standardize"   # mean and std measured on the training file
"""


def synthesize_table(
    out: Path,
    train_rows: int,
    test_rows: int,
    seed: int = 0,
    format: str = "csv",
    ctr: float = 0.2,
    zipf: float = 1.1,
) -> dict:
    """Write ``out/train.<ext>``, ``out/test.<ext>``, ``out/bayes.json`` and ``out/schema.toml``;
    return the bayes record.

    Args:
        format: ``csv``, ``tsv`` or ``parquet`` (the extension too).
        ctr: target click rate (the intercept is solved for it).
        zipf: exponent of the user and ad popularity laws.

    Example::

        synthesize_table(Path("/tmp/t"), 100_000, 20_000, seed=0, format="parquet")
        # dlrm train --config /tmp/t/schema.toml --train /tmp/t/train.parquet --test
        /tmp/t/test.parquet ...
    """
    if format not in FORMATS:
        raise ValueError(f"format {format!r}: expected one of {', '.join(FORMATS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = make_teacher(seed, zipf)
    _calibrate(teacher, ctr, seed)
    names = Names()
    _write_split(
        teacher,
        names,
        out / f"train.{format}",
        format,
        train_rows,
        0,
        np.random.default_rng([seed, 1]),
    )
    probs, labels = _write_split(
        teacher,
        names,
        out / f"test.{format}",
        format,
        test_rows,
        train_rows,
        np.random.default_rng([seed, 2]),
    )
    (out / "schema.toml").write_text(SCHEMA.format(fmt=format))
    return bayes_record(
        out,
        probs,
        labels,
        f"test.{format}",
        train_rows=train_rows,
        test_rows=test_rows,
        seed=seed,
        zipf=zipf,
        format=format,
    )
