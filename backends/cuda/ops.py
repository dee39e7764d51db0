"""The cuda backend's ops: Triton kernels for norms, activations, rotary with the cache write, paged
attention, latent attention, sampling, int4 GEMMs, the experts of a mixture-of-experts layer, and the
one-row products of 16-bit weights where the GPU's measured table chose our GEMV; torch (cuBLAS) for the
other dense GEMMs and the rest."""

from __future__ import annotations

import os

from candelabra.backends.cuda.kernels import activations, dense_gemv, fused_moe, norms, rotary, sampling
from candelabra.backends.cuda.kernels.latent_attention import paged_latent_attention
from candelabra.backends.cuda.kernels.paged_attention import DecodeRotary, fuses_rotary, paged_attention
from candelabra.backends.cuda.quantized import Int4CudaWeight
from candelabra.backends.torch.expert_weights import ExpertWeights
from candelabra.backends.torch.ops import TorchOps
from candelabra.core.contract.ops import KVCache, check_experts_shapes

# CANDELABRA_DECODE_FUSIONS=0 runs the ops that rms_norm_gated_mlp and rotary_and_paged_attention fuse in turn
# (bench/gpu_check.sh's bench-unfused measures what the fusions gain).
FUSIONS_SWITCH = "CANDELABRA_DECODE_FUSIONS"


def fusing() -> bool:
    return os.environ.get(FUSIONS_SWITCH, "1").strip() != "0"


class CudaOps(TorchOps):
    backend_name = "cuda"

    def __init__(self, device) -> None:
        super().__init__(device)
        self.fusing = fusing()  # read once: the ops below ask at every layer

    def linear(self, x, weight, bias=None):
        if isinstance(weight, Int4CudaWeight):
            return weight.matmul(x, bias)
        out = _one_row_gemv(x, weight, bias)
        return out if out is not None else super().linear(x, weight, bias)

    def gated_linear(self, x, weight, bias=None, activation="silu"):
        """One launch where the GPU's dense table chose the GEMV for the weight at one row (the activation
        computed as the GEMV loads x); else the activation's kernel, then `linear`. int4 weights take the
        two in turn too: their GEMV issues about four instructions a weight, as many as the HBM's pace
        allows, and the activation would add to them."""
        out = _one_row_gemv(x, weight, bias, activation)
        return out if out is not None else super().gated_linear(x, weight, bias, activation)

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, weight_offset=0.0):
        """One launch at one row where a GEMV serves the weight, normalising x as it loads it: int4 weights' GEMV
        (but for columns stored in act order), and the 16-bit GEMV where the GPU's dense table chose it; else
        the norm's kernel, then `linear`."""
        norm = _one_row_norm(x, residual, norm_weight, eps, weight_offset)
        done = None if norm is None else _normed_one_row(x.reshape(1, -1), norm, weight, bias)
        if done is not None:
            out, joined = done
            return out.reshape(*x.shape[:-1], -1), x if residual is None else joined.reshape(x.shape)
        return super().rms_norm_linear(x, residual, norm_weight, eps, weight, bias, weight_offset)

    def rms_norm_gated_mlp(self, x, residual, norm_weight, eps, gate_up, down, gate_up_bias=None, down_bias=None,
                           weight_offset=0.0, activation="silu"):
        """At one row, where a GEMV serves the gate and up weight (int4, or 16-bit where the GPU's dense table
        chose the GEMV), that GEMV normalising x as it loads it and writing the gated values, then `linear`
        for down: two launches for the MLP. Elsewhere `rms_norm_linear`, then `gated_linear`."""
        if activation not in activations.GATED_KINDS:
            raise ValueError(f"unknown gated activation {activation!r}; expected one of "
                             f"{tuple(activations.GATED_KINDS)}")
        norm = _one_row_norm(x, residual, norm_weight, eps, weight_offset) if self.fusing else None
        done = None if norm is None else _normed_one_row(x.reshape(1, -1), norm, gate_up, gate_up_bias, activation)
        if done is not None:
            gated, joined = done
            out = self.linear(gated, down, down_bias)
            return out.reshape(*x.shape[:-1], -1), x if residual is None else joined.reshape(x.shape)
        return super().rms_norm_gated_mlp(x, residual, norm_weight, eps, gate_up, down, gate_up_bias, down_bias,
                                          weight_offset, activation)

    def rms_norm(self, x, weight, eps, weight_offset=0.0):
        return norms.rms_norm(x, weight, eps, weight_offset)

    def add_rms_norm(self, x, residual, weight, eps, weight_offset=0.0):
        return norms.add_rms_norm(x, residual, weight, eps, weight_offset)

    def rotary(self, q, k, positions, cos_sin, style="neox"):
        return rotary.rotary(q, k, positions, cos_sin, style)

    def silu_and_mul(self, x):
        return activations.silu_and_mul(x)

    def gelu_and_mul(self, x, approximate="none"):
        return activations.gelu_and_mul(x, approximate)

    def gelu(self, x, approximate="none"):
        return activations.gelu(x, approximate)

    def write_kv(self, cache: KVCache, key, value, slot_mapping):
        rotary.write_kv(cache.key, cache.value, key, value, slot_mapping)
        return cache

    def rotary_and_write_kv(self, q, k, v, positions, cos_sin, cache: KVCache, slot_mapping, style="neox"):
        q = rotary.rotary_write_kv(q, k, v, positions, cos_sin, style, cache.key, cache.value, slot_mapping)
        return q, cache

    def paged_attention(self, q, cache: KVCache, step, scale, sliding_window=None, logit_softcap=None):
        return paged_attention(q, cache.key, cache.value, step, scale, sliding_window, logit_softcap)

    def rotary_and_paged_attention(self, q, k, v, positions, cos_sin, cache: KVCache, slot_mapping, step, scale,
                                   sliding_window=None, logit_softcap=None, style="neox"):
        """In a step of decodes alone over a float cache, one launch: the attention's tiles rotate q as they
        load it, and the segment holding each token's own key rotates it and writes it and the value to the
        cache first. Elsewhere `rotary_and_write_kv`, then `paged_attention`."""
        rotary = DecodeRotary(k, v, positions, cos_sin, style, slot_mapping)
        if self.fusing and fuses_rotary(q, cache.key, cache.value, step, rotary):
            return paged_attention(q, cache.key, cache.value, step, scale, sliding_window, logit_softcap, rotary), cache
        return super().rotary_and_paged_attention(q, k, v, positions, cos_sin, cache, slot_mapping, step, scale,
                                                  sliding_window, logit_softcap, style)

    def moe_experts(self, x, weights, expert_ids, gate_up, down, first_expert=0):
        """The picks sorted by expert and two grouped GEMMs, all on the device (kernels/fused_moe.py):
        nothing waits for the host, so a decode step with experts replays from a CUDA graph. Experts kept
        quantized one by one (int4) run torch's per-expert path through the int4 GEMM instead."""
        if isinstance(gate_up, ExpertWeights) or isinstance(down, ExpertWeights):
            return super().moe_experts(x, weights, expert_ids, gate_up, down, first_expert)
        check_experts_shapes(x, weights, expert_ids, gate_up, down, first_expert)
        return fused_moe.moe_experts(x, weights, expert_ids, gate_up, down, first_expert=first_expert)

    def paged_latent_attention(self, q_latent, q_rope, cache: KVCache, step, scale):
        return paged_latent_attention(q_latent, q_rope, cache.key, cache.value, step, scale)

    def sample(self, logits, params):
        return sampling.sample(logits, params)


def _one_row_gemv(x, weight, bias, gated=None):
    """x @ weight.T (+ bias) by the 16-bit GEMV (of x's gated values, with `gated` an activation) where the
    GPU's dense table chose it for this one-row product; None where cuBLAS serves it."""
    tiling = _one_row_tiling(x, weight, bias, gated is not None)
    if tiling is None:
        return None
    return dense_gemv.dense_gemv(x.reshape(1, -1), weight, tiling, bias, gated=gated).reshape(*x.shape[:-1], -1)


def _one_row_norm(x, residual, norm_weight, eps, weight_offset):
    """The norm of a one-row x (and its residual) as the GEMVs take it, None where x has more rows."""
    if x.numel() != x.shape[-1] or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        return None
    return norms.RowNorm(norm_weight, eps, weight_offset, None if residual is None else residual.reshape(1, -1))


def _normed_one_row(row, norm, weight, bias, gate_output=None):
    """(product, row plus residual) of `Ops.rms_norm_linear` for one row by a GEMV normalising it as it loads
    it (with `gate_output` an activation, of a gated MLP's gate and up weight, their gated values), or None
    where none serves the weight."""
    if isinstance(weight, Int4CudaWeight):
        return weight.normed_matmul(row, norm, bias, gate_output)
    tiling = _one_row_tiling(row, weight, bias)
    if tiling is None or (gate_output is not None and (tiling.block_n < 2 or weight.shape[0] % 2)):
        return None
    return dense_gemv.normed_dense_gemv(row, norm, weight, tiling, bias, gate_output)


def _one_row_tiling(x, weight, bias, gated=False):
    """The GEMV tiling the GPU's dense table chose for this one-row product, None where cuBLAS serves it."""
    tiling = dense_gemv.chosen_tiling(x, weight, gated=gated)
    if tiling is None or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())):
        return None
    return tiling
