"""The naive serving baseline: the same app, but its service holds every table in the API
process as ``nn.EmbeddingBag`` modules (loaded whole from the file store at start-up) and looks
rows up with one ``embedding_bag`` per table, no store, no cache. Run by bench/serving.py.

Everything else is as ``dlrm serve`` runs it, logging included (the same ``log_config``: the
access log writes its line a request here too; until 2026-12-04 this baseline ran on uvicorn's
default logging, which dropped those lines, and so skipped a cost that ours paid)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.app import create_app  # noqa: E402
from api.service import ModelService  # noqa: E402
from api.settings import Settings  # noqa: E402
from dlrm_core.logs import logging_config  # noqa: E402


class NaiveService(ModelService):
    def load(self, version: str):
        root = Path(self.store.root) / "versions" / version / "tables"
        self.bags = {
            t.name: torch.nn.EmbeddingBag.from_pretrained(
                torch.from_numpy(np.load(root / f"{t.name}.npy").astype(np.float32)), mode=t.pooling
            )
            for t in self.store.read_meta(version).spec.tables
        }
        return super().load(version)

    def embed(self, model, ids, offsets, batch):
        out = []
        for f, t in enumerate(model.spec.tables):
            lo, hi = offsets[f * batch], offsets[(f + 1) * batch]
            bag_offsets = torch.from_numpy(offsets[f * batch : (f + 1) * batch] - lo)
            out.append(self.bags[t.name](torch.from_numpy(ids[lo:hi]), bag_offsets))
        return torch.cat(out, dim=1)


def app():
    return create_app(Settings(), service_factory=NaiveService)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    os.environ["DLRM_STORE"] = a.store
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    uvicorn.run(
        "naive_serve:app",
        factory=True,
        port=a.port,
        workers=a.workers,
        log_level="warning",
        access_log=False,
        log_config=logging_config(json_lines=Settings().log_format == "json"),
    )
