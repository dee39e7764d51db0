"""Which tensors, by Hugging Face name, shape and role, a model family loads for a config.json.

The loader (`candelabra.core.loading.decoder_weights`) reads what a family's attributes say
(norm kind, its block's norm names, gated or plain MLP, the attention output's and the final norm's
names) and takes the rest from whatever the checkpoint holds: biases, per-head q/k norms, projections stored
fused. Those last facts live in each architecture's config.json conventions, which
`ARCHITECTURE_TENSORS` writes down; everything else is read from the family class itself. A MoE
layer's router and experts are listed one expert at a time, as the Hub's checkpoints and transformers'
`save_pretrained` store them, under the family's first `expert_names` block.
"""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.contract.weights import WeightRole
from candelabra.core.models.base import DecoderModel
from candelabra.core.models.config import ModelConfig

# A bias is always there (True), never (False), or there when a config.json key says so
# (the key, and transformers' default for it when config.json leaves it out).
BiasRule = bool | tuple[str, bool]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    role: WeightRole


@dataclass(frozen=True)
class ArchitectureTensors:
    """What the shared decoder takes from an architecture's checkpoint when it is there."""

    qkv_bias: BiasRule = False
    out_bias: BiasRule = False
    mlp_bias: BiasRule = False
    lm_head_bias: bool = False
    qk_norms: bool = False  # per-head RMSNorm weights on queries and keys
    fused_qkv: bool = False  # one qkv_proj instead of q_proj, k_proj, v_proj
    fused_gate_up: bool = False  # one gate_up_proj instead of gate_proj and up_proj


_ATTENTION_BIAS = ("attention_bias", False)

# As transformers' modeling files build each architecture's layers.
ARCHITECTURE_TENSORS: dict[str, ArchitectureTensors] = {
    "LlamaForCausalLM": ArchitectureTensors(qkv_bias=_ATTENTION_BIAS, out_bias=_ATTENTION_BIAS,
                                            mlp_bias=("mlp_bias", False)),
    "MistralForCausalLM": ArchitectureTensors(),
    "Qwen2ForCausalLM": ArchitectureTensors(qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureTensors(qkv_bias=_ATTENTION_BIAS, out_bias=_ATTENTION_BIAS, qk_norms=True),
    "GemmaForCausalLM": ArchitectureTensors(qkv_bias=_ATTENTION_BIAS, out_bias=_ATTENTION_BIAS),
    "Gemma2ForCausalLM": ArchitectureTensors(qkv_bias=_ATTENTION_BIAS, out_bias=_ATTENTION_BIAS),
    "Gemma3ForCausalLM": ArchitectureTensors(qkv_bias=_ATTENTION_BIAS, out_bias=_ATTENTION_BIAS, qk_norms=True),
    "Phi3ForCausalLM": ArchitectureTensors(fused_qkv=True, fused_gate_up=True),
    "PhiForCausalLM": ArchitectureTensors(qkv_bias=True, out_bias=True, mlp_bias=True, lm_head_bias=True),
    "StableLmForCausalLM": ArchitectureTensors(qkv_bias=("use_qkv_bias", False)),
    "Glm4ForCausalLM": ArchitectureTensors(qkv_bias=("attention_bias", True), fused_gate_up=True),
    "MixtralForCausalLM": ArchitectureTensors(),
    "DeepseekV2ForCausalLM": ArchitectureTensors(out_bias=_ATTENTION_BIAS, mlp_bias=("mlp_bias", False)),
    "DeepseekV3ForCausalLM": ArchitectureTensors(out_bias=_ATTENTION_BIAS),
    "Qwen3MoeForCausalLM": ArchitectureTensors(qkv_bias=_ATTENTION_BIAS, out_bias=_ATTENTION_BIAS, qk_norms=True),
}
# An architecture a plugin registers without an entry here: the plain decoder, no biases.
PLAIN = ArchitectureTensors()


def model_tensors(config: ModelConfig, family: type[DecoderModel]) -> dict[str, TensorSpec]:
    """Every tensor `family` loads for `config`, in the order transformers saves them."""
    kind = ARCHITECTURE_TENSORS.get(config.architecture, PLAIN)
    hidden, vocab = config.hidden_size, config.vocab_size
    tensors = {"model.embed_tokens.weight": TensorSpec((vocab, hidden), WeightRole.EMBEDDING)}
    for index in range(config.num_layers):
        tensors |= _layer_tensors(index, config, family, kind)
    tensors |= _norm(family.final_norm_name, hidden, family)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = TensorSpec((vocab, hidden), WeightRole.LM_HEAD)
    if kind.lm_head_bias:
        tensors["lm_head.bias"] = TensorSpec((vocab,), WeightRole.BIAS)
    return tensors


def _layer_tensors(index: int, c: ModelConfig, family: type[DecoderModel],
                   kind: ArchitectureTensors) -> dict[str, TensorSpec]:
    prefix = f"model.layers.{index}"
    attn = f"{prefix}.self_attn"
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    has_qkv_bias = _has(kind.qkv_bias, c)
    tensors: dict[str, TensorSpec] = {}
    if c.mla is not None:
        tensors |= _latent_attention(attn, c, family, kind)
    elif kind.fused_qkv:
        tensors |= _linear(f"{attn}.qkv_proj", q_rows + 2 * kv_rows, c.hidden_size, has_qkv_bias)
    else:
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            tensors |= _linear(f"{attn}.{name}", rows, c.hidden_size, has_qkv_bias)
    if c.mla is None:
        tensors |= _linear(f"{attn}.{family.attention_out_name}", c.hidden_size, q_rows, _has(kind.out_bias, c))
    if kind.qk_norms:
        tensors |= _norm(f"{attn}.q_norm", c.head_dim, family) | _norm(f"{attn}.k_norm", c.head_dim, family)
    sparse = c.moe is not None and c.moe.is_sparse(index)
    tensors |= _experts(prefix, c, family) if sparse else _dense_mlp(f"{prefix}.mlp", c, family, kind)
    for name in family.block_for(c).norm_names:
        tensors |= _norm(f"{prefix}.{name}", c.hidden_size, family)
    return tensors


def _dense_mlp(mlp: str, c: ModelConfig, family: type[DecoderModel],
               kind: ArchitectureTensors) -> dict[str, TensorSpec]:
    has_bias, size = _has(kind.mlp_bias, c), c.intermediate_size
    if not family.gated_mlp:
        up = _linear(f"{mlp}.fc1", size, c.hidden_size, has_bias)
        return up | _linear(f"{mlp}.fc2", c.hidden_size, size, has_bias)
    if kind.fused_gate_up:
        tensors = _linear(f"{mlp}.gate_up_proj", 2 * size, c.hidden_size, has_bias)
    else:
        tensors = _linear(f"{mlp}.gate_proj", size, c.hidden_size, has_bias)
        tensors |= _linear(f"{mlp}.up_proj", size, c.hidden_size, has_bias)
    return tensors | _linear(f"{mlp}.down_proj", c.hidden_size, size, has_bias)


def _latent_attention(attn: str, c: ModelConfig, family: type[DecoderModel],
                      kind: ArchitectureTensors) -> dict[str, TensorSpec]:
    mla, bias = c.mla, _has(_ATTENTION_BIAS, c)
    q_rows = c.num_heads * mla.qk_head_dim
    if mla.q_lora_rank:
        tensors = _linear(f"{attn}.q_a_proj", mla.q_lora_rank, c.hidden_size, bias)
        tensors |= _norm(f"{attn}.q_a_layernorm", mla.q_lora_rank, family)
        tensors |= _linear(f"{attn}.q_b_proj", q_rows, mla.q_lora_rank, False)
    else:
        tensors = _linear(f"{attn}.q_proj", q_rows, c.hidden_size, False)
    tensors |= _linear(f"{attn}.kv_a_proj_with_mqa", mla.kv_lora_rank + mla.qk_rope_head_dim, c.hidden_size, bias)
    tensors |= _norm(f"{attn}.kv_a_layernorm", mla.kv_lora_rank, family)
    tensors |= _linear(f"{attn}.kv_b_proj", c.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank,
                       False)
    return tensors | _linear(f"{attn}.{family.attention_out_name}", c.hidden_size, c.num_heads * mla.v_head_dim,
                             _has(kind.out_bias, c))


def _experts(prefix: str, c: ModelConfig, family: type[DecoderModel]) -> dict[str, TensorSpec]:
    names, moe = family.expert_names, c.moe
    block, size = f"{prefix}.{names.blocks[0]}", moe.expert_intermediate_size
    tensors = {f"{block}.gate.weight": TensorSpec((moe.num_experts, c.hidden_size), WeightRole.LINEAR)}
    if moe.scoring == "sigmoid":  # DeepSeek-V3's bias for choosing
        tensors[f"{block}.gate.e_score_correction_bias"] = TensorSpec((moe.num_experts,), WeightRole.BIAS)
    for expert in range(moe.num_experts):
        for name, shape in ((names.gate, (size, c.hidden_size)), (names.up, (size, c.hidden_size)),
                            (names.down, (c.hidden_size, size))):
            tensors[f"{block}.experts.{expert}.{name}.weight"] = TensorSpec(shape, WeightRole.EXPERTS)
    if moe.shared_intermediate_size:
        shared, width = f"{block}.shared_experts", moe.shared_intermediate_size
        tensors |= _linear(f"{shared}.gate_proj", width, c.hidden_size, False)
        tensors |= _linear(f"{shared}.up_proj", width, c.hidden_size, False)
        tensors |= _linear(f"{shared}.down_proj", c.hidden_size, width, False)
    return tensors


def _linear(prefix: str, rows: int, columns: int, bias: bool) -> dict[str, TensorSpec]:
    tensors = {f"{prefix}.weight": TensorSpec((rows, columns), WeightRole.LINEAR)}
    if bias:
        tensors[f"{prefix}.bias"] = TensorSpec((rows,), WeightRole.BIAS)
    return tensors


def _norm(prefix: str, size: int, family: type[DecoderModel]) -> dict[str, TensorSpec]:
    tensors = {f"{prefix}.weight": TensorSpec((size,), WeightRole.NORM)}
    if family.norm_kind == "layer":
        tensors[f"{prefix}.bias"] = TensorSpec((size,), WeightRole.BIAS)
    return tensors


def _has(rule: BiasRule, config: ModelConfig) -> bool:
    if isinstance(rule, bool):
        return rule
    key, default = rule
    value = config.raw.get(key)
    return default if value is None else bool(value)
