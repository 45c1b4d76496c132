"""``dlrm publish``: a checkpoint becomes one complete serving version in a store.

Tables are streamed in chunks of rows from the memory-mapped checkpoint, so memory stays bounded
whatever their size. A dynamic table also carries its id map (admitted ids, sorted, and their
rows), which serving searches to find an id's row (its shared row, hash(id) % S, for any other id;
a table split by rows over servers records its pieces, ``id_pieces``, that rule's layout). While
streaming, each table's *default embedding* (what serving returns for
a row missing from the store) is computed as the mean of its trained rows: rows whose weights
differ from their (re-generated, seeded) initial values.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from dlrm_core.errors import CheckpointError
from dlrm_core.schema import FeatureSpec
from embedding_server.checkpoint.files import latest_checkpoint, load_file, read_manifest
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.local_table import LocalTable, init_rows
from embedding_server.stores.base import ServingStore
from embedding_server.towers.plan import TowerPlan
from embedding_server.wire import ModelVersion, RowDtype

log = logging.getLogger(__name__)

CHUNK_ROWS = 65536


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, a checkpoints root (its latest) or a training --out directory."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return path
    for root in (path, path / "checkpoints"):
        if (root / "latest").exists():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    raise CheckpointError(f"{path}: no checkpoint there (no manifest.json or latest pointer)")


def published_id_map(tables: CheckpointTables, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A dynamic table's admitted ids, sorted, and their global rows (int64 [n] each), from a
    checkpoint: the union of its row pieces' maps, when it is split by rows
    (``idmap/pieces.py``)."""
    ids, rows = [], []
    for start, n in tables.row_pieces(name):
        state = tables.id_map(name, start, n)
        if not state:
            raise CheckpointError(f"checkpoint {tables.path}: dynamic table {name} has no id map")
        keys, slots = state[f"{name}.idmap.table.keys"], state[f"{name}.idmap.table.slots"]
        live = slots >= 0
        ids.append(keys[live].numpy())
        rows.append(slots[live].numpy() + start)
    ids, rows = np.concatenate(ids), np.concatenate(rows)
    order = np.argsort(ids, kind="stable")
    return ids[order].astype(np.int64), rows[order].astype(np.int64)


def publish_checkpoint(
    checkpoint: Path,
    store: ServingStore,
    version: str | None = None,
    row_dtype: RowDtype = "fp32",
    chunk_rows: int = CHUNK_ROWS,
    rows: Literal["all", "trained"] = "all",
) -> ModelVersion:
    """Write the checkpoint's tables, dense weights and feature spec as one version; make it
    current.

    Args:
        rows: ``trained``: only rows training moved from their initial values are stored (in
            stores that can leave rows out: Redis); the others are served the table's default.
    """
    path = resolve_checkpoint(checkpoint)
    manifest = read_manifest(path)
    meta = manifest["meta"]
    spec = FeatureSpec.model_validate(meta["feature_spec"])
    cfg = meta.get("config", {})
    seed = cfg.get("train", {}).get("seed", 0)
    init_scale = cfg.get("embedding", {}).get("init_scale") or None
    step = int(manifest["step"])
    name = version or f"step{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    tables = CheckpointTables(path)  # whatever sharding wrote it
    dense = load_file(path, "dense.pt")
    towers = meta.get("towers")
    if towers and TowerPlan(towers=towers["towers"]).compresses(
        spec.feature_dims[0], towers["out_dim"]
    ):
        # (identity towers are the flat model as they are)
        modules = [load_file(path, f"tower-{t}.pt")["module"] for t in range(len(towers["towers"]))]
        dense = {
            **{f"net.{k}": v for k, v in dense.items()},
            **{f"towers.{t}.{k}": v for t, state in enumerate(modules) for k, v in state.items()},
        }
    else:
        towers = None
    id_pieces = {
        t.name: len(tables.row_pieces(t.name)) for t in spec.tables if t.dynamic is not None
    }
    out = ModelVersion(
        version=name,
        step=step,
        spec=spec,
        model=meta["model"],
        embedding_dim=meta["embedding_dim"],
        row_dtype=row_dtype,
        source=str(path),
        towers=towers,
        id_pieces={t: n for t, n in id_pieces.items() if n > 1},
    )
    t0 = time.perf_counter()
    with store.begin(out) as writer:
        defaults: dict[str, list[float]] = {}
        for index, table in enumerate(spec.tables):
            total = np.zeros(table.dim, dtype=np.float64)
            trained = 0
            for start in range(0, table.rows, chunk_rows):
                stop = min(start + chunk_rows, table.rows)
                # [n, D]
                weights = tables.read(table.name, "weight", start, stop - start, 0, table.dim)
                initial = init_rows(
                    LocalTable(table, index, row_start=start, rows=stop - start), seed, init_scale
                )
                moved = (weights != initial).any(dim=1)  # [n]
                trained += int(moved.sum())
                total += weights[moved].double().sum(dim=0).numpy()
                writer.write_rows(
                    table.name, start, weights.numpy(), moved.numpy() if rows == "trained" else None
                )
            defaults[table.name] = (
                (total / trained if trained else total).astype(np.float32).tolist()
            )
            log.debug("published %s: %d rows (%d trained)", table.name, table.rows, trained)
        for table in spec.tables:
            if table.dynamic is not None:
                writer.write_id_map(table.name, *published_id_map(tables, table.name))
        writer.meta = out.model_copy(update={"default_rows": defaults})
        writer.write_dense({k: v for k, v in dense.items() if isinstance(v, torch.Tensor)})
        writer.commit()
    log.info(
        "version %s is current in %s (%.1fs)",
        name,
        getattr(store, "url", store),
        time.perf_counter() - t0,
    )
    return writer.meta
