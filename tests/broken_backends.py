"""The numpy backend with one op subtly wrong each: the conformance suite must catch exactly it.

Each bug is one a real kernel could plausibly have.
"""

import numpy as np

from candelabra.backends.cpu import CpuBackend, attention
from candelabra.backends.cpu.ops import NumpyOps
from candelabra.core.contract.backend import Backend
from candelabra.core.contract.kv_quantization import quantize_kv_rows
from candelabra.core.contract.ops import KVCache


class _OneBrokenOp(CpuBackend):
    ops_class = NumpyOps

    def __init__(self):
        super().__init__()
        self.ops = self.ops_class()


class _WindowOffByOne(NumpyOps):
    def paged_attention(self, q, cache, step, scale, sliding_window=None, logit_softcap=None):
        wider = None if sliding_window is None else sliding_window + 1
        return attention.paged_attention(q, cache, step, scale, wider, logit_softcap)


class SlidingWindowOffByOne(_OneBrokenOp):
    """Attends to W + 1 keys instead of W."""

    name = "broken-window"
    ops_class = _WindowOffByOne


class _WritesPaddingSlots(NumpyOps):
    def write_kv(self, cache, key, value, slot_mapping):
        cache.key.reshape(-1, *cache.key.shape[2:])[slot_mapping] = key
        cache.value.reshape(-1, *cache.value.shape[2:])[slot_mapping] = value
        return cache


class PaddingSlotWrite(_OneBrokenOp):
    """Forgets that slot -1 means 'skip': numpy then overwrites the cache's last slot."""

    name = "broken-padding"
    ops_class = _WritesPaddingSlots


class _NaiveSoftmax(NumpyOps):
    def softmax(self, x):
        exp = np.exp(x)
        return exp / exp.sum(axis=-1, keepdims=True)


class UnshiftedSoftmax(_OneBrokenOp):
    """Skips subtracting the maximum, so large logits overflow."""

    name = "broken-softmax"
    ops_class = _NaiveSoftmax


class _InclusiveTopP(NumpyOps):
    def sample(self, logits, params):
        from candelabra.backends.cpu import sampling

        original = sampling._top_k_top_p

        def inclusive(probs, top_k, top_p):
            # Keeps the token that crosses top_p too: one token too many whenever top_p is active.
            keep = original(probs, top_k, top_p)
            masked = np.where(keep, -1.0, probs)
            extra = np.argmax(masked, axis=1)
            active = top_p < 1
            keep[np.flatnonzero(active), extra[active]] = True
            return keep

        sampling._top_k_top_p = inclusive
        try:
            return sampling.sample(logits, params)
        finally:
            sampling._top_k_top_p = original


class InclusiveTopP(_OneBrokenOp):
    name = "broken-top-p"
    ops_class = _InclusiveTopP


class _ForgetsLastRow(NumpyOps):
    def silu_and_mul(self, x):
        gate, up = np.split(x, 2, axis=-1)
        out = np.empty_like(gate)
        rows = max(len(out) - 1, 1)
        out[:rows] = gate[:rows] / (1 + np.exp(-gate[:rows])) * up[:rows]
        return out


class UnwrittenOutputRow(_OneBrokenOp):
    """Leaves the last row of a multi-row output unwritten: only the poisoned run exposes it,
    since the stale memory otherwise often holds a previous, correct result."""

    name = "broken-unwritten"
    ops_class = _ForgetsLastRow


# Low-precision slips on the torch backend, which computes in float16 and bfloat16: each is right in
# float32 and only a little off in low precision, and conformance must fail exactly them there.


def _torch_backend_with(ops_class):
    from candelabra.backends.torch.backend import TorchBackend

    class Broken(TorchBackend):
        @classmethod
        def ops_class(cls):
            return ops_class

    return Broken


def _rms_norm_in_input_dtype():
    import torch

    from candelabra.backends.torch.ops import TorchOps

    class RmsNormInInputDtype(TorchOps):
        def rms_norm(self, x, weight, eps, weight_offset=0.0):
            normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
            return normed * (weight + weight_offset if weight_offset else weight)

    return RmsNormInInputDtype


def _silu_rounded_twice():
    import torch.nn.functional as F

    from candelabra.backends.torch.ops import TorchOps

    class SiluRoundedTwice(TorchOps):
        def silu_and_mul(self, x):
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up  # the activation rounded to x's dtype before the product

    return SiluRoundedTwice


LowPrecisionRmsNorm = _torch_backend_with(_rms_norm_in_input_dtype())
LowPrecisionRmsNorm.name = "broken-low-precision-rms-norm"
DoubleRoundedSilu = _torch_backend_with(_silu_rounded_twice())
DoubleRoundedSilu.name = "broken-double-rounded-silu"


# Faults a vendor planted in a backend of their own, each to be named by its cause in the message.


class MissingSynchronizeAndDtypeOf(CpuBackend):
    """Leaves synchronize and dtype_of to the base class, which declares them required."""

    name = "broken-missing-methods"
    synchronize = Backend.synchronize
    dtype_of = Backend.dtype_of


class NoOpSwapOut(CpuBackend):
    name = "broken-swap-out"

    def swap_out(self, caches, swap, mapping):
        return swap


class NoOpSwapIn(CpuBackend):
    name = "broken-swap-in"

    def swap_in(self, caches, swap, mapping):
        return caches


class _NanInOutput(NumpyOps):
    def gelu(self, x, approximate="none"):
        out = super().gelu(x, approximate)
        out.reshape(-1)[len(out.reshape(-1)) // 2] = np.nan
        return out


class NanInOutput(_OneBrokenOp):
    """One element of gelu's output is NaN, as an uninitialised or overflowing kernel leaves."""

    name = "broken-nan"
    ops_class = _NanInOutput


class _GroupsScoredByMax(NumpyOps):
    def route_experts(self, router_logits, top_k, scoring="softmax", renormalize=True, scale=1.0, num_groups=1,
                      top_groups=1, group_scoring="max", correction_bias=None):
        return super().route_experts(router_logits, top_k, scoring, renormalize, scale, num_groups, top_groups,
                                     "max", correction_bias)


class GroupsScoredByMax(_OneBrokenOp):
    """Scores expert groups by their best expert even where the sum of the best two is asked
    (DeepSeek-V3), so it keeps the wrong groups."""

    name = "broken-expert-groups"
    ops_class = _GroupsScoredByMax


class _ExpertsHeldFromZero(NumpyOps):
    def moe_experts(self, x, weights, expert_ids, gate_up, down, first_expert=0):
        return super().moe_experts(x, weights, expert_ids, gate_up, down)


class ExpertsHeldFromZero(_OneBrokenOp):
    """Leaves out first_expert: a rank holding experts 2 to 5 runs the picks of 0 to 3 with them."""

    name = "broken-expert-share"
    ops_class = _ExpertsHeldFromZero


def _round_bfloat16(x):
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


class _NormAccumulatedInBfloat16(NumpyOps):
    def rms_norm(self, x, weight, eps, weight_offset=0.0):
        mean_square = _round_bfloat16(np.mean(np.square(_round_bfloat16(x)), axis=-1, keepdims=True))
        return _round_bfloat16(x / np.sqrt(mean_square + np.float32(eps))) * (np.float32(weight_offset) + weight)


class NormAccumulatedInBfloat16(_OneBrokenOp):
    """Declares float32 but computes rms_norm's intermediates in bfloat16."""

    name = "broken-bfloat16-norm"
    ops_class = _NormAccumulatedInBfloat16


class _WritesNextSlot(NumpyOps):
    def write_kv(self, cache, key, value, slot_mapping):
        shifted = np.where(slot_mapping >= 0, (slot_mapping + 1) % (cache.key.shape[0] * cache.key.shape[1]), -1)
        return super().write_kv(cache, key, value, shifted)


class WritesNextSlot(_OneBrokenOp):
    """Writes each token one slot too far."""

    name = "broken-next-slot"
    ops_class = _WritesNextSlot


class _FlatTopWhenNoneAsked(NumpyOps):
    def token_logprobs(self, logits, token_ids, num_top):
        result = super().token_logprobs(logits, token_ids, num_top)
        if num_top == 0:
            return result._replace(top_token_ids=result.top_token_ids.reshape(-1),
                                   top_logprobs=result.top_logprobs.reshape(-1))
        return result


class FlatTopWhenNoneAsked(_OneBrokenOp):
    """With num_top 0 returns its empty top tensors as [N] instead of [N, 0]."""

    name = "broken-empty-top"
    ops_class = _FlatTopWhenNoneAsked


class _TruncatedKVCodes(NumpyOps):
    def write_kv(self, cache, key, value, slot_mapping):
        written = slot_mapping >= 0
        blocks, offsets = np.divmod(slot_mapping[written], cache.key.shape[1])
        for target, rows in ((cache.key, key[written]), (cache.value, value[written])):
            stored = quantize_kv_rows(rows, "int8")
            scale = np.abs(rows).max(axis=-1, keepdims=True) / 127
            stored[..., :-4] = np.trunc(np.divide(rows, scale, out=np.zeros_like(rows), where=scale > 0))
            target[blocks, offsets] = stored
        return cache


class TruncatedKVCodes(_OneBrokenOp):
    """Quantizes an int8 cache's rows by truncating value / scale toward zero rather than rounding it."""

    name = "broken-kv-codes"
    ops_class = _TruncatedKVCodes


class _KVScaleDropped(NumpyOps):
    def paged_attention(self, q, cache, step, scale, sliding_window=None, logit_softcap=None):
        if cache.key.dtype != np.int8:
            return super().paged_attention(q, cache, step, scale, sliding_window, logit_softcap)
        codes = KVCache(cache.key[..., :-4].astype(np.float32) / 127, cache.value[..., :-4].astype(np.float32) / 127)
        return attention.paged_attention(q, codes, step, scale, sliding_window, logit_softcap)


class KVScaleDropped(_OneBrokenOp):
    """Reads an int8 cache's codes as if every row's largest value were 1, ignoring the row's own scale."""

    name = "broken-kv-scale"
    ops_class = _KVScaleDropped
