"""One configuration type for every architecture, read from a Hugging Face config.json dict.

Both config.json styles are read: the hub's (`rope_theta`, `rope_scaling`, `rope_local_base_freq`)
and transformers 5's (`rope_parameters`, per layer type where layers differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from candelabra.core.models.rope import RopeScaling

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"

# candle-vllm's model-type words and the architectures each may name.
MODEL_TYPE_WORDS: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM", "MistralForCausalLM"),
    "llama3": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM", "LlamaForCausalLM"),
    "yi": ("LlamaForCausalLM",),
    "phi2": ("PhiForCausalLM",),
    "phi3": ("Phi3ForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "gemma": ("GemmaForCausalLM", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    "stable-lm": ("StableLmForCausalLM",),
    "glm4": ("Glm4ForCausalLM",),
    "deep-seek": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
}

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling: RopeScaling
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts model's MLP settings: each token's MLP is `experts_per_token` of
    `num_experts` gated experts chosen by a router, except in `dense_layers`, which keep a dense MLP.
    How the router chooses is `Ops.route_experts`' (its arguments of the same names); DeepSeek's layers
    also run `shared_intermediate_size` wide shared experts on every token."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    renormalize: bool  # the chosen experts' router weights divided by their sum
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    dense_layers: frozenset[int] = frozenset()
    num_groups: int = 1
    top_groups: int = 1
    group_scoring: Literal["max", "top2_sum"] = "max"
    routed_scale: float = 1.0
    shared_intermediate_size: int = 0  # 0: no shared experts

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek V2/V3): keys and values come from one compressed latent of
    `kv_lora_rank` per token plus a rotary key of `qk_rope_head_dim` shared by all heads; a head's query
    is `qk_nope_head_dim` features matched against the latent and `qk_rope_head_dim` rotary ones, and its
    value `v_head_dim` wide. Queries pass through a `q_lora_rank` bottleneck where one is given."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    rope: RopeConfig
    layer_types: tuple[str, ...]
    local_rope: RopeConfig | None = None  # Gemma 3's sliding-window layers
    sliding_window: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None
    mla: LatentAttentionConfig | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        if self.mla is not None:  # over the whole query head; yarn's mscale squared on top
            return self.mla.qk_head_dim**-0.5 * self.rope.scaling.softmax_mscale**2
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @classmethod
    def from_hf(cls, config: dict) -> ModelConfig:
        config = config.get("text_config", config) | {"architectures": config.get("architectures")}
        architectures = config.get("architectures") or []
        if not architectures:
            raise ConfigError("config.json names no architecture ('architectures' is missing)")
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            num_layers = int(config["num_hidden_layers"])
            max_positions = int(config.get("max_position_embeddings", 4096))
            rope, local_rope = _rope_configs(config, max_positions)
            eos = config.get("eos_token_id")
            return cls(
                architecture=architectures[0],
                model_type=config.get("model_type", ""),
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=_head_dim(config, architectures[0], hidden // heads),
                max_position_embeddings=max_positions,
                norm_eps=float(config.get("rms_norm_eps") or config.get("layer_norm_eps") or 1e-6),
                hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "silu",
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                rope=rope,
                local_rope=local_rope,
                layer_types=_layer_types(config, architectures[0], num_layers),
                sliding_window=config.get("sliding_window"),
                attn_logit_softcapping=config.get("attn_logit_softcapping"),
                final_logit_softcapping=config.get("final_logit_softcapping"),
                query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                moe=_moe_config(config, architectures[0], num_layers),
                mla=_latent_attention_config(config, architectures[0]),
                raw=config,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks {exc.args[0]!r}, which a {architectures[0]} needs") from exc

    def check_model_type(self, word: str) -> None:
        """Accept one of candle-vllm's model-type words only if it names this checkpoint's family."""
        if word not in MODEL_TYPE_WORDS:
            raise ConfigError(f"unknown model type {word!r}; expected one of {', '.join(MODEL_TYPE_WORDS)}")
        if self.architecture not in MODEL_TYPE_WORDS[word]:
            raise ConfigError(
                f"model type {word!r} does not match the checkpoint, which is a {self.architecture}; "
                "leave the model type out to use the checkpoint's own"
            )


def _rope_configs(config: dict, max_positions: int) -> tuple[RopeConfig, RopeConfig | None]:
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and FULL_ATTENTION in parameters:
        full = _rope_config(parameters[FULL_ATTENTION], config, max_positions)
        local = parameters.get(SLIDING_ATTENTION)
        return full, _rope_config(local, config, max_positions) if local else None
    if isinstance(parameters, dict):
        return _rope_config(parameters, config, max_positions), None
    legacy = {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}
    local = None
    if "rope_local_base_freq" in config:
        local = _rope_config({"rope_theta": config["rope_local_base_freq"]}, config, max_positions)
    return _rope_config(legacy, config, max_positions), local


def _rope_config(entry: dict, config: dict, max_positions: int) -> RopeConfig:
    partial = entry.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return RopeConfig(
        theta=float(entry.get("rope_theta", config.get("rope_theta", 10000.0))),
        scaling=RopeScaling.from_hf(entry, max_positions),
        partial_rotary_factor=float(partial),
    )


def _layer_types(config: dict, architecture: str, num_layers: int) -> tuple[str, ...]:
    if config.get("layer_types"):
        types = tuple(config["layer_types"])
        if len(types) != num_layers:
            raise ConfigError(f"layer_types lists {len(types)} layers, num_hidden_layers says {num_layers}")
        return types
    if architecture == "Gemma2ForCausalLM":
        return tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers))
    if architecture.startswith("Gemma3"):
        pattern = int(config.get("sliding_window_pattern", 6))
        return tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers))
    slides_by_default = architecture in ("MistralForCausalLM", "MixtralForCausalLM")
    if config.get("sliding_window") and config.get("use_sliding_window", slides_by_default):
        if architecture.startswith("Qwen"):  # Qwen slides from layer max_window_layers on
            first_sliding = int(config.get("max_window_layers", num_layers))
            return tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers))
        return (SLIDING_ATTENTION,) * num_layers
    return (FULL_ATTENTION,) * num_layers


def _head_dim(config: dict, architecture: str, default: int) -> int:
    """A head's width; DeepSeek's rotary part's, which is what its rotary table and cache are built for."""
    if architecture in DEEPSEEK_ARCHITECTURES:
        return int(config["qk_rope_head_dim"])
    return int(config.get("head_dim") or default)


def _latent_attention_config(config: dict, architecture: str) -> LatentAttentionConfig | None:
    if architecture not in DEEPSEEK_ARCHITECTURES:
        return None
    q_lora_rank = config.get("q_lora_rank")
    return LatentAttentionConfig(
        kv_lora_rank=int(config["kv_lora_rank"]),
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
    )


def _moe_config(config: dict, architecture: str, num_layers: int) -> MoeConfig | None:
    """The experts' settings, None for a dense model. Mixtral names its experts num_local_experts,
    Qwen3-MoE num_experts on the Hub (num_local_experts where transformers 5 wrote the config); a
    Qwen3-MoE layer keeps a dense MLP when in mlp_only_layers or when (layer + 1) is not a multiple of
    decoder_sparse_step. Mixtral always renormalizes the chosen experts' weights, Qwen3-MoE when
    norm_topk_prob says so (transformers' default: not)."""
    if architecture in DEEPSEEK_ARCHITECTURES:
        return _deepseek_moe_config(config, architecture, num_layers)
    num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if num_experts == 0:
        return None
    top_k = int(config["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok is {top_k}, but a token can only take 1 to {num_experts} experts")
    step = int(config.get("decoder_sparse_step") or 1)
    only_dense = {int(layer) for layer in config.get("mlp_only_layers") or ()}
    return MoeConfig(
        num_experts=num_experts,
        experts_per_token=top_k,
        expert_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        renormalize=architecture == "MixtralForCausalLM" or bool(config.get("norm_topk_prob", False)),
        dense_layers=frozenset(i for i in range(num_layers) if i in only_dense or (i + 1) % step != 0),
    )


def _deepseek_moe_config(config: dict, architecture: str, num_layers: int) -> MoeConfig | None:
    """DeepSeek's routed experts: layers below first_k_dense_replace (and, in V2's own code, those not a
    multiple of moe_layer_freq) are dense. V3 scores with a sigmoid, groups by the sum of each group's
    best two and keeps topk_group of n_group groups; V2 scores with a softmax and, with
    group_limited_greedy, groups by each group's best. Both scale the weights by routed_scaling_factor
    and renormalize them when norm_topk_prob says so."""
    num_experts = int(config.get("n_routed_experts") or 0)
    if num_experts == 0:
        return None
    top_k = int(config["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok is {top_k}, but a token can only take 1 to {num_experts} experts")
    first_sparse, frequency = int(config.get("first_k_dense_replace") or 0), int(config.get("moe_layer_freq") or 1)
    v3 = architecture == "DeepseekV3ForCausalLM"
    grouped = v3 or config.get("topk_method") == "group_limited_greedy"
    size = int(config["moe_intermediate_size"])
    return MoeConfig(
        num_experts=num_experts,
        experts_per_token=top_k,
        expert_intermediate_size=size,
        renormalize=bool(config.get("norm_topk_prob", v3)),
        scoring="sigmoid" if v3 else "softmax",
        dense_layers=frozenset(i for i in range(num_layers) if i < first_sparse or i % frequency),
        num_groups=int(config.get("n_group") or 1) if grouped else 1,
        top_groups=int(config.get("topk_group") or 1) if grouped else 1,
        group_scoring="top2_sum" if v3 else "max",
        routed_scale=float(config.get("routed_scaling_factor") or 1.0),
        shared_intermediate_size=size * int(config.get("n_shared_experts") or 0),
    )
