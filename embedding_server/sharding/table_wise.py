"""Table-wise: the whole table lives on one server.

input_dist:  the table's bags go unchanged to that server
lookup:      the server pools them (sum or mean) in its fused TBE call
output_dist: pooled [B, D] comes back unchanged; its gradient [B, D] goes back unchanged
"""

from __future__ import annotations

import torch


def route(
    values: torch.Tensor, lengths: torch.Tensor, pieces, table
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(values, lengths)]


def combine(outputs: list[torch.Tensor], lengths: torch.Tensor, table) -> torch.Tensor:
    return outputs[0]


def split_grad(grad: torch.Tensor, lengths: torch.Tensor, pieces, table) -> list[torch.Tensor]:
    return [grad]
