"""One loaded model version: metadata, the dense network (built from the trainer's definition,
weights loaded with ``weights_only``), default rows and the row cache."""

from __future__ import annotations

import numpy as np
import torch

from api.cache import RowCache
from dense_trainer.config import ModelConfig
from dense_trainer.model import build_served_model, freeze_for_serving
from dlrm_core.featurize import DENSE_MAX_ABS, Featurizer
from dlrm_core.featurize_values import ValueFeaturizer
from dlrm_core.formats import LineParser
from dlrm_core.schema import FeatureSpec
from embedding_server.idmap.pieces import PieceLayout
from embedding_server.idmap.view import IdMapView
from embedding_server.wire import NUMPY_DTYPE, QUANTIZED_BITS, ModelVersion, encode_rows, row_width


def build_dense(meta: ModelVersion, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The dense network of a version, with its weights, in inference mode."""
    # a version published before the wide part or the first-order weights existed has neither
    config = ModelConfig.model_validate({"wide": False, "first_order": False, **meta.model})
    module = build_served_model(config, meta.spec, meta.embedding_dim, meta.towers)
    module.load_state_dict(state)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return freeze_for_serving(module)  # a version's weights never change: a faster layout


@torch.inference_mode()
def warm_up(dense: torch.nn.Module, meta: ModelVersion) -> None:
    """Run the network once at a few batch sizes before it takes traffic: the first calls of
    each kernel are slow, and would otherwise land on the first requests."""
    width = sum(meta.spec.feature_dims)
    for batch in (1, 8, 256):
        dense(torch.zeros(batch, meta.spec.dense_width), torch.zeros(batch, width))


class ServingModel:
    """One loaded version: metadata, dense network, default rows, row cache, and where it stands
    in the version's live updates (``cursor``, ``generation``)."""

    def __init__(
        self,
        meta: ModelVersion,
        dense: torch.nn.Module,
        cache_bytes: float,
        remote: bool,
        cursor: str | None = None,
        generation: int = 0,
        id_maps: dict[str, IdMapView] | None = None,
        mapped: list[np.ndarray | None] | None = None,
        owners: dict[str, np.ndarray] | None = None,
        dense_max_abs: float = DENSE_MAX_ABS,
    ) -> None:
        self.meta = meta
        self.version = meta.version
        self.spec: FeatureSpec = meta.spec
        self.dense = dense
        self.defaults = {
            t.name: np.asarray(meta.default_rows.get(t.name, np.zeros(t.dim)), dtype=np.float32)
            for t in meta.spec.tables
        }
        self.row_dtype = meta.row_dtype
        self.stored_defaults = {  # the default rows as the store holds rows [W_t]
            name: encode_rows(row[None], meta.row_dtype)[0] for name, row in self.defaults.items()
        }
        self.pooler = None
        """int8/int4 versions: pools the rows as stored, with fbgemm (loaded only for them)."""
        if meta.row_dtype in QUANTIZED_BITS:
            from api.quantized import QuantizedPooler

            self.pooler = QuantizedPooler(meta.spec, meta.row_dtype)
        self.cache_bytes = cache_bytes
        self.cache = self.new_cache() if remote and cache_bytes > 0 else None
        self.feature_tables = meta.spec.feature_tables
        """Index of each categorical feature's table (the spec computes it on every call)."""
        self.distinct_tables = len(set(self.feature_tables)) == len(self.feature_tables)
        """No two features share a table (a one-hot example then reads one row per feature)."""
        self.uniform_dim = len({t.dim for t in meta.spec.tables}) <= 1
        """Every table has one D: one-hot requests are pooled with a single gather."""
        if any(t.rows >= 2**40 for t in meta.spec.tables):
            raise ValueError("tables of 2^40 rows or more are not served (row keys are 40 bits)")
        self.featurizer = Featurizer(meta.spec, with_label=False, dense_max_abs=dense_max_abs)
        self.values = ValueFeaturizer(meta.spec, dense_max_abs)
        """Featurises a few one-hot examples given as values (``dlrm_core/featurize_values.py``)."""
        self.lines = LineParser(meta.spec, dense_max_abs) if meta.spec.columns else None
        """Parses lines in the model's input layout (None: the version does not record its
        columns)."""
        dims = self.spec.feature_dims
        self.columns = np.concatenate([[0], np.cumsum(dims)]).tolist()
        """Feature f's columns in the pooled embeddings: ``columns[f]:columns[f + 1]``."""
        self.stored_columns = np.concatenate(
            [[0], np.cumsum([row_width(d, self.row_dtype) for d in dims])]
        ).tolist()
        """Feature f's columns in a one-hot example's rows as stored: ``stored_columns[f]:[f +
        1]``."""
        self.mapped = _features_of(meta, mapped)
        """Per feature, its table's rows in memory as stored (a file store's mapping, [rows, W_t]
        of the version's row dtype); None where a table has none: single requests gather rows
        from these."""
        self.table_names = [self.spec.tables[t].name for t in self.feature_tables]
        self.id_maps = id_maps or {}
        """Dynamic tables' id maps (base and live updates' overlay), by table name."""
        self.layouts = {
            t.name: PieceLayout.of(t.rows, t.dynamic, meta.id_pieces.get(t.name, 1), t.name)
            for t in meta.spec.tables
            if t.dynamic is not None
        }
        """Dynamic tables: where an id without a row finds its shared row (``idmap/pieces.py``)."""
        self.owners = None
        """Per feature, its dynamic table's owners mapping (file store: int64 [R]) or None; None
        where a dynamic table has none (the direct gather then checks nothing: it is skipped)."""
        if (
            self.id_maps
            and owners is not None
            and all(owners.get(n) is not None for n in self.id_maps)
        ):
            self.owners = [owners.get(name) for name in self.table_names]
        self.cursor = cursor
        """The store's live-update cursor of this version."""
        self.generation = generation
        """Live updates applied so far (the store numbers them per version; 0: none)."""

    def new_cache(self) -> RowCache:
        return RowCache(
            [(t.name, t.rows, row_width(t.dim, self.row_dtype)) for t in self.spec.tables],
            self.cache_bytes,
            NUMPY_DTYPE[self.row_dtype],
        )


def _features_of(
    meta: ModelVersion, mapped: list[np.ndarray | None] | None
) -> list[np.ndarray] | None:
    """Tables' mappings (table order) -> per feature its table's, when every table has one of
    rows as stored ([rows, row_width] of the row dtype's element type)."""
    if mapped is None:
        return None
    tables, dtype = meta.spec.tables, NUMPY_DTYPE[meta.row_dtype]
    for t, arr in zip(tables, mapped, strict=True):
        if (
            arr is None
            or arr.shape != (t.rows, row_width(t.dim, meta.row_dtype))
            or arr.dtype != dtype
        ):
            return None
    return [mapped[t] for t in meta.spec.feature_tables]
