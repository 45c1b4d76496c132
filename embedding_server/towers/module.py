"""The tower module: compresses one tower's pooled embeddings on the parameter node, before they
cross to the trainers.

Shape letters: B examples, F_t features of the tower, D embedding dim, c_t outputs (c_t <= F_t),
P_t = F_t (F_t - 1) / 2 pairs.

    z [B, F_t, D] --mix A [c_t, F_t]--project [D, D']--> [B, c_t, D'] --+
         |                                                               +--> out [B, c_t, D']
         +--pairwise dots [B, P_t] --Linear--> [B, c_t * D'] ------------+

Two ways to compress, which multiply: fewer vectors (c_t < F_t) and shorter ones (D' < D).
Fewer vectors merge features, so the trainers see sums of their cross-tower interactions;
shorter vectors keep every feature and every cross-tower pair, each dot becoming a learned
bilinear form of rank D' (the projection is shared by all towers' outputs' dots only through
training, each tower owning its own).

The mix keeps each output a vector in the embedding space, so the trainers' dot interaction
over outputs is a learned, weighted sum of the original pairwise dots across towers; it starts
as sums over contiguous groups of the tower's features (scaled by 1/sqrt(group size)), which
for c_t = F_t is the identity, so a tower model starts close to the flat one. The pair branch
(zero at start) carries the interactions inside the tower, which the mix alone would blur. With
c_t = F_t the module is the identity (no parameters) and the tower model is exactly the flat
model.
"""

from __future__ import annotations

import torch
from torch import nn


class TowerModule(nn.Module):
    """Args:
    num_features: F_t.
    outputs: c_t vectors out.
    dim: D of the tables.
    out_dim: D' of the output vectors (a learned projection D -> D', shared by the tower's
        outputs; None: D).
    """

    def __init__(
        self, num_features: int, outputs: int, dim: int, out_dim: int | None = None
    ) -> None:
        super().__init__()
        out_dim = out_dim or dim
        self.num_features, self.outputs, self.dim, self.out_dim = (
            num_features,
            outputs,
            dim,
            out_dim,
        )
        self.identity = outputs == num_features and out_dim == dim
        if not self.identity:
            rows, cols = torch.triu_indices(num_features, num_features, offset=1)
            self.register_buffer("upper", rows * num_features + cols, persistent=False)
            mix = torch.zeros(outputs, num_features)
            for k in range(outputs):  # contiguous groups of near-equal size
                lo, hi = k * num_features // outputs, (k + 1) * num_features // outputs
                mix[k, lo:hi] = (hi - lo) ** -0.5
            self.mix = nn.Parameter(mix)
            # D -> D': orthonormal columns scaled by sqrt(D / D'), so dots keep their size on
            # average
            self.project = (
                nn.Parameter(torch.linalg.qr(torch.randn(dim, out_dim))[0] * (dim / out_dim) ** 0.5)
                if out_dim != dim
                else None
            )
            self.pairs = nn.Linear(self.upper.numel(), outputs * out_dim)
            nn.init.zeros_(self.pairs.weight)
            nn.init.zeros_(self.pairs.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, F_t, D] -> [B, c_t, D]."""
        if self.identity:
            return z
        b, f, _ = z.shape
        mixed = torch.einsum("kf,bfd->bkd", self.mix, z)  # [B, c_t, D]
        if self.project is not None:
            mixed = mixed @ self.project  # [B, c_t, D']
        # [B, P_t]
        pairs = torch.bmm(z, z.transpose(1, 2)).view(b, f * f).index_select(1, self.upper)
        return mixed + self.pairs(pairs).view(b, self.outputs, self.out_dim)
