"""DeepSeek V2 and V3: multi-head latent attention and a mixture of experts with shared experts.

Attention caches one compressed latent and one shared rotary key per token (a latent cache: one KV
head, the rotary key as the key and the latent as the value) and never expands them into per-head keys
and values: each head's key up-projection is folded into its query and its value up-projection into
its output (`Ops.per_head_linear` on either side of `Ops.paged_latent_attention`), for prefills and
decodes alike. DeepSeek's rotary features are interleaved pairs (gptj style), unless a V3 config.json
turns rope_interleave off. How the routers choose differs between V2 and V3 and is read into
`MoeConfig`; the graph is the same.
"""

from __future__ import annotations

from candelabra.core.models.base import DecoderModel
from candelabra.core.models.config import ModelConfig
from candelabra.core.models.layer_weights import Layer

LATENT_ATTENTION_OPS = ("per_head_linear", "paged_latent_attention")


class DeepseekV2(DecoderModel):
    rotary_style = "gptj"

    @classmethod
    def ops_needed(cls, config: ModelConfig) -> tuple[str, ...]:
        return super().ops_needed(config) + LATENT_ATTENTION_OPS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.config.raw.get("rope_interleave", True):
            self.rotary_style = "neox"

    @classmethod
    def kv_cache_layout(cls, config: ModelConfig, kv_heads: int) -> tuple[int, int, int]:
        """The latent cache: one head, the rotary key as the key and the latent as the value."""
        return 1, config.mla.qk_rope_head_dim, config.mla.kv_lora_rank

    def attention_projection(self, layer: Layer):
        """The queries' (or their compressed queries'), the latent's and the rotary key's projection."""
        return layer.latent_attention.latent_in, layer.latent_attention.latent_in_bias

    def attention(self, index: int, layer: Layer, projected, step, positions, cache):
        mla, ops, weights = self.config.mla, self.ops, layer.latent_attention
        tokens, heads = projected.shape[0], self.num_local_heads
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        if weights.q_up is None:
            q_width = heads * mla.qk_head_dim
            q = projected[:, :q_width]
        else:
            q_width = mla.q_lora_rank
            q, _ = self.normed_projection(weights.q_norm, projected[:, :q_width], None, weights.q_up)
        latent = self.norm(weights.latent_norm, projected[:, q_width : q_width + rank])
        rotary_key = projected[:, q_width + rank :].reshape(tokens, 1, mla.qk_rope_head_dim)
        q = q.reshape(tokens, heads, mla.qk_head_dim)
        q_rope, cache = ops.rotary_and_write_kv(q[..., nope:], rotary_key, latent.reshape(tokens, 1, rank), positions,
                                                self._rotary_device, cache, step.slot_mapping, self.rotary_style)
        q_latent = ops.per_head_linear(q[..., :nope], weights.absorbed_key)
        attended = ops.paged_latent_attention(q_latent, q_rope, cache, step, self.config.attention_scale)
        values = ops.per_head_linear(attended, weights.absorbed_value)
        return ops.linear(values.reshape(tokens, heads * mla.v_head_dim), layer.out, layer.out_bias), cache


class DeepseekV3(DeepseekV2):
    pass
