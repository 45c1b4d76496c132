"""An embedding shard: the tables (or table pieces) one process holds, with a fused optimizer
(the in-process client that puts a whole model's tables in one shard: ``client/local.py``).

This is the module an embedding server runs, and the module the single-process trainer embeds.
Tables are grouped by pooling mode; each group is one kernel (fbgemm TBE when it can run the
configured optimizer on the device, else the PyTorch kernel, said loudly in the log), so a
lookup is one fused call per group.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dlrm_core.batch import SparseFeatures
from embedding_server.checkpoint.snapshot import TouchedRows
from embedding_server.idmap.remap import ShardIdMaps
from embedding_server.kernels.optimizers import SparseOptimizerConfig, state_shapes
from embedding_server.kernels.row_blocks import RowBlocks
from embedding_server.kernels.tbe import TBEKernel, fbgemm_supports
from embedding_server.kernels.torch_kernel import TorchKernel
from embedding_server.local_table import LocalTable, init_rows

log = logging.getLogger(__name__)


class EmbeddingShard(nn.Module):
    """Table pieces held by one process, looked up and updated together.

    Args:
        tables: the pieces.
        optimizer: fused sparse optimizer.
        device: where the tables live (``cpu``: host memory).
        seed: initialisation seed.
        init_scale: initial weights are uniform(+-init_scale); None: +-sqrt(1/rows).
        feature_map: the piece each input feature of a lookup reads (several features may read
            one table); None: one feature per piece, in order.

    Example:
        >>> shard = EmbeddingShard([LocalTable(TableSpec(name="C1", rows=10, dim=4), 0)],
        ...                        SparseOptimizerConfig())
        >>> shard(SparseFeatures.one_hot(torch.tensor([[1, 2, 3]]))).shape
        torch.Size([3, 4])
    """

    def __init__(
        self,
        tables: list[LocalTable],
        optimizer: SparseOptimizerConfig,
        device: torch.device | str = "cpu",
        seed: int = 0,
        init_scale: float | None = None,
        feature_map: list[int] | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.init_scale = init_scale
        self.local_tables = tables
        self.optimizer_config = optimizer
        self.feature_map = list(range(len(tables))) if feature_map is None else list(feature_map)
        reason = fbgemm_supports(optimizer, device, [t.spec for t in tables])
        if reason is not None:
            log.warning(
                "EMBEDDING KERNEL FALLBACK: %s; using the PyTorch kernel (same maths, slower).",
                reason,
            )
        self.kernel_name = "fbgemm" if reason is None else "torch"
        kernel_cls = TBEKernel if reason is None else TorchKernel

        # One kernel per pooling mode (in order of first appearance), over the features whose
        # table pools that way; a table belongs to exactly one kernel.
        pooling = [tables[t].spec.pooling for t in self.feature_map]
        poolings = list(dict.fromkeys(pooling))
        # Within a kernel, features of one table come together (fbgemm's CPU row-wise Adagrad
        # needs a shared table's features contiguous); outputs are put back in feature order.
        self.group_features = [
            sorted((i for i, p in enumerate(pooling) if p == mode), key=self._table_rank)
            for mode in poolings
        ]
        self.group_tables = [
            list(dict.fromkeys(self.feature_map[i] for i in feats)) for feats in self.group_features
        ]
        self.kernels = nn.ModuleList(
            kernel_cls(
                [tables[t].spec for t in group],
                optimizer,
                device,
                [group.index(self.feature_map[i]) for i in feats],
            )
            for feats, group in zip(self.group_features, self.group_tables, strict=True)
        )
        dims = [tables[t].spec.dim for t in self.feature_map]
        starts = [sum(dims[:i]) for i in range(len(dims))]
        group_cols = [
            torch.cat([torch.arange(starts[i], starts[i] + dims[i]) for i in feats])
            for feats in self.group_features
        ]
        # Column permutation from grouped output back to feature order (None: already in order).
        order = torch.cat(group_cols) if group_cols else torch.zeros(0, dtype=torch.int64)
        self._unpermute = (
            None
            if torch.equal(order, torch.arange(order.numel()))
            else torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())).to(device)
        )
        self.lr_factor = 1.0
        """The schedule's factor of the rows' learning rate (:meth:`set_lr_factor`)."""
        self.seed = seed
        self.reset_parameters(seed)
        self.touched = TouchedRows([t.spec.rows for t in tables])
        """Rows trained (what checkpoints write: ``checkpoint/snapshot.py``)."""
        self.trained_values: torch.Tensor | None = None
        """Dynamic tables: the values of the last training lookup, ids remapped to rows (what
        live updates mark)."""
        # Dynamic tables: raw ids -> rows before the kernels (admission, eviction, row resets).
        self._blocks: tuple[RowBlocks, dict[str, RowBlocks]] | None = None
        self.id_maps = ShardIdMaps(
            tables,
            self.feature_map,
            self._reset_rows,
            self._read_rows,
            seed,
            init_scale,
            self._copy_rows,
        )

    @property
    def output_dim(self) -> int:
        return sum(self.local_tables[t].spec.dim for t in self.feature_map)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Seeded initial weights; optimizer state zero (Adagrad accumulators at their start
        value)."""
        weights = self._table_views()
        for local, w in zip(self.local_tables, weights, strict=True):
            w.copy_(init_rows(local, seed, self.init_scale))
        start = self.optimizer_config.initial_accumulator
        for state in self._state_views():
            for name, tensor in state.items():
                tensor.fill_(start if name == "momentum1" else 0.0)

    def _row_blocks(self) -> tuple[RowBlocks, dict[str, RowBlocks]]:
        """Every piece's weights, and each optimizer state, as :class:`RowBlocks` (made once: the
        kernels' storage never moves, so the views stay valid)."""
        if self._blocks is None:
            states = self._state_views()
            self._blocks = (
                RowBlocks(self._table_views()),
                {
                    name: RowBlocks([s[name] for s in states])
                    for name in (states[0] if states else {})
                },
            )
        return self._blocks

    @torch.no_grad()
    def _read_rows(self, pieces: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Current weights of rows [k] of pieces [k] (of one dim D), float [k, D] (a copy)."""
        return self._row_blocks()[0].read(pieces, rows)

    @torch.no_grad()
    def _reset_rows(self, pieces: torch.Tensor, rows: torch.Tensor, fresh: torch.Tensor) -> None:
        """Rows [k] of pieces [k] given to new ids: weights ``fresh`` [k, D], optimizer state as
        new."""
        weights, states = self._row_blocks()
        weights.write(pieces, rows, fresh)
        self._new_state(pieces, rows, states)

    def _new_state(
        self, pieces: torch.Tensor, rows: torch.Tensor, states: dict[str, RowBlocks]
    ) -> None:
        """Optimizer state of rows [k] of pieces [k] as at the start (Adagrad's accumulator at its
        initial value, every other state zero)."""
        start = self.optimizer_config.initial_accumulator
        for name, blocks in states.items():
            blocks.write(pieces, rows, start if name == "momentum1" else 0.0)

    @torch.no_grad()
    def _copy_rows(self, pieces: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows dst [k] of pieces [k] given to new ids as copies of rows src [k] of the same
        pieces (their shared rows: ``start_from_shared``), optimizer state as new."""
        weights, states = self._row_blocks()
        weights.copy(pieces, src, dst)
        self._new_state(pieces, dst, states)

    def _table_rank(self, feature: int) -> int:
        """Order of a feature's table among the tables, by first use."""
        return list(dict.fromkeys(self.feature_map)).index(self.feature_map[feature])

    def forward(
        self, sparse: SparseFeatures, remapped: SparseFeatures | None = None
    ) -> torch.Tensor:
        """Pooled embeddings of every bag: ids of F features for B examples -> float [B, sum(D_f)].
        ``remapped``: a training lookup's ids with dynamic tables' ids already remapped
        (``ahead.py``)."""
        if not self.kernels:  # a model without categorical features
            return torch.zeros(sparse.batch_size, 0, device=sparse.values.device)
        training = torch.is_grad_enabled()  # a lookup that will be backpropagated trains
        if remapped is not None:
            sparse = remapped
        elif self.id_maps:  # a training lookup may admit and evict
            sparse = self.id_maps.remap(sparse, train=training)
        if self.id_maps and training:
            self.trained_values = sparse.values  # the rows it trains (live updates mark them)
        if not training:
            return self._lookup(sparse)
        read = [sparse.feature_values(f)[0] for f in range(len(self.feature_map))]  # each's rows
        for piece, rows in zip(self.feature_map, read, strict=True):  # updated on backward
            self.touched.mark(piece, rows.cpu())
        out = self._lookup(sparse)
        if self.optimizer_config.weight_decay:
            self._decay(read)  # after the lookup has read them, before backward updates them
        return out

    def _lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        """The kernels' pooled output of ``sparse`` (rows), in feature order: [B, sum(D_f)]."""
        if len(self.kernels) == 1 and self._unpermute is None:  # one kernel, features in order
            return self.kernels[0](sparse.values, sparse.offsets)
        outs = [
            kernel(sub.values, sub.offsets)
            for kernel, sub in zip(
                self.kernels, (sparse.select_features(f) for f in self.group_features), strict=True
            )
        ]
        out = torch.cat(outs, dim=1)  # [B, sum(D_f)], grouped
        return out if self._unpermute is None else out.index_select(1, self._unpermute)

    def set_lr_factor(self, factor: float) -> None:
        """Scale the rows' learning rate (and decoupled decay) by ``factor`` for the training
        lookups from now on: a lookup's update (its backward) steps at the rate in effect at the
        lookup, whenever it runs (a schedule's step: ``dense_trainer/lr_schedule.py``)."""
        if factor != self.lr_factor:
            self.lr_factor = factor
            for kernel in self.kernels:
                kernel.set_lr_factor(factor)

    @torch.no_grad()
    def _decay(self, read: list[torch.Tensor]) -> None:
        """Shrink the rows this training lookup reads (``read``: each feature's rows) by
        (1 - weight_decay), once per row and step, before the backward updates them (the
        forward has used them already)."""
        keep = 1.0 - self.optimizer_config.weight_decay * self.lr_factor
        views = self._table_views()
        rows: dict[int, list[torch.Tensor]] = {}
        for t, values in zip(self.feature_map, read, strict=True):
            rows.setdefault(t, []).append(values)
        for t, parts in rows.items():
            touched = torch.unique(torch.cat(parts))
            weight = views[t].data  # its own version counter: the kernel saved the weights
            weight[touched] = weight[touched] * keep

    # -- state ------------------------------------------------------------------------------

    def _table_views(self) -> list[torch.Tensor]:
        views: list[torch.Tensor | None] = [None] * len(self.local_tables)
        for kernel, group in zip(self.kernels, self.group_tables, strict=True):
            for t, w in zip(group, kernel.weights(), strict=True):
                views[t] = w
        return views  # type: ignore[return-value]

    def _state_views(self) -> list[dict[str, torch.Tensor]]:
        views: list[dict[str, torch.Tensor]] = [{} for _ in self.local_tables]
        for kernel, group in zip(self.kernels, self.group_tables, strict=True):
            for t, s in zip(group, kernel.states(), strict=True):
                views[t] = s
        return views

    def state_names(self) -> tuple[str, ...]:
        """Names of the optimizer states of each table (``momentum1``, ``exp_avg``...)."""
        return tuple(state_shapes(self.optimizer_config.kind, 1, 1))

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table piece's weights (views, not copies), by table name."""
        return {
            t.table.name: w for t, w in zip(self.local_tables, self._table_views(), strict=True)
        }

    def export_state(self) -> dict[str, torch.Tensor]:
        """Weights, optimizer state and step as flat named tensors (views), for checkpoints."""
        out: dict[str, torch.Tensor] = {}
        for t, w, s in zip(
            self.local_tables, self._table_views(), self._state_views(), strict=True
        ):
            out[f"{t.table.name}.weight"] = w
            for name, tensor in s.items():
                out[f"{t.table.name}.{name}"] = tensor
        out["step"] = torch.tensor(self.kernels[0].step if len(self.kernels) else 0)
        out.update(self.id_maps.state())
        return out

    def id_stats(self) -> dict[str, dict[str, int]]:
        """Per dynamic table: rows_used, admitted, evicted, default_lookups (none: hashed)."""
        return self.id_maps.stats()

    def id_owners(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per dynamic table: (row_id [R], used [R]) views, the id each used row holds (live
        updates)."""
        return self.id_maps.owners() if self.id_maps else {}

    def load_id_maps(self, maps: dict[str, torch.Tensor]) -> None:
        """The id maps of its dynamic tables, ``<table>.idmap.<name>`` -> tensor (others
        ignored)."""
        if self.id_maps:
            self.id_maps.load(maps)

    @torch.no_grad()
    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a state written by :meth:`export_state` (of either kernel) into this shard."""
        mine = self.export_state()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for name, dst in mine.items():
            if name == "step" or ".idmap." in name:
                continue
            src = state[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(src.shape)}, model {tuple(dst.shape)}"
                )
            dst.copy_(src)
        for kernel in self.kernels:
            kernel.step = int(state["step"])
        self.id_maps.load(state)


class ShardSet:
    """Several shards one server holds side by side (its chunks), seen as one for checkpoints and
    live updates: every table piece lives in exactly one of them."""

    def __init__(self, shards: list[EmbeddingShard]) -> None:
        self.shards = shards
        self.local_tables = [t for shard in shards for t in shard.local_tables]
        self.optimizer_config = shards[0].optimizer_config
        self.kernel_name = shards[0].kernel_name
        self.seed, self.init_scale = shards[0].seed, shards[0].init_scale
        self.kernels = [k for shard in shards for k in shard.kernels]
        self.touched = _TouchedSet([shard.touched for shard in shards])

    def state_names(self) -> tuple[str, ...]:
        return self.shards[0].state_names()

    def table_weights(self) -> dict[str, torch.Tensor]:
        return {name: w for shard in self.shards for name, w in shard.table_weights().items()}

    def export_state(self) -> dict[str, torch.Tensor]:
        return {key: value for shard in self.shards for key, value in shard.export_state().items()}

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        for shard in self.shards:
            shard.import_state(state)

    def id_stats(self) -> dict[str, dict[str, int]]:
        return {name: s for shard in self.shards for name, s in shard.id_stats().items()}

    def id_owners(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: o for shard in self.shards for name, o in shard.id_owners().items()}

    def load_id_maps(self, maps: dict[str, torch.Tensor]) -> None:
        for shard in self.shards:
            shard.load_id_maps(maps)


class _TouchedSet:
    """The trained rows of a :class:`ShardSet`'s pieces, piece i being the i-th piece of the set."""

    def __init__(self, parts: list[TouchedRows]) -> None:
        self.parts = parts
        self.where = [(p, i) for p in parts for i in range(len(p.last))]

    def since(self, piece: int, base_step: int | None) -> torch.Tensor:
        part, i = self.where[piece]
        return part.since(i, base_step)

    def restored(self, piece: int, ids: torch.Tensor, step: int) -> None:
        part, i = self.where[piece]
        part.restored(i, ids, step)

    def mark(self, piece: int, ids: torch.Tensor) -> None:
        part, i = self.where[piece]
        part.mark(i, ids)

    def close_cut(self, step: int) -> None:
        for part in self.parts:
            part.close_cut(step)

    def count(self) -> int:
        return sum(part.count() for part in self.parts)
