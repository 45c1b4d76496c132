"""``dlrm data synth``: Criteo-layout data drawn from a planted teacher model.

The teacher (seeded, so the same ``--seed`` gives the same files):

* 26 categorical features with Criteo-like vocabularies (3 to 100k values), ids drawn from a
  Zipf law over each vocabulary (exponent ``zipf``), some features missing at a rate of 5-40%;
  each value is written as an 8-hex-digit hash, as in the real data;
* 13 integer features, log-normal counts, some missing;
* logit = intercept + per-value biases + sum over chosen feature pairs (f, g) of
  w_fg <u_f[id_f], u_g[id_g]> (latent vectors of rank ``rank``) + a dense linear term + a few
  dense x dense products; the intercept is solved for the target click rate.

The labels are Bernoulli(sigmoid(logit)). ``bayes.json`` holds the AUC and log loss of the true
probabilities on the test split: what a perfect model would score, the ceiling for every run.
Popularity, calibration, labels, chunked writing and the Bayes record are the teacher's, shared
with the table layout (``teacher.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from dense_trainer.data.teacher import bayes_record, draw, solve_intercept, write_split, zipf_cdf
from dlrm_core.schema import CRITEO_COLUMNS

log = logging.getLogger(__name__)

VOCAB = [
    1000, 500, 100000, 50000, 300, 24, 10000, 600, 3, 30000, 5000, 80000, 3000,
    27, 12000, 60000, 10, 5000, 2000, 4, 70000, 18, 15, 20000, 100, 15000,
]  # fmt: skip
"""Vocabulary of each categorical feature: Criteo Kaggle's shape, scaled down."""
CHUNK_ROWS = 100_000
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@dataclass
class Teacher:
    """The planted model's parameters."""

    hexes: list[np.ndarray]  # per feature, uint32 [V_f]: the hash written for each value
    zipf_cdf: list[np.ndarray]  # per feature, float [V_f]: CDF of the Zipf law over ranks
    rank_to_id: list[np.ndarray]  # per feature, a permutation: popular ids are not small ids
    bias: list[np.ndarray]  # per feature, float [V_f + 1] (last: the missing value)
    latent: list[np.ndarray]  # per feature, float [V_f + 1, rank]
    missing_cat: np.ndarray  # float [26], missing rate of each categorical
    pairs: np.ndarray  # int [P, 2] interacting feature pairs
    pair_w: np.ndarray  # float [P]
    dense_mu: np.ndarray  # float [13], log-normal location of each count
    dense_sigma: np.ndarray
    missing_dense: np.ndarray  # float [13]
    dense_w: np.ndarray  # float [13]
    dense_pairs: np.ndarray  # int [Q, 2]
    dense_pair_w: np.ndarray  # float [Q]
    intercept: float = 0.0


def make_teacher(seed: int, zipf: float = 1.1, rank: int = 4, num_pairs: int = 40) -> Teacher:
    rng = np.random.default_rng(seed)
    hexes, cdfs, perms, biases, latents = [], [], [], [], []
    for v in VOCAB:
        hexes.append(rng.integers(0, 2**32, size=v, dtype=np.uint64).astype(np.uint32))
        cdfs.append(zipf_cdf(v, zipf))
        perms.append(rng.permutation(v))
        biases.append(rng.normal(0, 0.25, size=v + 1))
        latents.append(rng.normal(0, 1.0 / np.sqrt(rank), size=(v + 1, rank)))
    f = len(VOCAB)
    all_pairs = np.array([(a, b) for a in range(f) for b in range(a + 1, f)])
    pairs = all_pairs[rng.choice(len(all_pairs), size=num_pairs, replace=False)]
    missing_cat = np.where(rng.random(f) < 0.3, rng.uniform(0.05, 0.4, f), 0.0)
    d = 13
    return Teacher(
        hexes=hexes,
        zipf_cdf=cdfs,
        rank_to_id=perms,
        bias=biases,
        latent=latents,
        missing_cat=missing_cat,
        pairs=pairs,
        pair_w=rng.normal(0, 0.5, size=num_pairs),
        dense_mu=rng.uniform(0.0, 4.0, d),
        dense_sigma=rng.uniform(0.5, 1.5, d),
        missing_dense=np.where(rng.random(d) < 0.5, rng.uniform(0.02, 0.45, d), 0.0),
        dense_w=rng.normal(0, 0.25, d),
        dense_pairs=np.array([(0, 1), (2, 5), (4, 9), (7, 12)]),
        dense_pair_w=rng.normal(0, 0.15, 4),
    )


def _sample(teacher: Teacher, n: int, rng: np.random.Generator):
    """Draw n rows: (ids [26, n] with -1 for missing, counts [13, n] with -1 for missing, logit
    [n])."""
    f = len(VOCAB)
    ids = np.empty((f, n), dtype=np.int64)
    logit = np.full(n, teacher.intercept)
    for j in range(f):
        col = draw(teacher.zipf_cdf[j], teacher.rank_to_id[j], n, rng)
        col[rng.random(n) < teacher.missing_cat[j]] = -1
        ids[j] = col
        logit += teacher.bias[j][col]  # -1 indexes the "missing" row at the end
    for (a, b), w in zip(teacher.pairs, teacher.pair_w, strict=True):
        logit += w * np.einsum("nk,nk->n", teacher.latent[a][ids[a]], teacher.latent[b][ids[b]])
    counts = np.floor(
        np.exp(rng.normal(teacher.dense_mu[:, None], teacher.dense_sigma[:, None], (13, n)))
    ).astype(np.int64)
    counts[rng.random((13, n)) < teacher.missing_dense[:, None]] = -1
    z = (np.log1p(np.maximum(counts, 0)) - teacher.dense_mu[:, None]) / teacher.dense_sigma[:, None]
    z[counts < 0] = 0.0
    logit += teacher.dense_w @ z
    for (a, b), w in zip(teacher.dense_pairs, teacher.dense_pair_w, strict=True):
        logit += w * z[a] * z[b]
    return ids, counts, logit


def _calibrate(teacher: Teacher, ctr: float, seed: int) -> None:
    """Solve the intercept so that the mean click probability is ``ctr``."""
    _, _, logit = _sample(teacher, 50_000, np.random.default_rng(seed + 7))
    teacher.intercept = solve_intercept(logit, ctr)


def _hex_column(values: np.ndarray, valid: np.ndarray) -> pa.Array:
    """uint32 [n] -> arrow strings of 8 hex digits, null where not valid."""
    n = values.size
    digits = np.empty((n, 8), dtype=np.uint8)
    v = values.astype(np.uint64)
    for k in range(8):
        digits[:, 7 - k] = _HEX[(v >> np.uint64(4 * k)) & np.uint64(15)]
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    bitmap = np.packbits(valid, bitorder="little")
    return pa.StringArray.from_buffers(
        n, pa.py_buffer(offsets), pa.py_buffer(digits.tobytes()), pa.py_buffer(bitmap.tobytes())
    )


def _table(teacher: Teacher, drawn: tuple[np.ndarray, np.ndarray], labels: np.ndarray) -> pa.Table:
    """Drawn (ids, counts) and their labels -> the columns of a Criteo line."""
    ids, counts = drawn
    cols = [pa.array(labels)]
    cols += [pa.array(c, mask=c < 0) for c in counts]
    cols += [_hex_column(teacher.hexes[j][np.maximum(ids[j], 0)], ids[j] >= 0) for j in range(26)]
    return pa.Table.from_arrays(cols, names=CRITEO_COLUMNS)


class _TsvSink:
    """Criteo's text: tab-separated, no header, empty cells for missing values."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: pcsv.CSVWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self.writer is None:
            opts = pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
            self.writer = pcsv.CSVWriter(str(self.path), table.schema, write_options=opts)
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _write_split(
    teacher: Teacher, path: Path, rows: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Write ``rows`` rows to ``path``; return (true probabilities, labels)."""

    def sample(n: int, rng: np.random.Generator):
        ids, counts, logit = _sample(teacher, n, rng)
        return (ids, counts), logit

    return write_split(
        sample,
        lambda drawn, labels, _: _table(teacher, drawn, labels),
        _TsvSink(path),
        rows,
        CHUNK_ROWS,
        rng,
    )


def synthesize(
    out: Path,
    train_rows: int,
    test_rows: int,
    seed: int = 0,
    ctr: float = 0.25,
    zipf: float = 1.1,
) -> dict:
    """Write ``out/train.txt``, ``out/test.txt``, ``out/bayes.json``; return the bayes record."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = make_teacher(seed, zipf=zipf)
    _calibrate(teacher, ctr, seed)
    _write_split(teacher, out / "train.txt", train_rows, np.random.default_rng([seed, 1]))
    probs, labels = _write_split(
        teacher, out / "test.txt", test_rows, np.random.default_rng([seed, 2])
    )
    return bayes_record(
        out,
        probs,
        labels,
        "test.txt",
        train_rows=train_rows,
        test_rows=test_rows,
        seed=seed,
        zipf=zipf,
    )
