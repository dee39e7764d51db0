"""The ops in PyTorch, for any torch device. Semantics are those of `candelabra.core.contract.ops.Ops`.

Norms, activations and rotary embedding compute in float32 and round to the input dtype once;
matmuls run in the input dtype with float32 accumulation, as torch's kernels do.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from candelabra.backends.torch import attention, sampling
from candelabra.backends.torch.cpu import decode_attention
from candelabra.backends.torch.cpu.block_products import NativeBlocksWeight
from candelabra.backends.torch.quantized_kv import is_quantized, quantize_rows
from candelabra.backends.torch.row_stack import RowStackWeight
from candelabra.backends.torch.weight_forms import KeptWeight
from candelabra.core.contract.ops import (
    KVCache,
    Ops,
    SampleResult,
    TokenLogprobs,
    check_experts_shapes,
    check_routing,
)


class TorchOps(Ops):
    backend_name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def embedding(self, ids, table, scale=None):
        rows = table.rows(ids) if isinstance(table, KeptWeight) else F.embedding(ids, table)
        return rows * scale if scale is not None else rows

    def gather_rows(self, x, rows):
        return x.index_select(0, rows)

    def linear(self, x, weight, bias=None):
        if isinstance(weight, (KeptWeight, RowStackWeight)):
            out = weight.matmul(x)
            return out + bias if bias is not None else out
        return F.linear(x, weight, bias)

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, weight_offset=0.0):
        # Where the weight's blocks are read by the chosen kernel, the norm is done as x's rows are prepared for
        # it: one call instead of some ten small torch ops, each slow after the product has swept the caches.
        fused = (weight.normed_matmul(x, residual, norm_weight, eps, weight_offset)
                 if isinstance(weight, NativeBlocksWeight) else None)
        if fused is None:
            return super().rms_norm_linear(x, residual, norm_weight, eps, weight, bias, weight_offset)
        out, joined = fused
        return (out + bias if bias is not None else out), joined

    def gated_linear(self, x, weight, bias=None, activation="silu"):
        # silu(gate) * up done as x's rows are prepared for a block kernel, as rms_norm_linear's norm is
        fused = weight.gated_matmul(x) if isinstance(weight, NativeBlocksWeight) and activation == "silu" else None
        if fused is None:
            return super().gated_linear(x, weight, bias, activation)
        return fused + bias if bias is not None else fused

    def rms_norm(self, x, weight, eps, weight_offset=0.0):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        scale = weight.float() + weight_offset if weight_offset else weight.float()
        return (normed * scale).to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps, weight_offset=0.0):
        summed = x + residual
        return self.rms_norm(summed, weight, eps, weight_offset), summed

    def layer_norm(self, x, weight, bias, eps):
        out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
        return out.to(x.dtype)

    def rotary(self, q, k, positions, cos_sin, style="neox"):
        half = cos_sin.shape[1] // 2
        table = cos_sin.index_select(0, positions)
        cos, sin = table[:, None, :half], table[:, None, half:]
        return _rotate(q, cos, sin, style), _rotate(k, cos, sin, style)

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(x.dtype)

    def gelu_and_mul(self, x, approximate="none"):
        gate, up = x.chunk(2, dim=-1)
        return (F.gelu(gate.float(), approximate=approximate) * up.float()).to(x.dtype)

    def gelu(self, x, approximate="none"):
        return F.gelu(x.float(), approximate=approximate).to(x.dtype)

    def write_kv(self, cache, key, value, slot_mapping):
        slots = slot_mapping.long()
        # NO_SLOT tokens (padding) are dropped by a boolean mask: its data-dependent shape costs a CPU
        # nothing, and a device that captures steps (cuda) writes the cache with a kernel of its own.
        padded = bool((slots < 0).any())
        if padded:
            written = slots >= 0
            slots, key, value = slots[written], key[written], value[written]
        for target, rows in ((cache.key, key), (cache.value, value)):
            rows = quantize_rows(rows, target.dtype) if is_quantized(target) else rows.to(target.dtype)
            target.view(-1, *target.shape[2:]).index_copy_(0, slots, rows)
        return cache

    def rotary_and_write_kv(self, q, k, v, positions, cos_sin, cache, slot_mapping, style="neox"):
        if decode_attention.rotates_natively(q, k, v, cos_sin, cache):
            return decode_attention.rotary_and_write(q, k, v, positions, cos_sin, cache, slot_mapping, style), cache
        return super().rotary_and_write_kv(q, k, v, positions, cos_sin, cache, slot_mapping, style)

    def rotary_and_paged_attention(self, q, k, v, positions, cos_sin, cache, slot_mapping, step, scale,
                                   sliding_window=None, logit_softcap=None, style="neox"):
        decodes = attention.decodes_alone(step)
        if decodes is not None and decode_attention.rotates_natively(q, k, v, cos_sin, cache):
            attended = decode_attention.rotary_and_decode_attention(
                q, k, v, positions, cos_sin, cache, slot_mapping, decodes.block_tables, decodes.seq_lens, scale,
                sliding_window, logit_softcap, style)
            return attended.to(q.dtype), cache
        return super().rotary_and_paged_attention(q, k, v, positions, cos_sin, cache, slot_mapping, step, scale,
                                                  sliding_window, logit_softcap, style)

    def paged_attention(self, q, cache: KVCache, step, scale, sliding_window=None, logit_softcap=None):
        return attention.paged_attention(q, cache, step, scale, sliding_window, logit_softcap)

    def softcap(self, x, cap):
        return (torch.tanh(x.float() / cap) * cap).to(x.dtype)

    def softmax(self, x):
        return torch.softmax(x.float(), dim=-1).to(x.dtype)

    def sample(self, logits, params) -> SampleResult:
        return sampling.sample(logits, params)

    def token_logprobs(self, logits, token_ids, num_top: int) -> TokenLogprobs:
        return sampling.token_logprobs(logits, token_ids, num_top)

    def route_experts(self, router_logits, top_k, scoring="softmax", renormalize=True, scale=1.0, num_groups=1,
                      top_groups=1, group_scoring="max", correction_bias=None):
        check_routing(router_logits.shape[-1], top_k, scoring, num_groups, top_groups, group_scoring)
        logits = router_logits.float()
        scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
        choice = scores + correction_bias.float() if correction_bias is not None else scores
        if num_groups > 1:
            choice = _keep_best_groups(choice, num_groups, top_groups, group_scoring)
        expert_ids = _best_first(choice)[:, :top_k]
        weights = scores.gather(1, expert_ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scale, expert_ids.int()

    def per_head_linear(self, x, weight):
        return torch.matmul(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)

    def paged_latent_attention(self, q_latent, q_rope, cache: KVCache, step, scale):
        return attention.paged_latent_attention(q_latent, q_rope, cache, step, scale)

    def moe_experts(self, x, weights, expert_ids, gate_up, down, first_expert=0):
        """The picks sorted by expert, then one pair of matmuls per expert held that some token chose, by
        `linear`: an expert kept quantized (`ExpertWeights`) runs its form's kernels. The picks of experts
        not held sort last, counted as one more expert, and are left out. Counting the picks per expert
        waits for the device, so a step with experts cannot be captured."""
        check_experts_shapes(x, weights, expert_ids, gate_up, down, first_expert)
        held = gate_up.shape[0]
        picked = expert_ids.reshape(-1).long() - first_expert
        picked = picked.masked_fill((picked < 0) | (picked >= held), held)
        order = torch.argsort(picked, stable=True)
        token_of_pick = order // expert_ids.shape[1]
        pick_weights = weights.reshape(-1).float()[order, None]
        counts = torch.bincount(picked, minlength=held + 1).tolist()[:held]
        starts = [0, *itertools.accumulate(counts)]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in (e for e, count in enumerate(counts) if count):
            picks = slice(starts[expert], starts[expert + 1])
            rows = token_of_pick[picks]
            activation = self.silu_and_mul(self.linear(x.index_select(0, rows), gate_up[expert]))
            out.index_add_(0, rows, self.linear(activation, down[expert]).float() * pick_weights[picks])
        return out.to(x.dtype)


def _best_first(values: torch.Tensor) -> torch.Tensor:
    """Column indices of each row by decreasing value, equal values in increasing index order."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices


def _keep_best_groups(choice: torch.Tensor, num_groups: int, top_groups: int, group_scoring: str) -> torch.Tensor:
    """`choice` [T, E] with every expert outside its row's top_groups best groups at -inf."""
    grouped = choice.view(choice.shape[0], num_groups, -1)
    if group_scoring == "max":
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros(group_scores.shape, dtype=torch.bool, device=choice.device)
    kept.scatter_(1, _best_first(group_scores)[:, :top_groups], True)
    return grouped.masked_fill(~kept[..., None], float("-inf")).view(choice.shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    x32 = x.float()
    if style == "neox":
        a, b = x32[..., : rotary_dim // 2], x32[..., rotary_dim // 2 : rotary_dim]
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    elif style == "gptj":
        a, b = x32[..., 0:rotary_dim:2], x32[..., 1:rotary_dim:2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        raise ValueError(f"unknown rotary style {style!r}; expected 'neox' or 'gptj'")
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat([rotated, x32[..., rotary_dim:]], dim=-1)
    return rotated.to(x.dtype)
