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
from pydantic import BaseModel, ConfigDict, Field, model_serializer

from dlrm_core.errors import CheckpointError
from dlrm_core.schema import FeatureSpec

RowDtype = Literal["fp32", "fp16", "int8", "int4"]
NUMPY_DTYPE = {
    "fp32": np.dtype("<f4"),
    "fp16": np.dtype("<f2"),
    "int8": np.dtype("u1"),
    "int4": np.dtype("u1"),
}
"""Element type of a stored row (quantized rows are bytes)."""
QUANTIZED_BITS = {"int8": 8, "int4": 4}
"""Row dtypes stored in fbgemm's row-wise quantized layout, and their bits per value."""
SCALE_BIAS_BYTES = 4
"""A quantized row ends with its fp16 scale and fp16 bias
(``FloatToFusedNBitRowwiseQuantizedSBHalf``)."""


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
    owners: bool = False
    """Dynamic tables' rows have their owners (the id each row holds) stored beside them, written
    with the id maps: readers check a row against the id their map gives it (live updates move
    ids between rows). False: a version published before owners were stored, whose maps never
    change: nothing to check."""
    id_pieces: dict[str, int] = {}
    """Dynamic tables split by rows over embedding servers: table -> its row pieces, whose layout
    places an id's shared row (``embedding_server/idmap/pieces.py``); a table not listed: one."""
    towers: dict[str, Any] | None = None
    """A compressed tower model's towers (features, c_t) and output dim D': the dense weights
    then hold the tower modules (``towers.<t>.*``) and the trainers' network (``net.*``)."""

    @model_serializer(mode="wrap")
    def _without_empty_pieces(self, handler):
        """``id_pieces`` only where some table is split: a version without one reads the same to
        replicas that predate the field (the model forbids unknown fields)."""
        out = handler(self)
        if not out.get("id_pieces", True):
            del out["id_pieces"]
        return out


def row_width(dim: int, dtype: RowDtype) -> int:
    """Elements of ``NUMPY_DTYPE[dtype]`` in one stored row of ``dim`` values: D for fp32/fp16;
    for int8/int4 the bytes ``ceil(D * bits / 8)`` of values, then fp16 scale and bias."""
    bits = QUANTIZED_BITS.get(dtype)
    return dim if bits is None else -(-dim * bits // 8) + SCALE_BIAS_BYTES


def row_bytes(dim: int, dtype: RowDtype) -> int:
    """Bytes of one stored row."""
    return row_width(dim, dtype) * NUMPY_DTYPE[dtype].itemsize


def encode_rows(rows: np.ndarray, dtype: RowDtype) -> np.ndarray:
    """float [n, D] -> contiguous little-endian rows of the storage dtype [n, row_width]; int8 and
    int4 rows are quantized by fbgemm (``FloatToFusedNBitRowwiseQuantizedSBHalf``: per row,
    values ``round((x - min) / scale)``, then fp16 scale and fp16 bias = min), which is imported
    only here, by writers of quantized versions."""
    bits = QUANTIZED_BITS.get(dtype)
    if bits is None:
        return np.ascontiguousarray(rows, dtype=NUMPY_DTYPE[dtype])
    import fbgemm_gpu  # noqa: F401 (registers torch.ops.fbgemm)

    floats = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    return torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(floats, bits).numpy()


def dequantize_rows(raw: np.ndarray, dim: int, dtype: RowDtype) -> np.ndarray:
    """Stored rows [n, row_width] -> float32 [n, D] (numpy: readers of single rows need no
    fbgemm)."""
    bits = QUANTIZED_BITS.get(dtype)
    if bits is None:
        return raw.astype(np.float32)
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, row_width(dim, dtype))
    scale_bias = raw[:, -SCALE_BIAS_BYTES:].copy().view("<f2").astype(np.float32)  # [n, 2]
    data = raw[:, :-SCALE_BIAS_BYTES]
    if bits == 4:  # two values a byte, the first in the low nibble
        data = np.stack([data & 0xF, data >> 4], axis=-1).reshape(len(raw), -1)
    return data[:, :dim].astype(np.float32) * scale_bias[:, :1] + scale_bias[:, 1:]


def decode_rows(blob: bytes | memoryview, dim: int, dtype: RowDtype) -> np.ndarray:
    """Bytes of n stored rows -> float32 [n, D]."""
    raw = np.frombuffer(blob, dtype=NUMPY_DTYPE[dtype]).reshape(-1, row_width(dim, dtype))
    return dequantize_rows(raw, dim, dtype)


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


# -- the distributed step --------------------------------------------------------------------------
#
# Ranks 0..T-1 are trainers, T..T+E-1 embedding servers, all in one torch.distributed world.
# Only trainer/server pairs exchange messages (``transport.py``), one message per pair and
# direction and per step, each on its own channel:
#
#   ids      trainer -> server, int32 (int64 for pieces of 2^31 rows or more):
#            [command, arg, B_r, payload length] + payload; the payload has, per slot (feature,
#            piece) on that server, a one-hot flag, then values (one-hot) or lengths [B_r] and
#            values. Other commands (checkpoint, live start, stop) carry no ids.
#   pooled   server -> trainer, float (the exchange dtype): [B_r, sum of the server's slot dims]
#   grads    trainer -> server, the same layout (training lookups only)
#
# CHECKPOINT's message (the master's; ``checkpoint.snapshot.CutRequest``): argument = the step,
# payload
# = [base step + 1 (0: a full checkpoint), 0: written in the background | 1: everyone waits until
# it is current | 3: only wait for the checkpoint already taken at this step].

from enum import IntEnum  # noqa: E402

ID_HEADER = 4
"""Elements of an id message's header: command, argument, local batch size, payload length."""


class Command(IntEnum):
    NONE = 0
    LOOKUP_TRAIN = 1
    LOOKUP_EVAL = 2
    CHECKPOINT = 3
    STOP = 4
    LIVE_START = 5
    RESTORE = 6


EXCHANGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Pooled embeddings and their gradients may cross the wire compressed."""


LR_UNIT = 1_000_000
"""A training lookup's argument is its rate factor minus 1, in millionths (0: the configured
rate; what every other sender of a training lookup sends)."""


def lr_arg(factor: float) -> int:
    """A training lookup's rate factor -> its message argument."""
    return round((factor - 1.0) * LR_UNIT)


def lr_of(arg: int) -> float:
    """Inverse of :func:`lr_arg`."""
    return 1.0 + arg / LR_UNIT


def id_message(command: Command, arg: int, batch: int, payload: torch.Tensor) -> torch.Tensor:
    """The header folded into the id payload: one message."""
    head = torch.tensor([int(command), arg, batch, payload.numel()], dtype=payload.dtype)
    return torch.cat([head, payload])


def parse_id_message(message: torch.Tensor) -> tuple[Command, int, int, torch.Tensor]:
    """-> (command, argument, local batch size, payload)."""
    head = message[:ID_HEADER].tolist()
    return Command(head[0]), int(head[1]), int(head[2]), message[ID_HEADER : ID_HEADER + head[3]]


def ids_dtype(max_rows: int) -> torch.dtype:
    """int32 ids on the wire when every id sent is below 2^31 (local rows nearly always are), else
    int64 (pieces of 2^31 rows or more, raw ids of dynamic tables: ``planner.wire_id_bound``)."""
    return torch.int32 if max_rows < 2**31 else torch.int64


def pack_ids(
    parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Per piece (values [n], lengths [B]) -> one payload of ``dtype``: per piece a flag, then

    flag 1: values [B]               every bag holds exactly one id (one-hot features:
                                     the lengths are implied, half the bytes)
    flag 0: lengths [B], values [n]  otherwise
    """
    flat = []
    for values, lengths in parts:
        one_hot = values.numel() == lengths.numel() and bool((lengths == 1).all())
        flat.append(torch.tensor([1 if one_hot else 0], dtype=dtype))
        if not one_hot:
            flat.append(lengths.to(dtype))
        flat.append(values.to(dtype))
    return torch.cat(flat) if flat else torch.zeros(0, dtype=dtype)


def unpack_ids(
    payload: torch.Tensor, batch: int, num_pieces: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`pack_ids`: -> per piece (values int64, lengths int64)."""
    out, pos = [], 0
    for _ in range(num_pieces):
        one_hot = bool(payload[pos] == 1)
        pos += 1
        if one_hot:
            lengths = torch.ones(batch, dtype=torch.int64)
            n = batch
        else:
            lengths = payload[pos : pos + batch].to(torch.int64)
            pos += batch
            n = int(lengths.sum())
        out.append((payload[pos : pos + n].to(torch.int64), lengths))
        pos += n
    return out
