"""Where a single-instance request's server CPU goes, stage by stage, in-process (no HTTP).

The bench's default model (bench/serving.py prepares it: 26 tables x 100k rows, dim 16) served
from its file store (``--stores file,redis``: and from Redis, rows in the row cache; ``--row-dtype
fp32,int8``: each row dtype), one service in this process, CPU time (``time.process_time``) per call
over
the same 400 single-instance requests, each stage alone, the fast paths beside the general ones:

    decode        V1 body -> validated instances (api/decode.py)
    featurize     instances -> model inputs: value path (dlrm_core/featurize_values.py) | column
    path
    embed         ids -> pooled embeddings: direct gather from the mapping | general (unique, store)
    dense         the dense network on pooled embeddings (inference mode, 1 thread)
    predict_json  the whole service call: decode, featurize, embed, dense (batcher on, idle)
    predict_tsv   the same for one line in the model's input format

What HTTP costs on top (uvicorn, routing, middleware, the thread hop) is the difference with
bench/serving.py's cpu phase. Writes bench/results/request_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from serving_kit import instances, prepare, redis_url, server_key, store_dir  # noqa: E402

from api import decode  # noqa: E402
from api.featurize import featurize_instances  # noqa: E402
from api.lookup import embed  # noqa: E402
from api.metrics import ServingMetrics  # noqa: E402
from api.service import ModelService  # noqa: E402
from api.settings import Settings  # noqa: E402
from embedding_server.publish import publish_checkpoint  # noqa: E402
from embedding_server.stores import open_store  # noqa: E402


def cost_ms(fn, n: int, rounds: int) -> float:
    """Median over ``rounds`` of the CPU ms per call of ``fn(i)``, i in 0..n-1 (after a warm-up)."""
    for i in range(n):
        fn(i)
    per = []
    for _ in range(rounds):
        t0 = time.process_time()
        for i in range(n):
            fn(i)
        per.append(1e3 * (time.process_time() - t0) / n)
    return statistics.median(per)


def stage_costs(
    service: ModelService, raw: list[dict], lines: list[bytes], rounds: int, full: bool
) -> dict:
    """CPU ms per single-instance call of each stage (``full``: the general paths beside the fast
    ones; else the embed stage as served and the whole service calls)."""
    model = service.model
    bodies = [json.dumps({"instances": [i]}).encode() for i in raw]
    parsed = [decode.predict_request(b).instances for b in bodies]
    inputs = [featurize_instances(model.spec, model.featurizer, x, model.values) for x in parsed]
    for x in inputs:  # a remote store's rows into the row cache: the warm regime
        embed(service.store, service.metrics, model, x[1], x[2], 1)
    embedded = [embed(service.store, service.metrics, model, x[1], x[2], 1) for x in inputs]
    n, r = len(bodies), rounds
    stages = {}
    with torch.inference_mode():
        if full:
            # the same model without its tables' mappings: the general path
            general = copy.copy(model)
            general.mapped = None
            stages["decode"] = cost_ms(lambda i: decode.predict_request(bodies[i]), n, r)
            stages["featurize, value path"] = cost_ms(
                lambda i: featurize_instances(
                    model.spec, model.featurizer, parsed[i], model.values
                ),
                n,
                r,
            )
            stages["featurize, column path"] = cost_ms(
                lambda i: featurize_instances(model.spec, model.featurizer, parsed[i]), n, r
            )
            stages["embed, general path"] = cost_ms(
                lambda i: embed(
                    service.store, service.metrics, general, inputs[i][1], inputs[i][2], 1
                ),
                n,
                r,
            )
        stages["embed, direct gather"] = cost_ms(
            lambda i: embed(service.store, service.metrics, model, inputs[i][1], inputs[i][2], 1),
            n,
            r,
        )
        if full:
            stages["dense"] = cost_ms(
                lambda i: model.dense(torch.from_numpy(inputs[i][0]), embedded[i]), n, r
            )
    stages["predict_json (whole service call)"] = cost_ms(
        lambda i: service.predict_json("dlrm", bodies[i]), n, r
    )
    stages["predict_tsv (whole service call)"] = cost_ms(
        lambda i: service.predict_tsv("dlrm", lines[i]), n, r
    )
    return stages


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=HERE.parent / "build" / "bench" / "serving")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--row-dtype", type=lambda t: t.split(","), default=["fp32"], help="e.g. fp32,int8"
    )
    p.add_argument("--stores", type=lambda t: t.split(","), default=["file"], help="file,redis")
    args = p.parse_args()
    data, run = prepare(args.work, args.row_dtype)
    torch.set_num_threads(1)
    raw = instances(data / "test.txt", args.requests)
    lines = (data / "test.txt").read_bytes().splitlines(keepends=True)[: args.requests]
    (args.work / "redis-cost").mkdir(parents=True, exist_ok=True)
    redis = RedisServer(args.work / "redis-cost").start() if "redis" in args.stores else None
    columns: dict[str, dict] = {}
    try:
        for kind in args.stores:
            for row_dtype in args.row_dtype:
                if kind == "redis":
                    url = redis_url(redis.url, row_dtype)
                    publish_checkpoint(run, open_store(url), version="cost", row_dtype=row_dtype)
                else:
                    url = f"file://{store_dir(args.work, row_dtype)}"
                service = ModelService(open_store(url), Settings(store=url), ServingMetrics())
                service.refresh()
                service.start()
                full = kind == "file" and row_dtype == "fp32"
                columns[server_key(kind, row_dtype)] = stage_costs(
                    service, raw, lines, args.rounds, full
                )
                service.stop()
    finally:
        if redis is not None:
            redis.stop(save=False)
    n, r = args.requests, args.rounds
    result = {
        "stages_cpu_ms": columns,
        "requests": n,
        "rounds": r,
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "request_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    keys = list(columns)
    stages = list(dict.fromkeys(s for c in columns.values() for s in c))
    md = [
        f"Single-instance request, in-process CPU ms per call ({result['date']}, {n} requests, "
        f"median of {r} "
        f"rounds, 1-minute load average {result['loadavg_1min']}; Redis: rows in the row cache):",
        "",
        "| stage | " + " | ".join(keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    md += [
        f"| {s} | "
        + " | ".join(f"{columns[k][s]:.3f}" if s in columns[k] else "" for k in keys)
        + " |"
        for s in stages
    ]
    (args.out / "request_cost.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
