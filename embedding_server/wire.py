"""Everything that crosses a process boundary, defined once.

Today: what a published model version is made of (``ModelVersion`` metadata, the byte encoding
of embedding rows and of dense weights) and the live-update notices a training job sends to
serving replicas. The distributed trainer's messages (id splits, ids, pooled embeddings,
gradients) join them here.
"""

from __future__ import annotations

import io
import time
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from embedding_server.errors import CheckpointError
from embedding_server.features import FeatureSpec

RowDtype = Literal["fp32", "fp16"]
NUMPY_DTYPE = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2")}


class ModelVersion(BaseModel):
    """Metadata of one published version: enough to rebuild and run the model."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    version: str
    """Version name, unique within a store."""
    created_at: float = Field(default_factory=time.time)
    """Unix time the version was published."""
    step: int = 0
    """Training step of the checkpoint it was published from."""
    spec: FeatureSpec
    """Tables, hashing and pooling: the serving side featurises requests with it."""
    model: dict[str, Any]
    """The dense network's config (``dense_trainer.config.ModelConfig`` as a dict)."""
    embedding_dim: int
    """Output dim of the dense arch (the dot interaction's D)."""
    row_dtype: RowDtype = "fp32"
    """How rows are stored."""
    default_rows: dict[str, list[float]] = {}
    """Per table, the embedding served for a row missing from the store (mean of trained rows)."""
    source: str = ""
    """Where it came from (checkpoint path, or ``live:<run>``)."""


def encode_rows(rows: np.ndarray, dtype: RowDtype) -> np.ndarray:
    """float [n, D] -> contiguous little-endian rows of the storage dtype."""
    return np.ascontiguousarray(rows, dtype=NUMPY_DTYPE[dtype])


def decode_rows(blob: bytes | memoryview, dim: int, dtype: RowDtype) -> np.ndarray:
    """Bytes of n stored rows -> float32 [n, D]."""
    return np.frombuffer(blob, dtype=NUMPY_DTYPE[dtype]).reshape(-1, dim).astype(np.float32)


def encode_state(state: dict[str, torch.Tensor]) -> bytes:
    """A dense ``state_dict`` as bytes (``torch.save``)."""
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in state.items()}, buf)
    return buf.getvalue()


def decode_state(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_state`; ``weights_only``: never executes pickled code."""
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"dense weights cannot be loaded: {exc}") from None


def encode_ids(ids: np.ndarray) -> bytes:
    """Row ids of a live-update notice."""
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def decode_ids(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<i8")
