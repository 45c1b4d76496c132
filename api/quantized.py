"""Pooling of int8 / int4 rows with fbgemm's ``IntNBitTableBatchedEmbeddingBagsCodegen`` (CPU).

A request's rows arrive as stored (fbgemm's row-wise layout, ``wire.encode_rows``): per table its
distinct rows ``uint8 [U_t, W_t]``, ``W_t = ceil(D_t * bits / 8) + 4``, each ending with its fp16
scale and bias. The kernel reads the very same bytes with the scale and bias first, so they are
moved to the front (a copy of the U rows, never of a table), concatenated into one buffer, and
the kernel's lookup runs over that buffer: per feature, its table's offset into it, its ids as
indices into the table's distinct rows, its bags' offsets. The kernel's static arguments (row
types, D offsets, the largest D per type) come from one TBE module built per loaded version.

This module imports fbgemm: ``api.model`` imports it only for a quantized version, so the API's
own import never loads fbgemm (``scripts/check_layout.py`` checks it).
"""

from __future__ import annotations

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
    IntNBitTableBatchedEmbeddingBagsCodegen,
)

from dlrm_core.schema import FeatureSpec
from embedding_server.wire import SCALE_BIAS_BYTES, RowDtype, row_width

SPARSE_TYPES = {"int8": SparseType.INT8, "int4": SparseType.INT4}
POOLING = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}
NO_CACHE = torch.empty(0, dtype=torch.int32)
"""The kernel's (unused) row-cache locations: rows come from the request's buffer."""


class _Group:
    """The features of one pooling mode: one kernel call."""

    def __init__(
        self, spec: FeatureSpec, features: list[int], row_dtype: RowDtype, pooling: str
    ) -> None:
        self.features = features
        self.tables = sorted({spec.feature_tables[f] for f in features})
        slot = {t: i for i, t in enumerate(self.tables)}
        self.tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (
                    spec.tables[t].name,
                    1,
                    spec.tables[t].dim,
                    SPARSE_TYPES[row_dtype],
                    EmbeddingLocation.HOST,
                )
                for t in self.tables
            ],
            feature_table_map=[slot[spec.feature_tables[f]] for f in features],
            pooling_mode=POOLING[pooling],
            device="cpu",
            output_dtype=SparseType.FP32,
        )
        self.tbe.initialize_weights()  # (one row a table: only its placements and offsets are used)
        self.widths = [row_width(spec.tables[t].dim, row_dtype) for t in self.tables]

    def __call__(
        self,
        rows: dict[int, np.ndarray],
        local: dict[int, np.ndarray],
        offsets: np.ndarray,
        batch: int,
        spec: FeatureSpec,
    ) -> torch.Tensor:
        """-> pooled float32 [B, sum of the group's D_f]."""
        blocks, table_offset, at = [], {}, 0
        for t, width in zip(self.tables, self.widths, strict=True):
            raw = rows[t]  # uint8 [U_t, W_t]: values, then scale and bias
            blocks.append(
                np.concatenate([raw[:, -SCALE_BIAS_BYTES:], raw[:, :-SCALE_BIAS_BYTES]], axis=1)
            )
            table_offset[t] = at
            at += raw.shape[0] * width
        # uint8 [sum U_t W_t]
        weights = torch.from_numpy(np.concatenate([b.reshape(-1) for b in blocks]))
        indices, bag_offsets, base = [], [np.zeros(1, np.int64)], 0
        for f in self.features:
            lo = offsets[f * batch]
            indices.append(local[f])
            bag_offsets.append(offsets[f * batch + 1 : (f + 1) * batch + 1] - lo + base)
            base += offsets[(f + 1) * batch] - lo
        tbe = self.tbe
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=weights,
            uvm_weights=tbe.weights_uvm,
            weights_placements=tbe.weights_placements,
            weights_offsets=torch.tensor(
                [table_offset[spec.feature_tables[f]] for f in self.features]
            ),
            weights_tys=tbe.weights_tys,
            D_offsets=tbe.D_offsets,
            total_D=tbe.total_D,
            max_int2_D=tbe.max_int2_D,
            max_int4_D=tbe.max_int4_D,
            max_int8_D=tbe.max_int8_D,
            max_float16_D=tbe.max_float16_D,
            max_float32_D=tbe.max_float32_D,
            indices=torch.from_numpy(np.concatenate(indices).astype(np.int64)),  # [N]
            offsets=torch.from_numpy(np.concatenate(bag_offsets)),  # [F_g * B + 1]
            pooling_mode=int(tbe.pooling_mode),
            indice_weights=None,
            output_dtype=tbe.output_dtype,
            lxu_cache_weights=tbe.lxu_cache_weights,
            lxu_cache_locations=NO_CACHE,
            row_alignment=tbe.row_alignment,
            max_float8_D=tbe.max_float8_D,
            fp8_exponent_bits=tbe.fp8_exponent_bits,
            fp8_exponent_bias=tbe.fp8_exponent_bias,
        )


class QuantizedPooler:
    """Pools a request's quantized rows, feature by feature as training does (sum or mean bags).

    Args:
        spec: the version's feature spec.
        row_dtype: ``int8`` or ``int4``.
    """

    def __init__(self, spec: FeatureSpec, row_dtype: RowDtype) -> None:
        self.spec = spec
        by_mode: dict[str, list[int]] = {}
        for f, t in enumerate(spec.feature_tables):
            by_mode.setdefault(spec.tables[t].pooling, []).append(f)
        self.groups = [
            _Group(spec, features, row_dtype, mode) for mode, features in by_mode.items()
        ]
        order = [f for g in self.groups for f in g.features]
        dims = [spec.tables[spec.feature_tables[f]].dim for f in order]
        starts = np.concatenate([[0], np.cumsum(dims)])
        # columns of the groups' outputs, put back in feature order (None: already in order)
        cols = {f: np.arange(starts[i], starts[i] + dims[i]) for i, f in enumerate(order)}
        self.columns = (
            None
            if order == sorted(order)
            else torch.from_numpy(np.concatenate([cols[f] for f in range(len(order))]))
        )

    @torch.inference_mode()
    def __call__(
        self,
        rows: dict[int, np.ndarray],
        local: dict[int, np.ndarray],
        offsets: np.ndarray,
        batch: int,
    ) -> torch.Tensor:
        """Per table its distinct rows as stored (uint8 [U_t, W_t]), per feature its ids as indices
        into them and the request's bag offsets [F * B + 1] -> pooled float32 [B, sum(D_f)]."""
        out = torch.cat([g(rows, local, offsets, batch, self.spec) for g in self.groups], dim=1)
        return out if self.columns is None else out[:, self.columns]
