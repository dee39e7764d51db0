"""What a decoder model computes with: its weights as backend tensors, as the loader
(`candelabra.core.loading.decoder_weights`) hands them over, and which tensor-parallel shard they are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from candelabra.core.contract.dtypes import DType
from candelabra.core.models.sharding import HeadShard

if TYPE_CHECKING:
    from candelabra.core.models.offloaded_experts import OffloadedExperts


@dataclass
class Norm:
    weight: Any
    bias: Any = None


@dataclass
class Experts:
    """A MoE layer's MLP weights: the router's linear weight [E, H], and the experts' gate and up
    projections stacked [E', 2I, H] (gate rows first) and down projections [E', H, I], uploaded with
    role EXPERTS: every expert (E' = E), or a tensor-parallel rank's share, the E' experts from the
    layer's expert `first` on. DeepSeek's router bias for choosing (float32 [E]) and its shared experts'
    fused gate and up [2S, H] and down [H, S] linear weights, where the checkpoint has them. With some
    experts in host memory, `offloaded` brings them into the rows after the others (see
    `candelabra.core.models.offloaded_experts`)."""

    router: Any
    gate_up: Any
    down: Any
    correction_bias: Any = None
    shared_gate_up: Any = None
    shared_down: Any = None
    offloaded: OffloadedExperts | None = None
    first: int = 0


@dataclass
class LatentAttention:
    """A layer's multi-head latent attention weights (DeepSeek V2/V3), for this rank's heads:
    - `latent_in`: the query's down-projection (q_a_proj, or the whole q_proj without a q bottleneck)
      and kv_a_proj_with_mqa stacked, [Q + R + P, H], with their bias where the checkpoint has one;
    - `q_norm` and `q_up`: q_a_layernorm and q_b_proj [heads * (N + P), Q], None without a bottleneck;
    - `latent_norm`: kv_a_layernorm [R];
    - `absorbed_key` [heads, R, N] and `absorbed_value` [heads, V, R]: kv_b_proj's key and value rows of
      each head, the key's transposed, role PER_HEAD (`Ops.per_head_linear`)."""

    latent_in: Any
    latent_in_bias: Any
    latent_norm: Norm
    absorbed_key: Any
    absorbed_value: Any
    q_norm: Norm | None = None
    q_up: Any = None


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
    experts: Experts | None = None  # a MoE layer's MLP, in place of the dense one above
    latent_attention: LatentAttention | None = None  # DeepSeek's, in place of qkv above


@dataclass
class DecoderWeights:
    """A whole model's weights on one backend, or one rank's shard of them: `head_shard` names its
    query and KV heads, and a `vocab_parallel` LM head holds this rank's rows of the vocabulary
    (padded); `vocab_size` is the LM head's rows in all."""

    dtype: DType
    embed_tokens: Any
    lm_head: Any
    lm_head_bias: Any
    final_norm: Norm
    layers: list[Layer]
    vocab_size: int
    head_shard: HeadShard
    vocab_parallel: bool = False
