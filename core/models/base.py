"""The decoder shared by every family: embedding, layers of attention and MLP, final norm, LM head.

Written once on the op interface, it runs on every backend. A family (one file each in this
package) picks its norm, its activation and where its residual adds go; biases, q/k norms and
fused projections are taken from whatever tensors the checkpoint holds. Query, key and value
projections are fused into one matmul at load time, and so are gate and up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from candelabra.core.contract.backend import Backend
from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.contract.weights import QuantizedTensor, WeightRole, stays_quantized
from candelabra.core.models.config import ModelConfig
from candelabra.core.models.rope import RotaryTable
from candelabra.core.weights import Checkpoint

GELU_TANH_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh")


@dataclass
class Norm:
    weight: Any
    bias: Any = None


@dataclass
class Layer:
    """One decoder layer's weights, as backend tensors."""

    qkv: Any
    qkv_bias: Any
    out: Any
    out_bias: Any
    norms: dict[str, Norm] = field(default_factory=dict)
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    mlp_in: Any = None  # gate and up fused, or a plain up projection
    mlp_in_bias: Any = None
    mlp_out: Any = None
    mlp_out_bias: Any = None


class DecoderModel:
    """A decoder-only transformer. Subclasses set the class attributes below and may override
    `layer_forward` or `load_layer`."""

    norm_kind = "rms"  # or "layer"
    norm_offset = 0.0  # Gemma keeps w - 1 and normalises with (1 + w)
    rotary_style = "neox"
    residual_layout = "sequential"  # "sandwich" (norms after attention and MLP too) or "parallel"
    scale_embeddings = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    gated_mlp = True
    attention_out_name = "o_proj"
    final_norm_name = "model.norm"

    def __init__(self, config: ModelConfig, backend: Backend, checkpoint: Checkpoint, dtype: DType,
                 progress: bool = False) -> None:
        self.config, self.backend, self.ops = config, backend, backend.ops
        self.dtype = backend.check_dtype(dtype)
        self._checkpoint = checkpoint
        self._names = set(checkpoint.tensor_names())
        self._progress = tqdm(total=len(self._names), desc="loading weights", unit="tensor",
                              disable=not progress, leave=False)
        try:
            self.embed_tokens, self.lm_head = self._embedding_and_lm_head()
            self.layers = [self.load_layer(f"model.layers.{i}") for i in range(config.num_layers)]
            self.final_norm = self._norm(self.final_norm_name)
            self.lm_head_bias = self._optional("lm_head.bias", WeightRole.BIAS)
        finally:
            self._progress.close()
        self.rotary = self._rotary_table(config.rope)
        self.local_rotary = self._rotary_table(config.local_rope) if config.local_rope else self.rotary
        self._rotary_device = backend.to_device(self.rotary.table, "float32")
        self._local_rotary_device = (backend.to_device(self.local_rotary.table, "float32")
                                     if config.local_rope else self._rotary_device)
        self._embedding_scale = _rounded_to(config.hidden_size**0.5, self.dtype) if self.scale_embeddings else None

    # loading

    def _host(self, names: list[str], role: WeightRole) -> np.ndarray | QuantizedTensor:
        """The tensors `names`, their rows one after another, as the backend takes them for `role`:
        still quantized when they share a format it keeps, else dequantized to float32."""
        if self._kept_format(names, role) is None:
            parts = [self._checkpoint.load(name) for name in names]
            tensor = parts[0] if len(parts) == 1 else np.concatenate(parts)
        else:
            quantized = [self._checkpoint.load_quantized(name) for name in names]
            tensor = quantized[0] if len(quantized) == 1 else QuantizedTensor.concatenate(quantized)
        self._progress.update(len(names))
        return tensor

    def _kept_format(self, names: list[str], role: WeightRole) -> str | None:
        formats = {self._checkpoint.quantized_format(name) for name in names}
        stored = formats.pop() if len(formats) == 1 else None
        backend = self.backend
        return stored if stays_quantized(role, stored, backend.quantized_formats, backend.quantized_roles) else None

    def _upload(self, name: str, role: WeightRole, tensor: np.ndarray | QuantizedTensor):
        return self.backend.upload_weight(name, role, tensor, self.dtype)

    def _weight(self, name: str, role: WeightRole):
        return self._upload(name, role, self._host([name], role))

    def _optional(self, name: str, role: WeightRole):
        return self._weight(name, role) if name in self._names else None

    def _embedding_and_lm_head(self):
        """The embedding table, and the LM head: its own tensor, or else (tied) the embedding
        uploaded again with role lm_head, right after it and as the same host array or
        QuantizedTensor where the LM head takes the same form."""
        name = "model.embed_tokens.weight"
        table = self._host([name], WeightRole.EMBEDDING)
        embedding = self._upload(name, WeightRole.EMBEDDING, table)
        if "lm_head.weight" in self._names and not self.config.tie_word_embeddings:
            return embedding, self._weight("lm_head.weight", WeightRole.LM_HEAD)
        quantized_head = self._kept_format([name], WeightRole.LM_HEAD) is not None
        if isinstance(table, QuantizedTensor) and not quantized_head:
            table = table.dequantize()
        elif quantized_head and not isinstance(table, QuantizedTensor):
            table = self._checkpoint.load_quantized(name)
        return embedding, self._upload(name, WeightRole.LM_HEAD, table)

    def _norm(self, prefix: str) -> Norm:
        weight = self._weight(f"{prefix}.weight", WeightRole.NORM)
        return Norm(weight, self._optional(f"{prefix}.bias", WeightRole.BIAS))

    def _fused(self, prefix: str, fused: str, parts: tuple[str, ...], suffix: str):
        """A fused projection from the checkpoint, or its parts concatenated; None if absent."""
        role = WeightRole.LINEAR if suffix == "weight" else WeightRole.BIAS
        name = f"{prefix}.{fused}.{suffix}"
        if name in self._names:
            return self._weight(name, role)
        names = [f"{prefix}.{part}.{suffix}" for part in parts]
        if not all(n in self._names for n in names):
            return None
        return self._upload(name, role, self._host(names, role))

    def load_layer(self, prefix: str) -> Layer:
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        layer = Layer(
            qkv=self._fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "weight"),
            qkv_bias=self._fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "bias"),
            out=self._weight(f"{attn}.{self.attention_out_name}.weight", WeightRole.LINEAR),
            out_bias=self._optional(f"{attn}.{self.attention_out_name}.bias", WeightRole.BIAS),
            norms={name: self._norm(f"{prefix}.{name}") for name in self.layer_norm_names()
                   if f"{prefix}.{name}.weight" in self._names},
            q_norm=self._norm(f"{attn}.q_norm") if f"{attn}.q_norm.weight" in self._names else None,
            k_norm=self._norm(f"{attn}.k_norm") if f"{attn}.k_norm.weight" in self._names else None,
        )
        if self.gated_mlp:
            layer.mlp_in = self._fused(mlp, "gate_up_proj", ("gate_proj", "up_proj"), "weight")
            layer.mlp_out = self._weight(f"{mlp}.down_proj.weight", WeightRole.LINEAR)
        else:
            layer.mlp_in = self._weight(f"{mlp}.fc1.weight", WeightRole.LINEAR)
            layer.mlp_in_bias = self._optional(f"{mlp}.fc1.bias", WeightRole.BIAS)
            layer.mlp_out = self._weight(f"{mlp}.fc2.weight", WeightRole.LINEAR)
            layer.mlp_out_bias = self._optional(f"{mlp}.fc2.bias", WeightRole.BIAS)
        return layer

    def layer_norm_names(self) -> tuple[str, ...]:
        return ("input_layernorm", "post_attention_layernorm")

    def _rotary_table(self, rope) -> RotaryTable:
        return RotaryTable.build(self.config.rotary_dim, self.config.max_position_embeddings, rope.theta, rope.scaling)

    # running

    def with_rope_positions(self, meta: StepMetadata) -> StepMetadata:
        """`meta` with the rotary table's row for each token: its position, or an offset one for
        scalings that switch tables with the sequence's length."""
        if self.rotary.switch_length is None:
            return meta
        query_lens = np.diff(meta.query_start_loc)
        offsets = np.repeat(self.rotary.row_offset(meta.seq_lens), query_lens)
        return meta.with_rope_positions(meta.positions + offsets)

    def forward(self, token_ids, step, caches: list[KVCache]):
        """Hidden states [T, hidden] of the step's tokens (a backend tensor of `step`'s prepared
        layout), and the updated caches."""
        positions = step.rope_positions
        x = self.ops.embedding(token_ids, self.embed_tokens, self._embedding_scale)
        updated = []
        for index, layer in enumerate(self.layers):
            x, cache = self.layer_forward(index, layer, x, step, positions, caches[index])
            updated.append(cache)
        return x, updated

    def layer_forward(self, index: int, layer: Layer, x, step, positions, cache):
        norms = layer.norms
        if self.residual_layout == "parallel":
            h = self.norm(norms["input_layernorm"], x)
            attended, cache = self.attention(index, layer, h, step, positions, cache)
            return x + attended + self.mlp(layer, h), cache
        h = self.norm(norms["input_layernorm"], x)
        attended, cache = self.attention(index, layer, h, step, positions, cache)
        if self.residual_layout == "sandwich":
            before_mlp, after_attention, after_mlp = self.sandwich_norm_names()
            h, x = self.add_norm(norms[before_mlp], self.norm(norms[after_attention], attended), x)
            return x + self.norm(norms[after_mlp], self.mlp(layer, h)), cache
        h, x = self.add_norm(norms["post_attention_layernorm"], attended, x)
        return x + self.mlp(layer, h), cache

    def sandwich_norm_names(self) -> tuple[str, str, str]:
        """(before the MLP, after attention, after the MLP) for the sandwich layout."""
        raise NotImplementedError(f"{type(self).__name__} uses the sandwich layout but names no norms")

    def norm(self, norm: Norm, x):
        if self.norm_kind == "layer":
            return self.ops.layer_norm(x, norm.weight, norm.bias, self.config.norm_eps)
        return self.ops.rms_norm(x, norm.weight, self.config.norm_eps, self.norm_offset)

    def add_norm(self, norm: Norm, x, residual):
        """(norm(x + residual), x + residual)."""
        if self.norm_kind == "layer":
            summed = x + residual
            return self.norm(norm, summed), summed
        return self.ops.add_rms_norm(x, residual, norm.weight, self.config.norm_eps, self.norm_offset)

    def attention(self, index: int, layer: Layer, h, step, positions, cache):
        c, ops = self.config, self.ops
        tokens = h.shape[0]
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = ops.linear(h, layer.qkv, layer.qkv_bias)
        q = qkv[:, :q_width].reshape(tokens, c.num_heads, c.head_dim)
        k = qkv[:, q_width : q_width + kv_width].reshape(tokens, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_width + kv_width :].reshape(tokens, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q, k = self.norm(layer.q_norm, q), self.norm(layer.k_norm, k)
        window = c.window_of(index)
        table = self._local_rotary_device if window is not None else self._rotary_device
        q, cache = ops.rotary_and_write_kv(q, k, v, positions, table, cache, step.slot_mapping, self.rotary_style)
        attended = ops.paged_attention(q, cache, step, c.attention_scale, sliding_window=window,
                                       logit_softcap=c.attn_logit_softcapping)
        return ops.linear(attended.reshape(tokens, q_width), layer.out, layer.out_bias), cache

    def mlp(self, layer: Layer, h):
        ops, act = self.ops, self.config.hidden_act
        projected = ops.linear(h, layer.mlp_in, layer.mlp_in_bias)
        if self.gated_mlp:
            if act == "silu":
                activated = ops.silu_and_mul(projected)
            else:
                activated = ops.gelu_and_mul(projected, _gelu_approximation(act))
        else:
            activated = ops.gelu(projected, _gelu_approximation(act))
        return ops.linear(activated, layer.mlp_out, layer.mlp_out_bias)

    def compute_logits(self, hidden, rows):
        """Logits [N, vocab] of the hidden states at `rows` (int32 backend tensor [N])."""
        picked = self.ops.gather_rows(hidden, rows)
        logits = self.ops.linear(self.norm(self.final_norm, picked), self.lm_head, self.lm_head_bias)
        if self.config.final_logit_softcapping:
            logits = self.ops.softcap(logits, self.config.final_logit_softcapping)
        return logits


def _gelu_approximation(activation: str) -> str:
    if activation in GELU_TANH_ACTIVATIONS:
        return "tanh"
    if activation == "gelu":
        return "none"
    raise ValueError(f"unsupported activation {activation!r}")


def _rounded_to(value: float, dtype: DType) -> float:
    """`value` as the compute dtype holds it (Gemma's embedding scale is a tensor of that dtype)."""
    as_float32 = np.float32(value)
    if dtype == "float16":
        return float(np.float16(value))
    if dtype == "bfloat16":
        bits = int(as_float32.view(np.uint32))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return float(np.uint32(bits).view(np.float32))
    return float(as_float32)
