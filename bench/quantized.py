"""Quantized rows: bytes per row and served AUC of fp32 / fp16 / int8 / int4, side by side.

The default DLRM (dim 16, 26 tables x 100k rows) is trained one epoch on the real Criteo sample
(../shared/data/criteo-wideresdnn, 8,000 train rows; see its PROVENANCE.md), published once per
row dtype into a file store and into a real Redis, and its 2,000 held-out test rows are scored
through the API (in-process, ``predict_tsv``) from each store. Per dtype: payload bytes per row,
file bytes per row (the tables' .npy files over their rows), Redis bytes per row (``INFO memory``
used_memory before and after the publish, over the rows published), test AUC and its difference
from fp32, and the largest difference of a served probability from fp32's.
Writes bench/results/quantized.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

DLRM = [sys.executable, str(REPO / "dlrm_cli.py")]
SAMPLE = REPO.parent / "shared" / "data" / "criteo-wideresdnn"
DTYPES = ("fp32", "fp16", "int8", "int4")


def train(work: Path, hash_size: int) -> Path:
    run = work / f"run-{hash_size}"
    if not (run / "metrics.json").exists():
        subprocess.run(
            [
                *DLRM,
                "train",
                "--train",
                SAMPLE / "train.txt",
                "--test",
                SAMPLE / "test.txt",
                "--out",
                run,
                "--hash-size",
                str(hash_size),
                "--no-progress",
                "--set",
                "train.checkpoint_every_steps=0",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return run


def served_scores(url: str, lines: list[str]) -> np.ndarray:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    out: list[float] = []
    with TestClient(create_app(Settings(store=url, poll_interval_s=0.5))) as client:
        for start in range(0, len(lines), 1000):
            r = client.post(
                "/v1/models/dlrm:predict_tsv",
                content="\n".join(lines[start : start + 1000]),
                headers={"content-type": "text/plain"},
            )
            r.raise_for_status()
            out += r.json()["predictions"]
    return np.array(out)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench" / "quantized")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--hash-size", type=int, default=100_000, help="rows per table")
    args = p.parse_args()

    import redis
    from redis_server import RedisServer

    from dense_trainer.metrics import roc_auc
    from embedding_server.publish import publish_checkpoint
    from embedding_server.stores import open_store
    from embedding_server.wire import row_bytes

    run = train(args.work, args.hash_size)
    lines = (SAMPLE / "test.txt").read_text().splitlines()
    labels = np.array([int(line.split("\t", 1)[0]) for line in lines])
    (args.work / "redis").mkdir(parents=True, exist_ok=True)
    server = RedisServer(args.work / "redis").start()
    results: dict = {"dtypes": {}}
    try:
        client = redis.Redis.from_url(server.url)
        for dtype in DTYPES:
            file_root = args.work / f"store-{dtype}-{time.time_ns()}"
            file_url = f"file://{file_root}"
            meta = publish_checkpoint(run, open_store(file_url), version=dtype, row_dtype=dtype)
            rows = sum(t.rows for t in meta.spec.tables)
            file_bytes = sum(
                f.stat().st_size for f in (file_root / "versions" / dtype / "tables").iterdir()
            )
            client.flushall()
            before = client.info("memory")["used_memory"]
            t0 = time.perf_counter()
            publish_checkpoint(run, open_store(server.url), version=dtype, row_dtype=dtype)
            publish_s = time.perf_counter() - t0
            redis_bytes = client.info("memory")["used_memory"] - before
            scores = {
                "file": served_scores(file_url, lines),
                "redis": served_scores(server.url, lines),
            }
            results["dtypes"][dtype] = {
                "payload_bytes_per_row": row_bytes(meta.spec.tables[0].dim, dtype),
                "file_bytes_per_row": file_bytes / rows,
                "redis_bytes_per_row": redis_bytes / rows,
                "redis_publish_rows_per_s": rows / publish_s,
                "rows": rows,
                "auc_file": roc_auc(scores["file"], labels),
                "auc_redis": roc_auc(scores["redis"], labels),
                "scores": scores,
            }
    finally:
        server.stop(save=False)
    fp32 = results["dtypes"]["fp32"]
    for x in results["dtypes"].values():
        x["auc_minus_fp32"] = x["auc_file"] - fp32["auc_file"]
        x["max_prob_diff_vs_fp32"] = float(
            np.abs(x["scores"]["file"] - fp32["scores"]["file"]).max()
        )
        x["file_equals_redis"] = float(np.abs(x["scores"]["file"] - x["scores"]["redis"]).max())
    for x in results["dtypes"].values():
        del x["scores"]
    results["config"] = {
        "hash_size": args.hash_size,
        "test_rows": len(lines),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantized.json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    (args.out / "quantized.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    c = r["config"]
    lines = [
        f"Quantized rows ({c['date']}): the default DLRM, 26 tables x {c['hash_size']:,} rows of "
        "dim 16, trained one "
        f"epoch on the Criteo sample (8,000 rows); served AUC on its {c['test_rows']:,} held-out "
        "rows through the API.",
        "",
        "| rows | payload B/row | file B/row | Redis B/row | test AUC (file) | AUC - fp32 | AUC "
        "(Redis) | max prob. diff vs fp32 | file vs Redis | Redis publish rows/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, x in r["dtypes"].items():
        lines.append(
            f"| {dtype} | {x['payload_bytes_per_row']} | {x['file_bytes_per_row']:.1f} | "
            f"{x['redis_bytes_per_row']:.1f} | "
            f"{x['auc_file']:.4f} | {x['auc_minus_fp32']:+.4f} | {x['auc_redis']:.4f} | "
            f"{x['max_prob_diff_vs_fp32']:.4f} | "
            f"{x['file_equals_redis']:.1e} | {x['redis_publish_rows_per_s']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
