"""PackedLinear: one Linear computing several projections side by side (q|k|v, gate|up)."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class PackedLinear(nn.Linear):
    """`output_sizes` says which output columns belong to which projection; LoRAManager reads it to
    put each sub-adapter in its slice (the model's `packed_modules_mapping` names the projections)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)
