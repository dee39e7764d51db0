"""Stands in for vLLM's kernels on the CPU stand-in (CANDELABRA_STAND_IN=gcu): the same calling
convention, in plain torch, so that the override table and its adapters run in CI as on the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    gate, up = x.float().chunk(2, dim=-1)
    out.copy_(F.silu(gate) * up)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    x32 = x.float()
    out.copy_(x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * weight.float())


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    residual.add_(x)
    rms_norm(x, residual, weight, eps)
