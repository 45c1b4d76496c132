"""The dense side of DLRM, named as TorchRec names its stages.

    dense [B, I] --DenseArch--> [B, D] --+
                                         +--InteractionArch--> [B, K] --OverArch--> logit [B]
    embedded [B, sum D_t] (SparseArch) --+

The SparseArch is not here: the embeddings come from an ``EmbeddingClient`` (tables in this
process or on embedding servers), so this module holds only dense parameters: it is what the
dense optimizer steps, what DDP wraps, what a checkpoint's ``dense.pt`` and a serving replica
hold. It imports no embedding kernel, so that the serving process can build its network.
"""

from __future__ import annotations

import torch
from torch import nn

from dense_trainer.config import ModelConfig


class MLP(nn.Sequential):
    """Linear layers with ReLUs, as ``nn.Sequential`` (same parameters, same state dict).

    Without autograd (evaluation, serving) the layers run as bare ``addmm`` / ``relu_`` calls,
    without a module call per layer, bit for bit ``nn.Linear`` (``F.linear`` of a 2-D input is
    ``addmm(b, x, W^T)``). A served network is frozen (:func:`freeze_for_serving`): its weights
    never change, so each layer keeps a copy laid out [in, out], which BLAS multiplies faster for
    a few examples (up to 2x for one) and no slower for many; its results equal the unfrozen ones
    to float rounding (the sums run in another order).
    """

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.frozen: list[torch.Tensor | None] | None = None
        """Per layer, W^T contiguous [in, out] of a frozen network (None: not frozen)."""

    def freeze(self) -> None:
        """Copy every weight as [in, out] for the no-autograd path; the weights must not change
        afterwards (a served version's network is rebuilt, never updated in place)."""
        self.frozen = [
            layer.weight.detach().t().contiguous() if type(layer) is nn.Linear else None
            for layer in self
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dim() != 2:
            return super().forward(x)
        frozen = self.frozen
        for i, layer in enumerate(self):
            if type(layer) is nn.Linear:
                x = torch.addmm(
                    layer.bias, x, frozen[i] if frozen is not None else layer.weight.t()
                )
            elif type(layer) is nn.ReLU:
                x = x.relu_()  # on the previous layer's own output
            else:
                x = layer(x)
        return x


def freeze_for_serving(module: nn.Module) -> nn.Module:
    """Freeze every MLP of ``module`` (:meth:`MLP.freeze`); returns it."""
    for m in module.modules():
        if isinstance(m, MLP):
            m.freeze()
    return module


def mlp(sizes: list[int], relu_last: bool, dropout: float = 0.0) -> MLP:
    """Linear layers of ``sizes``, a ReLU after each but (unless ``relu_last``) the last; with
    ``dropout``, a dropout layer after each hidden ReLU (identity in evaluation and serving)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if relu_last or i < len(sizes) - 2:
            layers.append(nn.ReLU())
            if dropout and i < len(sizes) - 2:
                layers.append(nn.Dropout(dropout))
    return MLP(*layers)


class DenseArch(nn.Module):
    """Bottom MLP: dense features [B, I] -> [B, D] (ReLU after every layer, as in TorchRec)."""

    def __init__(self, in_features: int, layer_sizes: list[int]) -> None:
        super().__init__()
        self.model = mlp([in_features, *layer_sizes], relu_last=True)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.model(dense)


class _PairwiseDots(torch.autograd.Function):
    """Upper-triangle dot products of N vectors, with a backward that uses the symmetry.

    Forward: gram = Z Z^T (one bmm), then the P = N(N-1)/2 entries above the diagonal.
    Backward: dZ = (G + G^T) Z with G the pair gradients scattered into N x N: one bmm, where
    autograd's generic backward of ``bmm(Z, Z^T)`` would run two (one per operand).
    """

    @staticmethod
    def forward(ctx, z, upper, lower):  # z [B, N, D]; upper/lower: flat indices of (i<j) and (j>i)
        b, n, _ = z.shape
        gram = torch.bmm(z, z.transpose(1, 2))  # [B, N, N]
        ctx.save_for_backward(z, upper, lower)
        return gram.view(b, n * n).index_select(1, upper)  # [B, P]

    @staticmethod
    def backward(ctx, grad_pairs):  # [B, P]
        z, upper, lower = ctx.saved_tensors
        b, n, _ = z.shape
        sym = grad_pairs.new_zeros(b, n * n)
        sym.index_copy_(1, upper, grad_pairs)
        sym.index_copy_(1, lower, grad_pairs)  # G + G^T (the diagonal is never selected)
        return torch.bmm(sym.view(b, n, n), z), None, None  # [B, N, D]


class InteractionArch(nn.Module):
    """DLRM dot interaction: pairwise dot products of the F + 1 vectors, plus the dense one.

    [B, D] and [B, F, D] -> [B, D + (F+1)F/2]; without dense features (``with_dense=False``)
    [B, F, D] -> [B, F(F-1)/2].
    """

    def __init__(self, num_sparse_features: int, with_dense: bool = True) -> None:
        super().__init__()
        self.with_dense = with_dense
        n = num_sparse_features + (1 if with_dense else 0)
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("upper", rows * n + cols, persistent=False)  # flat (i, j), i < j
        self.register_buffer("lower", cols * n + rows, persistent=False)  # flat (j, i)

    @property
    def num_pairs(self) -> int:
        return self.upper.numel()

    def _dots(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, N, D] -> upper-triangle dots [B, P]; without autograd (serving), the forward's
        own two ops, without the autograd.Function's per-call cost."""
        if torch.is_grad_enabled():
            return _PairwiseDots.apply(z, self.upper, self.lower)
        b, n, _ = z.shape
        return torch.bmm(z, z.transpose(1, 2)).view(b, n * n).index_select(1, self.upper)

    def forward(self, dense: torch.Tensor | None, sparse: torch.Tensor) -> torch.Tensor:
        if not self.with_dense:
            return self._dots(sparse)  # [B, F(F-1)/2]
        combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, F+1, D]
        pairs = self._dots(combined)  # [B, (F+1)F/2]
        return torch.cat([dense, pairs], dim=1)  # [B, D + (F+1)F/2]


class LowRankCrossNet(nn.Module):
    """DCN-v2 cross layers: x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l, over [B, K]."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        rank = low_rank if 0 < low_rank < in_features else None
        self.v = nn.ModuleList(
            nn.Linear(in_features, rank, bias=False) if rank else nn.Identity()
            for _ in range(num_layers)
        )
        self.u = nn.ModuleList(
            nn.Linear(rank or in_features, in_features, bias=True) for _ in range(num_layers)
        )
        for layer in [*self.v, *self.u]:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_normal_(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, u in zip(self.v, self.u, strict=True):
            x = x0 * u(v(x)) + x  # [B, K]
        return x


class InteractionDCNArch(nn.Module):
    """DCN-v2 interaction over the concatenation of dense and all embeddings.

    [B, D] and [B, sum(D_t)] -> [B, D + sum(D_t)]
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.crossnet = LowRankCrossNet(in_features, num_layers, low_rank)

    def forward(self, dense: torch.Tensor | None, sparse_flat: torch.Tensor) -> torch.Tensor:
        return self.crossnet(
            sparse_flat if dense is None else torch.cat([dense, sparse_flat], dim=1)
        )


class OverArch(nn.Module):
    """Top MLP: [B, K] -> logit [B, 1] (no activation on the last layer)."""

    def __init__(self, in_features: int, layer_sizes: list[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.model = mlp([in_features, *layer_sizes, 1], relu_last=False, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class DLRMDense(nn.Module):
    """DenseArch + InteractionArch (dot or DCN-v2) + OverArch.

    Args:
        num_dense: I, dense features (0: no bottom MLP; a learned vector takes the dense vector's
            place in the interaction, so that its dots with the embeddings carry each id's own
            effect, which dots between embeddings alone learn slowly).
        table_dims: D_f of each categorical feature (or tower output), in order (may be empty:
            then the over arch sees the bottom MLP's output alone).
        cfg: layer sizes and interaction; ``first_order``: each table's first column is its
            ids' scalar weights, summed into the logit, and the interaction sees the rest
            (``embedding_dim`` - 1 columns).
        append_embeddings: the over arch also sees the embedded vectors themselves (dot
            interaction only): with compressed towers, their outputs carry each tower's own
            interactions linearly, which dot products alone would blur.
    """

    def __init__(
        self,
        num_dense: int,
        table_dims: list[int],
        cfg: ModelConfig,
        embedding_dim: int,
        append_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.first_order = cfg.first_order and bool(table_dims)
        if self.first_order:  # each table's first column is its ids' scalar weights
            self.full_dims = list(table_dims)
            table_dims = [t - 1 for t in table_dims]
            embedding_dim -= 1
        self.table_dims = list(table_dims)
        d = self.dim = embedding_dim
        self.dense_arch = (
            DenseArch(num_dense, [*cfg.dense_arch_layer_sizes, d]) if num_dense else None
        )
        self.dense_vector = None if num_dense else nn.Parameter(torch.full((d,), d**-0.5))  # [D]
        dense_out = d if num_dense or table_dims else 0
        # Tables whose dim differs from D are projected to D for the dot interaction.
        self.mixed_dims = any(t != d for t in table_dims)
        self.project = (
            nn.ModuleList(
                nn.Identity() if t == d else nn.Linear(t, d, bias=False) for t in table_dims
            )
            if self.mixed_dims and cfg.interaction == "dot"
            else None
        )
        self.append_embeddings = append_embeddings and cfg.interaction == "dot"
        self.interaction = cfg.interaction if table_dims else "none"
        if self.interaction == "dot":
            self.inter_arch: nn.Module | None = InteractionArch(len(table_dims))
            over_in = (
                dense_out
                + self.inter_arch.num_pairs
                + (sum(table_dims) if self.append_embeddings else 0)
            )
        elif self.interaction == "dcn":
            over_in = dense_out + sum(table_dims)
            self.inter_arch = InteractionDCNArch(over_in, cfg.dcn_num_layers, cfg.dcn_low_rank)
        else:  # no categorical feature: the bottom MLP feeds the over arch
            over_in, self.inter_arch = dense_out, None
        self.over_arch = OverArch(over_in, cfg.over_arch_layer_sizes, cfg.dropout)
        # wide: a linear first-order term over the raw inputs, added to the logit
        self.wide = nn.Linear(num_dense + sum(table_dims), 1) if cfg.wide else None
        if self.wide is not None:
            nn.init.zeros_(self.wide.weight)
            nn.init.zeros_(self.wide.bias)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """dense float [B, I], embedded float [B, sum(D_f)] -> logits float [B]
        (``first_order``: embedded [B, sum(1 + D_f)], each table's scalar first)."""
        first = None
        if self.first_order:
            first, embedded = self._split_first_order(embedded)  # [B], [B, sum(D_f)]
        logit = self._deep(dense, embedded)
        return logit if first is None else logit + first

    def _split_first_order(self, embedded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded [B, sum(1 + D_f)] -> (sum of the tables' scalars [B], the rest
        [B, sum(D_f)])."""
        b = embedded.shape[0]
        if not self.mixed_dims:
            v = embedded.view(b, len(self.full_dims), self.dim + 1)  # [B, F, 1 + D]
            return v[:, :, 0].sum(1), v[:, :, 1:].reshape(b, len(self.full_dims) * self.dim)
        parts = torch.split(embedded, self.full_dims, dim=1)
        first = torch.stack([p[:, 0] for p in parts], 1).sum(1)  # [B]
        return first, torch.cat([p[:, 1:] for p in parts], 1)

    def _deep(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The DLRM's logit: dense [B, I], embedded [B, sum(D_f)] -> [B]."""
        if self.dense_arch is not None:
            x = self.dense_arch(dense)  # [B, D]
        else:
            x = self.dense_vector.expand(embedded.shape[0], -1)  # [B, D]
        if self.interaction == "none":
            z = x
        elif self.interaction == "dcn":
            z = self.inter_arch(x, embedded)  # [B, D + sum(D_f)]
        else:
            if self.project is None:
                # [B, F, D]
                sparse = embedded.view(embedded.shape[0], len(self.table_dims), self.dim)
            else:
                parts = torch.split(embedded, self.table_dims, dim=1)
                sparse = torch.stack([p(e) for p, e in zip(self.project, parts, strict=True)], 1)
            z = self.inter_arch(x, sparse)  # [B, D + (F+1)F/2]
            if self.append_embeddings:
                z = torch.cat([z, embedded], dim=1)  # [B, D + (F+1)F/2 + sum(D_f)]
        logit = self.over_arch(z).squeeze(1)  # [B]
        if self.wide is not None:
            logit = logit + self.wide(torch.cat([dense, embedded], dim=1)).squeeze(1)
        return logit


class LogisticRegression(nn.Module):
    """Hashed-feature logistic regression: logit = w . dense + sum_f e_f[id_f] + b.

    The per-row weights e_f are dim-1 embedding tables (trained by the fused sparse optimizer).
    """

    def __init__(self, num_dense: int, num_sparse: int) -> None:
        super().__init__()
        self.num_sparse = num_sparse
        self.linear = nn.Linear(num_dense, 1)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """dense [B, I], embedded [B, F] -> logits [B]."""
        return self.linear(dense).squeeze(1) + embedded.sum(dim=1)


class TowerDLRM(nn.Module):
    """A compressed tower model in one process, for serving and offline scoring: each tower's
    module (trained on the embedding servers) over its features, then the trainers' dense model.

    dense [B, I], embedded [B, F * D] (table order) -> logits [B]
    """

    def __init__(
        self, features_of: list[list[int]], towers: nn.ModuleList, net: nn.Module, dim: int
    ) -> None:
        super().__init__()
        self.features_of = [list(t) for t in features_of]
        self.towers = towers
        self.net = net
        self.dim = dim

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        z = embedded.view(embedded.shape[0], sum(map(len, self.features_of)), self.dim)  # [B, F, D]
        # [B, c_t, D']
        outs = [
            tower(z[:, tables]) for tower, tables in zip(self.towers, self.features_of, strict=True)
        ]
        return self.net(dense, torch.cat(outs, dim=1).flatten(1))  # [B, C * D'] -> [B]


def build_served_model(
    cfg: ModelConfig, spec, embedding_dim: int, towers: dict | None = None
) -> nn.Module:
    """The network a published version runs on pooled embeddings in table order: the dense model,
    or with a compressed tower plan (``ModelVersion.towers``) the tower modules before it."""
    dims = spec.feature_dims
    if not towers:
        return build_dense_model(cfg, spec.dense_width, dims, embedding_dim)
    from embedding_server.towers.module import TowerModule
    from embedding_server.towers.plan import TowerPlan

    plan = TowerPlan(towers=towers["towers"])
    index = {name: i for i, name in enumerate(spec.sparse_names)}
    features_of = [[index[f] for f in tower.features] for tower in plan.towers]
    outputs = [tower.outputs for tower in plan.towers]
    dim, out_dim = dims[0], towers["out_dim"]
    modules = nn.ModuleList(
        TowerModule(len(t), c, dim, out_dim) for t, c in zip(features_of, outputs, strict=True)
    )
    net = build_dense_model(
        cfg, spec.dense_width, [out_dim] * sum(outputs), out_dim, append_embeddings=True
    )
    return TowerDLRM(features_of, modules, net, dim)


def build_dense_model(
    cfg: ModelConfig,
    num_dense: int,
    table_dims: list[int],
    embedding_dim: int,
    append_embeddings: bool = False,
) -> nn.Module:
    if cfg.kind == "lr":
        return LogisticRegression(num_dense, len(table_dims))
    return DLRMDense(num_dense, table_dims, cfg, embedding_dim, append_embeddings)
