"""A plain PyTorch DLRM: the baseline a user writes without fbgemm or TorchRec.

26 ``nn.EmbeddingBag(sparse=True)`` tables trained by ``torch.optim.SparseAdam``, bottom and top
MLPs and the dot interaction in a few lines, dense parameters trained by Adam. Used by
``bench/quality.py`` and ``bench/train_throughput.py``; not part of the package.
"""

from __future__ import annotations

import torch
from torch import nn


def _mlp(sizes: list[int], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if relu_last or i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


class PlainDLRM(nn.Module):
    def __init__(
        self,
        rows: list[int],
        dim: int,
        bottom: list[int],
        top: list[int],
        num_dense: int = 13,
        init_scale: float | None = None,
    ):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="sum", sparse=True) for r in rows)
        for t, r in zip(self.tables, rows, strict=True):
            bound = init_scale or (1 / r) ** 0.5  # the DLRM reference's rule unless told otherwise
            nn.init.uniform_(t.weight, -bound, bound)
        self.bottom = _mlp([num_dense, *bottom, dim], relu_last=True)
        n = len(rows) + 1
        self.register_buffer("iu", torch.triu_indices(n, n, 1), persistent=False)
        self.top = _mlp([dim + n * (n - 1) // 2, *top, 1], relu_last=False)

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """dense [B, 13]; values/offsets in TBE layout (feature-major, F*B + 1 offsets)."""
        b = dense.shape[0]
        x = self.bottom(dense)  # [B, D]
        embs = []
        for f, table in enumerate(self.tables):
            offs = offsets[f * b : (f + 1) * b + 1]
            embs.append(table(values[offs[0] : offs[-1]], offs[:-1] - offs[0]))  # [B, D]
        z = torch.stack([x, *embs], dim=1)  # [B, N, D]
        pairs = torch.bmm(z, z.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)

    def optimizers(self, sparse_lr: float, dense_lr: float) -> list[torch.optim.Optimizer]:
        sparse = list(self.tables.parameters())
        dense = [p for n, p in self.named_parameters() if not n.startswith("tables.")]
        return [torch.optim.SparseAdam(sparse, lr=sparse_lr), torch.optim.Adam(dense, lr=dense_lr)]
