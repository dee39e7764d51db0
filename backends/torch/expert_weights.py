"""A MoE layer's experts kept quantized by a torch backend: one handle per expert, each the form the
backend keeps a linear weight of that format and shape in, so that `moe_experts` multiplies each expert
a token chose by the kernels a dense model's quantized linear weights run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ExpertWeights:
    """[experts, out_features, in_features] as one handle per expert that `Ops.linear` takes, indexed and
    shaped as a 3-D tensor is."""

    def __init__(self, experts: Sequence[Any], shape: tuple[int, int, int]) -> None:
        if len(experts) != shape[0]:
            raise ValueError(f"{len(experts)} expert weights for a stack of shape {shape}")
        self.experts = tuple(experts)
        self.shape = tuple(shape)

    def __getitem__(self, expert: int) -> Any:
        return self.experts[expert]

    def __len__(self) -> int:
        return len(self.experts)
