"""The decoder shared by every family: embedding, layers of attention and MLP, final norm, LM head.

Written once on the op interface, it runs on every backend. A family (one file each in this
package) picks its norm, its activation and where its residual adds go; biases, q/k norms and
fused projections are taken from whatever tensors the checkpoint holds. Query, key and value
projections are fused into one matmul at load time, and so are gate and up.

Given a communicator of more than one rank, the model is this rank's shard of a tensor-parallel
model (the rules are in `sharding`): it loads only its part of each weight, computes its heads and
its part of the MLP, and sums the partial outputs of the attention output and down projections over
the ranks, one all-reduce each (one per layer for the parallel residual layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from candelabra.core.contract.backend import Backend
from candelabra.core.contract.communicator import Communicator
from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.contract.weights import QuantizedTensor, WeightRole, stays_quantized
from candelabra.core.models.config import ModelConfig
from candelabra.core.models.rope import RotaryTable
from candelabra.core.models.sharding import (
    DEFAULT_LM_HEAD_LAYOUT,
    VOCAB_PARALLEL,
    HostWeight,
    check_lm_head_layout,
    intermediate_columns,
    pad_rows,
    quantization_block,
    shard_heads,
    take_columns,
    take_rows,
    vocab_rows,
)
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
    `layer_forward` or `load_layer`.

    `config` is always the whole model's. With a `communicator` of more than one rank the model is
    that rank's shard: it computes `num_local_heads` query heads reading `num_local_kv_heads` KV
    heads (the KV cache holds these only), and every rank makes the same calls in the same order.
    Without one, or with a group of one, they are the config's head counts and nothing is
    exchanged."""

    norm_kind = "rms"  # or "layer"
    norm_offset = 0.0  # Gemma keeps w - 1 and normalises with (1 + w)
    rotary_style = "neox"
    residual_layout = "sequential"  # "sandwich" (norms after attention and MLP too) or "parallel"
    scale_embeddings = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    gated_mlp = True
    attention_out_name = "o_proj"
    final_norm_name = "model.norm"
    # How a tensor-parallel model splits its LM head (sharding.LM_HEAD_LAYOUTS; the default's measurements
    # are beside it).
    lm_head_layout = DEFAULT_LM_HEAD_LAYOUT

    def __init__(self, config: ModelConfig, backend: Backend, checkpoint: Checkpoint, dtype: DType,
                 progress: bool = False, communicator: Communicator | None = None,
                 lm_head_layout: str | None = None) -> None:
        """`lm_head_layout` overrides the class's for a tensor-parallel model; ValueError when the
        world size does not split the heads (see `sharding.shard_heads`)."""
        self.config, self.backend, self.ops = config, backend, backend.ops
        self.dtype = backend.check_dtype(dtype)
        self.communicator = communicator if communicator is not None and communicator.world_size > 1 else None
        rank, world_size = (communicator.rank, communicator.world_size) if self.communicator else (0, 1)
        self.head_shard = shard_heads(config.num_heads, config.num_kv_heads, rank, world_size)
        self.num_local_heads, self.num_local_kv_heads = len(self.head_shard.query_heads), len(self.head_shard.kv_heads)
        self.lm_head_layout = check_lm_head_layout(lm_head_layout or self.lm_head_layout)
        self._vocab_parallel = self.communicator is not None and self.lm_head_layout == VOCAB_PARALLEL
        self.vocab_size = config.vocab_size  # the LM head's rows, once loaded
        self._checkpoint = checkpoint
        self._names = set(checkpoint.tensor_names())
        self._progress = tqdm(total=len(self._names), desc="loading weights", unit="tensor",
                              disable=not progress, leave=False)
        try:
            self.embed_tokens, self.lm_head = self._embedding_and_lm_head()
            self.layers = [self.load_layer(f"model.layers.{i}") for i in range(config.num_layers)]
            self.final_norm = self._norm(self.final_norm_name)
            self.lm_head_bias = self._lm_head_bias()
        finally:
            self._progress.close()
        self.rotary = self._rotary_table(config.rope)
        self.local_rotary = self._rotary_table(config.local_rope) if config.local_rope else self.rotary
        self._rotary_device = backend.to_device(self.rotary.table, "float32")
        self._local_rotary_device = (backend.to_device(self.local_rotary.table, "float32")
                                     if config.local_rope else self._rotary_device)
        self._embedding_scale = _rounded_to(config.hidden_size**0.5, self.dtype) if self.scale_embeddings else None

    # loading

    def _host(self, names: list[str], role: WeightRole) -> HostWeight:
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

    def _upload(self, name: str, role: WeightRole, tensor: HostWeight):
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
            return embedding, self._lm_head("lm_head.weight", self._host(["lm_head.weight"], WeightRole.LM_HEAD))
        quantized_head = self._kept_format([name], WeightRole.LM_HEAD) is not None
        if isinstance(table, QuantizedTensor) and not quantized_head:
            table = table.dequantize()
        elif quantized_head and not isinstance(table, QuantizedTensor):
            table = self._checkpoint.load_quantized(name)
        return embedding, self._lm_head(name, table)

    def _lm_head(self, name: str, table: HostWeight):
        """The LM head uploaded from its host rows `table`: this rank's share of the vocabulary, padded,
        where it is vocabulary-parallel."""
        self.vocab_size = table.shape[0]
        return self._upload(name, WeightRole.LM_HEAD, self._vocab_shard(table))

    def _lm_head_bias(self):
        name = "lm_head.bias"
        if name not in self._names:
            return None
        return self._upload(name, WeightRole.BIAS, self._vocab_shard(self._host([name], WeightRole.BIAS)))

    def _vocab_shard(self, rows: HostWeight) -> HostWeight:
        if not self._vocab_parallel:
            return rows
        kept, padded = vocab_rows(rows.shape[0], self.communicator.rank, self.communicator.world_size)
        return pad_rows(take_rows(rows, [kept]), padded)

    def _norm(self, prefix: str) -> Norm:
        weight = self._weight(f"{prefix}.weight", WeightRole.NORM)
        return Norm(weight, self._optional(f"{prefix}.bias", WeightRole.BIAS))

    def _fused(self, prefix: str, fused: str, parts: tuple[str, ...], suffix: str, rows: list[range] | None = None):
        """A fused projection from the checkpoint, or its parts concatenated; None if absent. With
        `rows`, only those rows of the fused projection (a column-parallel shard)."""
        role = WeightRole.LINEAR if suffix == "weight" else WeightRole.BIAS
        name = f"{prefix}.{fused}.{suffix}"
        names = [name] if name in self._names else [f"{prefix}.{part}.{suffix}" for part in parts]
        if not all(n in self._names for n in names):
            return None
        return self._column_parallel(name, role, rows, names)

    def _column_parallel(self, name: str, role: WeightRole, rows: list[range] | None, stacked: list[str] | None = None):
        """The tensor `name`, or the tensors `stacked` (their rows one after another) uploaded as
        `name`; with `rows`, only those rows."""
        host = self._host(stacked or [name], role)
        return self._upload(name, role, host if rows is None else take_rows(host, rows))

    def _row_parallel(self, name: str, columns: range | None):
        """The linear weight `name`, or only its input features `columns`."""
        host = self._host([name], WeightRole.LINEAR)
        return self._upload(name, WeightRole.LINEAR, host if columns is None else take_columns(host, columns))

    def _row_parallel_bias(self, name: str):
        """A row-parallel projection's bias, None if absent: on rank 0 only, so the sum over ranks adds it once."""
        if self.communicator is not None and self.communicator.rank != 0:
            self._progress.update(int(name in self._names))
            return None
        return self._optional(name, WeightRole.BIAS)

    def _qkv_rows(self) -> list[range] | None:
        c = self.config
        return None if self.communicator is None else self.head_shard.qkv_rows(c.num_heads, c.num_kv_heads, c.head_dim)

    def _intermediate_columns(self, row_parallel: str) -> range | None:
        """This rank's MLP intermediate features, split on the blocks of the row-parallel weight
        `row_parallel` where it stays quantized; None without tensor parallelism."""
        if self.communicator is None:
            return None
        block = quantization_block(self._kept_format([row_parallel], WeightRole.LINEAR))
        size = self._checkpoint.tensor_shape(row_parallel)[1]
        return intermediate_columns(size, self.communicator.rank, self.communicator.world_size, block)

    def load_layer(self, prefix: str) -> Layer:
        attn, mlp, out = f"{prefix}.self_attn", f"{prefix}.mlp", f"{prefix}.self_attn.{self.attention_out_name}"
        qkv_rows = self._qkv_rows()
        out_columns = None if self.communicator is None else self.head_shard.output_columns(self.config.head_dim)
        layer = Layer(
            qkv=self._fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "weight", qkv_rows),
            qkv_bias=self._fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "bias", qkv_rows),
            out=self._row_parallel(f"{out}.weight", out_columns),
            out_bias=self._row_parallel_bias(f"{out}.bias"),
            norms={name: self._norm(f"{prefix}.{name}") for name in self.layer_norm_names()
                   if f"{prefix}.{name}.weight" in self._names},
            q_norm=self._norm(f"{attn}.q_norm") if f"{attn}.q_norm.weight" in self._names else None,
            k_norm=self._norm(f"{attn}.k_norm") if f"{attn}.k_norm.weight" in self._names else None,
        )
        if self.gated_mlp:
            down = f"{mlp}.down_proj.weight"
            columns = self._intermediate_columns(down)
            rows = None if columns is None else [columns, _shifted(columns, self._checkpoint.tensor_shape(down)[1])]
            layer.mlp_in = self._fused(mlp, "gate_up_proj", ("gate_proj", "up_proj"), "weight", rows)
            layer.mlp_out = self._row_parallel(down, columns)
        else:
            columns = self._intermediate_columns(f"{mlp}.fc2.weight")
            rows = None if columns is None else [columns]
            layer.mlp_in = self._column_parallel(f"{mlp}.fc1.weight", WeightRole.LINEAR, rows)
            if f"{mlp}.fc1.bias" in self._names:
                layer.mlp_in_bias = self._column_parallel(f"{mlp}.fc1.bias", WeightRole.BIAS, rows)
            layer.mlp_out = self._row_parallel(f"{mlp}.fc2.weight", columns)
            layer.mlp_out_bias = self._row_parallel_bias(f"{mlp}.fc2.bias")
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
            if self.communicator is None:
                return x + attended + self.mlp(layer, h), cache
            # Both branches' partial sums add up before the one all-reduce of the layer.
            return x + self.communicator.all_reduce(attended + self.mlp(layer, h)), cache
        h = self.norm(norms["input_layernorm"], x)
        attended, cache = self.attention(index, layer, h, step, positions, cache)
        attended = self.summed_over_ranks(attended)
        if self.residual_layout == "sandwich":
            before_mlp, after_attention, after_mlp = self.sandwich_norm_names()
            h, x = self.add_norm(norms[before_mlp], self.norm(norms[after_attention], attended), x)
            return x + self.norm(norms[after_mlp], self.summed_over_ranks(self.mlp(layer, h))), cache
        h, x = self.add_norm(norms["post_attention_layernorm"], attended, x)
        return x + self.summed_over_ranks(self.mlp(layer, h)), cache

    def summed_over_ranks(self, partial):
        """The sum over the tensor-parallel ranks of a row-parallel projection's partial outputs (one
        all-reduce); `partial` itself without tensor parallelism."""
        return partial if self.communicator is None else self.communicator.all_reduce(partial)

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
        """This rank's heads' attention through the output projection, and the updated cache: with
        tensor parallelism a partial sum (see `summed_over_ranks`)."""
        c, ops = self.config, self.ops
        tokens, heads, kv_heads = h.shape[0], self.num_local_heads, self.num_local_kv_heads
        q_width, kv_width = heads * c.head_dim, kv_heads * c.head_dim
        qkv = ops.linear(h, layer.qkv, layer.qkv_bias)
        q = qkv[:, :q_width].reshape(tokens, heads, c.head_dim)
        k = qkv[:, q_width : q_width + kv_width].reshape(tokens, kv_heads, c.head_dim)
        v = qkv[:, q_width + kv_width :].reshape(tokens, kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q, k = self.norm(layer.q_norm, q), self.norm(layer.k_norm, k)
        window = c.window_of(index)
        table = self._local_rotary_device if window is not None else self._rotary_device
        q, cache = ops.rotary_and_write_kv(q, k, v, positions, table, cache, step.slot_mapping, self.rotary_style)
        attended = ops.paged_attention(q, cache, step, c.attention_scale, sliding_window=window,
                                       logit_softcap=c.attn_logit_softcapping)
        return ops.linear(attended.reshape(tokens, q_width), layer.out, layer.out_bias), cache

    def mlp(self, layer: Layer, h):
        """The MLP of `h`: with tensor parallelism this rank's partial sum (see `summed_over_ranks`)."""
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
        """Logits [N, vocab] of the hidden states at `rows` (int32 backend tensor [N]), on every rank."""
        picked = self.ops.gather_rows(hidden, rows)
        logits = self.ops.linear(self.norm(self.final_norm, picked), self.lm_head, self.lm_head_bias)
        if self.config.final_logit_softcapping:
            logits = self.ops.softcap(logits, self.config.final_logit_softcapping)
        if self._vocab_parallel:
            logits = self.communicator.all_gather(logits, dim=-1)
            if logits.shape[1] != self.vocab_size:  # the last ranks' padding rows
                logits = logits[:, : self.vocab_size]
        return logits


def _shifted(indices: range, offset: int) -> range:
    return range(indices.start + offset, indices.stop + offset)


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
