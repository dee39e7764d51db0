"""The decoder shared by every family: embedding, layers of attention and MLP, final norm, LM head.

Written once on the op interface, it runs on every backend. A family (one file each in this
package) picks its norm, its activation and its block: the residual layout of a layer
(`candelabra.core.models.blocks`), named once with its checkpoint's norm names. The weights come
from the loader (`candelabra.core.loading.decoder_weights`), which reads what the family's
attributes below say.

Given a communicator of more than one rank, the model is this rank's shard of a tensor-parallel
model (the rules are in `sharding`): it computes its heads and its part of the MLP, and sums the
partial outputs of the attention output and down projections over the ranks, one all-reduce each
(one per layer for the parallel block).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np

from candelabra.core.contract.backend import Backend
from candelabra.core.contract.communicator import Communicator
from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.models.blocks import Block, SequentialBlock, joined_and_normed
from candelabra.core.models.config import ModelConfig
from candelabra.core.models.layer_weights import DecoderWeights, Layer, Norm
from candelabra.core.models.moe import MOE_OPS, ExpertNames, SparseMoeMlp
from candelabra.core.models.rope import RotaryTable
from candelabra.core.models.sharding import DEFAULT_LM_HEAD_LAYOUT

GELU_TANH_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh")


class DecoderModel:
    """A decoder-only transformer. Subclasses (the families) set the class attributes below, and
    override `block_for` where a config.json switches the layout.

    `config` is always the whole model's; `weights` come from the loader, for this rank's shard when
    there is a `communicator` of more than one rank: the model then computes `num_local_heads`
    query heads reading `num_local_kv_heads` KV heads (the KV cache holds these only), and every rank
    makes the same calls in the same order. Without one, or with a group of one, they are the
    config's head counts and nothing is exchanged."""

    norm_kind: ClassVar[Literal["rms", "layer"]] = "rms"
    norm_offset: ClassVar[float] = 0.0  # Gemma keeps w - 1 and normalises with (1 + w)
    rotary_style: ClassVar[Literal["neox", "gptj"]] = "neox"
    block: ClassVar[Block] = SequentialBlock()
    scale_embeddings: ClassVar[bool] = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    gated_mlp: ClassVar[bool] = True  # gate and up projections (else one up projection, fc1/fc2)
    # the checkpoint's names for the attention output projection and the final norm
    attention_out_name: ClassVar[str] = "o_proj"
    final_norm_name: ClassVar[str] = "model.norm"
    # where the checkpoint keeps a MoE layer's router and experts (for a config with experts)
    expert_names: ClassVar[ExpertNames] = ExpertNames()
    # How a tensor-parallel model splits its LM head by default (sharding.LM_HEAD_LAYOUTS; the default's
    # measurements are in docs/design-notes.md).
    lm_head_layout: ClassVar[str] = DEFAULT_LM_HEAD_LAYOUT

    @classmethod
    def block_for(cls, config: ModelConfig) -> Block:
        """The block every layer of a model of `config` runs; ConfigError for a config the family cannot run."""
        return cls.block

    @classmethod
    def ops_needed(cls, config: ModelConfig) -> tuple[str, ...]:
        """The ops a model of `config` needs beyond those every model runs."""
        return MOE_OPS if config.moe is not None else ()

    def __init__(self, config: ModelConfig, backend: Backend, weights: DecoderWeights,
                 communicator: Communicator | None = None) -> None:
        self.config, self.backend, self.ops = config, backend, backend.ops
        self.dtype: DType = weights.dtype
        self.communicator = communicator if communicator is not None and communicator.world_size > 1 else None
        self.block = self.block_for(config)
        self.norm, self.add_norm = ((self._layer_norm, self._add_layer_norm) if self.norm_kind == "layer"
                                    else (self._rms_norm, self._add_rms_norm))
        self.num_local_heads = len(weights.head_shard.query_heads)
        self.num_local_kv_heads = len(weights.head_shard.kv_heads)
        self._vocab_parallel = weights.vocab_parallel
        self.vocab_size = weights.vocab_size  # the LM head's rows
        self.embed_tokens, self.lm_head, self.lm_head_bias = weights.embed_tokens, weights.lm_head, weights.lm_head_bias
        self.layers, self.final_norm = weights.layers, weights.final_norm
        self._sparse_moe = SparseMoeMlp(config.moe) if config.moe is not None else None
        self.rotary = self._rotary_table(config.rope)
        self.local_rotary = self._rotary_table(config.local_rope) if config.local_rope else self.rotary
        self._rotary_device = backend.to_device(self.rotary.table, "float32")
        self._local_rotary_device = (backend.to_device(self.local_rotary.table, "float32")
                                     if config.local_rope else self._rotary_device)
        self._embedding_scale = _rounded_to(config.hidden_size**0.5, self.dtype) if self.scale_embeddings else None

    @classmethod
    def kv_cache_layout(cls, config: ModelConfig, kv_heads: int) -> tuple[int, int, int]:
        """What a token's cache holds per layer for a rank of `kv_heads` KV heads: (KV heads, key width,
        value width)."""
        return kv_heads, config.head_dim, config.head_dim

    def kv_cache_dims(self) -> tuple[int, int, int]:
        return self.kv_cache_layout(self.config, self.num_local_kv_heads)

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
        branch, updated = None, []
        for index, layer in enumerate(self.layers):
            x, branch, cache = self.block.forward(self, index, layer, x, branch, step, positions, caches[index])
            updated.append(cache)
        return (x if branch is None else x + branch), updated

    def summed_over_ranks(self, partial):
        """The sum over the tensor-parallel ranks of a row-parallel projection's partial outputs (one
        all-reduce); `partial` itself without tensor parallelism."""
        return partial if self.communicator is None else self.communicator.all_reduce(partial)

    def _rms_norm(self, norm: Norm, x):
        return self.ops.rms_norm(x, norm.weight, self.config.norm_eps, self.norm_offset)

    def _add_rms_norm(self, norm: Norm, x, residual):
        """(norm(x + residual), x + residual)."""
        return self.ops.add_rms_norm(x, residual, norm.weight, self.config.norm_eps, self.norm_offset)

    def normed_projection(self, norm: Norm, x, branch, weight, bias=None):
        """(linear(norm(x + branch), weight, bias), x + branch): a pre-norm and the first projection of its
        output, one op for an RMS norm (`Ops.rms_norm_linear`, which a backend may fuse); without a branch,
        (linear(norm(x), weight, bias), x)."""
        if self.norm_kind == "layer":
            h, joined = joined_and_normed(self, norm, x, branch)
            return self.ops.linear(h, weight, bias), joined
        return self.ops.rms_norm_linear(x if branch is None else branch, None if branch is None else x, norm.weight,
                                        self.config.norm_eps, weight, bias, self.norm_offset)

    def _layer_norm(self, norm: Norm, x):
        return self.ops.layer_norm(x, norm.weight, norm.bias, self.config.norm_eps)

    def _add_layer_norm(self, norm: Norm, x, residual):
        summed = x + residual
        return self._layer_norm(norm, summed), summed

    def attention_projection(self, layer: Layer):
        """(weight, bias) of the projection attention starts from, which reads the normalised hidden states."""
        return layer.qkv, layer.qkv_bias

    def attention(self, index: int, layer: Layer, qkv, step, positions, cache):
        """This rank's heads' attention, from its `attention_projection` of the normalised hidden states
        through the output projection, and the updated cache: with tensor parallelism a partial sum (see
        `summed_over_ranks`)."""
        c, ops = self.config, self.ops
        tokens, heads, kv_heads = qkv.shape[0], self.num_local_heads, self.num_local_kv_heads
        q_width, kv_width = heads * c.head_dim, kv_heads * c.head_dim
        q = qkv[:, :q_width].reshape(tokens, heads, c.head_dim)
        k = qkv[:, q_width : q_width + kv_width].reshape(tokens, kv_heads, c.head_dim)
        v = qkv[:, q_width + kv_width :].reshape(tokens, kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q, k = self.norm(layer.q_norm, q), self.norm(layer.k_norm, k)
        window = c.window_of(index)
        table = self._local_rotary_device if window is not None else self._rotary_device
        attended, cache = ops.rotary_and_paged_attention(q, k, v, positions, table, cache, step.slot_mapping, step,
                                                         c.attention_scale, window, c.attn_logit_softcapping,
                                                         self.rotary_style)
        return ops.linear(attended.reshape(tokens, q_width), layer.out, layer.out_bias), cache

    def mlp(self, layer: Layer, h):
        """The layer's MLP of `h`, dense or its experts: with tensor parallelism this rank's partial sum (see
        `summed_over_ranks`)."""
        if layer.experts is not None:
            return self._sparse_moe(self.ops, layer.experts, h)
        return self._dense_mlp_from(layer, self.ops.linear(h, layer.mlp_in, layer.mlp_in_bias))

    def normed_mlp(self, layer: Layer, norm: Norm, x, branch):
        """(mlp(norm(x + branch)), x + branch), a dense MLP's first projection made with the norm
        (`normed_projection`), a gated one's whole MLP with an RMS norm (`Ops.rms_norm_gated_mlp`, which a
        backend may fuse); without a branch, of norm(x) and x."""
        if layer.experts is not None:
            h, joined = joined_and_normed(self, norm, x, branch)
            return self._sparse_moe(self.ops, layer.experts, h), joined
        if self.gated_mlp and self.norm_kind == "rms":
            return self.ops.rms_norm_gated_mlp(
                x if branch is None else branch, None if branch is None else x, norm.weight, self.config.norm_eps,
                layer.mlp_in, layer.mlp_out, layer.mlp_in_bias, layer.mlp_out_bias, self.norm_offset,
                gated_activation(self.config.hidden_act))
        projected, joined = self.normed_projection(norm, x, branch, layer.mlp_in, layer.mlp_in_bias)
        return self._dense_mlp_from(layer, projected), joined

    def _dense_mlp_from(self, layer: Layer, projected):
        """A dense MLP from its first projection's output (gate and up, or fc1)."""
        ops, act = self.ops, self.config.hidden_act
        if self.gated_mlp:
            return ops.gated_linear(projected, layer.mlp_out, layer.mlp_out_bias, gated_activation(act))
        return ops.linear(ops.gelu(projected, _gelu_approximation(act)), layer.mlp_out, layer.mlp_out_bias)

    def compute_logits(self, hidden, rows):
        """Logits [N, vocab] of the hidden states at `rows` (int32 backend tensor [N]), on every rank."""
        picked = self.ops.gather_rows(hidden, rows)
        logits, _ = self.normed_projection(self.final_norm, picked, None, self.lm_head, self.lm_head_bias)
        if self.config.final_logit_softcapping:
            logits = self.ops.softcap(logits, self.config.final_logit_softcapping)
        if self._vocab_parallel:
            logits = self.communicator.all_gather(logits, dim=-1)
            if logits.shape[1] != self.vocab_size:  # the last ranks' padding rows
                logits = logits[:, : self.vocab_size]
        return logits


def gated_activation(activation: str) -> str:
    """The `Ops.gated_linear` activation of a config's hidden_act."""
    if activation == "silu":
        return "silu"
    return "gelu_tanh" if _gelu_approximation(activation) == "tanh" else "gelu"


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
