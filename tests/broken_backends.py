"""The numpy backend with one op subtly wrong each: the conformance suite must catch exactly it.

Each bug is one a real kernel could plausibly have.
"""

import numpy as np

from candelabra.backends.cpu import CpuBackend, attention
from candelabra.backends.cpu.ops import NumpyOps


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
