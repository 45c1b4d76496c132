"""Parse + featurise throughput per worker thread, side by side in one run, on generated files:

    (a) criteo       Criteo TSV, 300k rows of `dlrm data synth` (the Criteo layout), beside
                     the old Criteo-only parser (embedding_server/criteo_format.py at 29091ff,
                     extracted from git at run time) on the very same blocks
    (b) avazu csv    Avazu-shaped CSV: id, click, hour, C1, banner_pos, 9 columns of 8-hex-digit
                     ids with Avazu-like vocabularies, device_type, device_conn_type, C14..C21;
                     every column but id and click a categorical hashed as a string (22 features)
    (c) avazu pq     the same rows as Parquet (integers as int64, ids as strings)
    (d) table        the generic table of `dlrm data synth --format csv|parquet` (strings, ints,
                     floats with gaps, a quoted multi-hot column, standardize)

One thread: the file's raw blocks (4 MB, the loader's default; 64k-row Parquet blocks) are read
first, then ``InputReader.parse`` runs on them one after the other. Arrow's own thread pools are
set to one thread so that nothing runs beside the parsing thread. Reported per workload, medians
of --rounds interleaved rounds:

    parse         rows / seconds in InputReader.parse (text -> columns -> model inputs): the work
                  of one loader worker thread; the targets are judged on it
    of which      the format's share (pyarrow's CSV read; a Parquet slice: nothing) and the
                  featuriser's (dlrm_core/featurize.py)
    end to end    rows / (block reading + parse); for Parquet, reading is decoding the row group

Targets: Avazu-shaped CSV >= 150k rows/s per thread, Parquet >= 500k rows/s per thread, Criteo
TSV no slower than the old parser (within 5%, the run-to-run noise).

Usage: python bench/parse_throughput.py [--rows 300000] [--rounds 3] [--profile]
Writes bench/results/parse_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from dense_trainer.config import load_config, prepare_config  # noqa: E402
from dense_trainer.data.synth import synthesize  # noqa: E402
from dense_trainer.data.synth_table import synthesize_table  # noqa: E402
from dlrm_core.formats import InputReader  # noqa: E402
from dlrm_core.schema import CategoricalFeature, build_spec, criteo_spec  # noqa: E402

BLOCK_BYTES = 4 << 20  # DataConfig.block_bytes' default
OLD_COMMIT = "29091ff"
CSV_TARGET, PARQUET_TARGET, OLD_TOLERANCE = 150_000, 500_000, 0.95

# Avazu's columns and, per categorical, (distinct values in the full 40M rows, Zipf exponent):
# the shape of the real data, scaled so that 300k rows look like a slice of it.
AVAZU_HEX = {
    "site_id": (4737, 1.2),
    "site_domain": (7745, 1.2),
    "site_category": (26, 1.5),
    "app_id": (8552, 1.3),
    "app_domain": (559, 1.5),
    "app_category": (36, 1.6),
    "device_id": (300_000, 1.0),
    "device_ip": (400_000, 0.6),
    "device_model": (8251, 1.0),
}
AVAZU_INT = {  # column: (values to draw from, Zipf exponent over them)
    "C1": ([1005, 1002, 1010, 1012, 1007, 1001, 1008], 2.5),
    "banner_pos": ([0, 1, 7, 2, 4, 5, 3], 2.0),
    "device_type": ([1, 0, 4, 5, 2], 2.5),
    "device_conn_type": ([0, 2, 3, 5], 2.0),
    "C14": (list(range(375, 24053, 9)), 1.1),
    "C15": ([320, 300, 216, 728, 120, 1024, 480, 768], 2.5),
    "C16": ([50, 250, 36, 480, 90, 20, 768, 320, 1024], 2.5),
    "C17": (list(range(112, 2759, 6)), 1.1),
    "C18": ([0, 3, 2, 1], 1.5),
    "C19": (list(range(33, 1960, 28)), 1.2),
    "C20": ([-1, *range(100000, 100249)], 1.3),
    "C21": (list(range(1, 220, 3)), 1.2),
}
AVAZU_COLUMNS = [
    "id",
    "click",
    "hour",
    "C1",
    "banner_pos",
    *AVAZU_HEX,
    "device_type",
    "device_conn_type",
    *[f"C{i}" for i in range(14, 22)],
]


# -- data ------------------------------------------------------------------------------------------


def _zipf(rng: np.random.Generator, v: int, s: float, n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, v + 1) ** s
    return np.minimum(np.searchsorted(np.cumsum(w) / w.sum(), rng.random(n)), v - 1)


def _hex8(values: np.ndarray) -> pa.Array:
    """uint32 [n] -> 8-hex-digit strings."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    v = values.astype(np.uint64)
    out = np.empty((len(v), 8), dtype=np.uint8)
    for k in range(8):
        out[:, 7 - k] = digits[(v >> np.uint64(4 * k)) & np.uint64(15)]
    offsets = np.arange(0, 8 * len(v) + 1, 8, dtype=np.int32)
    return pa.StringArray.from_buffers(len(v), pa.py_buffer(offsets), pa.py_buffer(out.tobytes()))


def avazu_table(rows: int, seed: int = 0) -> pa.Table:
    """Avazu-shaped rows (no teacher: only the parse cost matters here)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**63, rows, dtype=np.uint64) * np.uint64(2) + rng.integers(
        0, 2, rows, dtype=np.uint64
    )
    cols: dict[str, pa.Array] = {
        "id": pa.array(ids).cast(pa.string()),
        "click": pa.array((rng.random(rows) < 0.17).astype(np.int64)),
        "hour": pa.array(14102100 + 100 * rng.integers(0, 10, rows) + rng.integers(0, 24, rows)),
    }
    for name, (values, s) in AVAZU_INT.items():
        cols[name] = pa.array(np.asarray(values, dtype=np.int64)[_zipf(rng, len(values), s, rows)])
    for name, (vocab, s) in AVAZU_HEX.items():
        words = rng.integers(0, 2**32, vocab, dtype=np.uint64)
        cols[name] = _hex8(words[_zipf(rng, vocab, s, rows)])
    return pa.table({c: cols[c] for c in AVAZU_COLUMNS})


def avazu_spec(fmt: str):
    feats = [
        CategoricalFeature(kind="categorical", name=c, encoding="string") for c in AVAZU_COLUMNS[2:]
    ]
    return build_spec(
        feats, fmt, label="click", ignore=["id"], table_defaults={"hash_size": 1_000_000}
    )


def make_workloads(tmp: Path, rows: int) -> dict[str, tuple]:
    """name -> (spec, file)."""
    synthesize(tmp / "criteo", train_rows=rows, test_rows=100, seed=0)
    av = avazu_table(rows)
    pcsv.write_csv(av, tmp / "avazu.csv", pcsv.WriteOptions(quoting_style="none"))
    pq.write_table(av, tmp / "avazu.parquet", row_group_size=65_536)
    out = {
        "criteo tsv": (criteo_spec([1_000_000] * 26, [16] * 26), tmp / "criteo" / "train.txt"),
        "avazu csv": (avazu_spec("csv"), tmp / "avazu.csv"),
        "avazu parquet": (avazu_spec("parquet"), tmp / "avazu.parquet"),
    }
    for fmt in ("csv", "parquet"):
        d = tmp / f"table_{fmt}"
        synthesize_table(d, rows, 100, seed=0, format=fmt)
        cfg = prepare_config(load_config(d / "schema.toml"), [d / f"train.{fmt}"])
        out[f"table {fmt}"] = (cfg.feature_spec(), d / f"train.{fmt}")
    return out


def load_old_parser(tmp: Path):
    """The old Criteo parser from git, importable as ``old_criteo_format`` (None without git)."""
    files = {
        "old_criteo_format": "embedding_server/criteo_format.py",
        "old_features": "embedding_server/features.py",
    }
    src = {}
    for module, path in files.items():
        proc = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:{path}"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            return None
        src[module] = proc.stdout
    src["old_criteo_format"] = (
        src["old_criteo_format"]
        .replace("from embedding_server.errors import", "from dlrm_core.errors import")
        .replace("from embedding_server.features import", "from old_features import")
    )
    old_dir = tmp / "old"
    old_dir.mkdir()
    for module, text in src.items():
        (old_dir / f"{module}.py").write_text(text)
    sys.path.insert(0, str(old_dir))
    import old_criteo_format
    import old_features

    return old_criteo_format, old_features


# -- timing ----------------------------------------------------------------------------------------


def read_blocks(reader: InputReader) -> tuple[list, float]:
    t0 = time.perf_counter()
    blocks = list(reader.blocks(0, BLOCK_BYTES))
    return blocks, time.perf_counter() - t0


def time_parse(reader: InputReader, blocks: list) -> dict:
    """Seconds in the format's parse and in the featuriser, over all blocks, one thread."""
    fmt_s = feat_s = 0.0
    rows = bad = 0
    for raw in blocks:
        layout = reader.layout(raw.file_index)
        name = str(reader.files[raw.file_index])
        t0 = time.perf_counter()
        columns, n, lines, bad_lines = reader.format.parse(raw, layout, name)
        t1 = time.perf_counter()
        parsed = reader.featurizer(columns, n, lines, name, bad_lines)
        t2 = time.perf_counter()
        fmt_s, feat_s = fmt_s + t1 - t0, feat_s + t2 - t1
        rows, bad = rows + parsed.num_rows, bad + len(parsed.bad)
    return {
        "format_s": fmt_s,
        "featurize_s": feat_s,
        "parse_s": fmt_s + feat_s,
        "rows": rows,
        "bad": bad,
    }


def time_old(parser, blocks: list) -> dict:
    t0 = time.perf_counter()
    rows = sum(parser.parse(raw).num_rows for raw in blocks)
    return {"parse_s": time.perf_counter() - t0, "rows": rows}


def profile(reader: InputReader, blocks: list, top: int = 14) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for raw in blocks:
        reader.parse(raw)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


# -- the run ---------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rows", type=int, default=300_000, help="rows of each generated file (default 300k)"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument(
        "--profile", action="store_true", help="also cProfile each workload's parse (top functions)"
    )
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()

    load_before = os.getloadavg()[0]
    pa.set_cpu_count(1)  # one thread: no Arrow pool threads beside the parsing one
    pa.set_io_thread_count(1)
    with tempfile.TemporaryDirectory(prefix="parse_bench_") as tmp:
        result = measure(Path(tmp), args)
    result["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parse_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render_markdown(result)
    (args.out / "parse_throughput.md").write_text(md)
    print(md)


def measure(tmp: Path, args) -> dict:
    """Generate the files in ``tmp``, time every workload over the rounds, return the medians."""
    print(f"generating {args.rows:,} rows per workload in {tmp}", file=sys.stderr, flush=True)
    workloads = make_workloads(tmp, args.rows)
    old = load_old_parser(tmp)
    readers = {name: InputReader(spec, [path]) for name, (spec, path) in workloads.items()}
    runs: dict[str, list[dict]] = {
        name: [] for name in [*readers, *(["criteo tsv (old parser)"] if old else [])]
    }
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name, reader in readers.items():
            blocks, read_s = read_blocks(reader)
            run = time_parse(reader, blocks)
            run["read_s"] = read_s
            runs[name].append(run)
            if name == "criteo tsv" and old:
                old_format, old_features = old
                spec = old_features.criteo_spec([1_000_000] * 26, [16] * 26)
                parser = old_format.BlockParser(spec, [str(reader.files[0])])
                runs["criteo tsv (old parser)"].append(
                    {**time_old(parser, blocks), "read_s": read_s}
                )

    results = {}
    for name, rs in runs.items():
        rows = rs[0]["rows"]
        parse_s = statistics.median(x["parse_s"] for x in rs)
        res = {
            "rows": rows,
            "parse_rows_per_s": rows / parse_s,
            "parse_s": parse_s,
            "end_to_end_rows_per_s": rows
            / statistics.median(x["parse_s"] + x["read_s"] for x in rs),
            "read_s": statistics.median(x["read_s"] for x in rs),
        }
        if "format_s" in rs[0]:
            res["format_s"] = statistics.median(x["format_s"] for x in rs)
            res["featurize_s"] = statistics.median(x["featurize_s"] for x in rs)
            res["bad_rows"] = rs[0]["bad"]
        results[name] = res
    judge(results)
    profiles = {}
    if args.profile:
        for name, reader in readers.items():
            blocks, _ = read_blocks(reader)
            profiles[name] = profile(reader, blocks)
    return {
        "rows": args.rows,
        "rounds": args.rounds,
        "block_bytes": BLOCK_BYTES,
        "file_bytes_per_row": {
            name: path.stat().st_size / args.rows for name, (_, path) in workloads.items()
        },
        "results": results,
        "profiles": profiles,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def judge(results: dict) -> None:
    """Set each workload's target and pass/fail (None: no target)."""
    old = results.get("criteo tsv (old parser)")
    for name, r in results.items():
        r["target"], r["pass"] = None, None
        if name == "avazu csv":
            r["target"] = f">= {CSV_TARGET:,}"
            r["pass"] = r["parse_rows_per_s"] >= CSV_TARGET
        elif name == "avazu parquet":
            r["target"] = f">= {PARQUET_TARGET:,}"
            r["pass"] = r["parse_rows_per_s"] >= PARQUET_TARGET
        elif name == "criteo tsv" and old:
            ratio = r["parse_rows_per_s"] / old["parse_rows_per_s"]
            r["vs_old"] = ratio
            r["target"] = f">= old parser ({old['parse_rows_per_s']:,.0f}; x{OLD_TOLERANCE})"
            r["pass"] = ratio >= OLD_TOLERANCE


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"Parse + featurise throughput per worker thread, {r['rows']:,} rows per file, "
        f"{r['block_bytes'] >> 20} MB blocks ({r['date']}; median of {r['rounds']} rounds)",
        "",
        "| format | parse rows/s (1 thread) | target | pass | format / featurise s | end to end "
        "rows/s |",
        "|---|---:|---|---|---:|---:|",
    ]
    for name, v in r["results"].items():
        verdict = "-" if v["pass"] is None else ("pass" if v["pass"] else "FAIL")
        split = f"{v['format_s']:.2f} / {v['featurize_s']:.2f}" if "format_s" in v else "-"
        extra = f" ({v['vs_old']:.2f}x old)" if "vs_old" in v else ""
        lines.append(
            f"| {name} | {v['parse_rows_per_s']:,.0f}{extra} | {v['target'] or '-'} | {verdict} | "
            f"{split} | {v['end_to_end_rows_per_s']:,.0f} |"
        )
    lines += [
        "",
        "parse: rows / seconds in `InputReader.parse` on blocks already in memory (what one loader "
        "worker thread does); format / featurise: its two halves (pyarrow's CSV read of the used "
        "columns; `Featurizer`); end to end: rows / (reading the blocks + parse), where reading a "
        "Parquet block is decoding its row group.",
        "",
        f"Machine: {m['cpus']} CPU cores shared with other work, {m['platform']}, Python "
        f"{m['python']}, "
        f"pyarrow {m['pyarrow']}, numpy {m['numpy']}; Arrow pools set to 1 thread; 1-minute load "
        "average "
        f"{m['load_before']:.2f} before, {m['load_after']:.2f} after (other work on the cores "
        "lowers every row "
        "alike: the rounds interleave the workloads, so compare within a run).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
