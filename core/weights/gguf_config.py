"""A Hugging Face config.json dict synthesized from a GGUF file's metadata.

GGUF keeps hyperparameters under keys named for its architecture ("qwen2.block_count"); each
supported architecture maps to one Hugging Face class here, or to a second one when the file holds
experts (llama: Mixtral) or scores them with a sigmoid (deepseek2: DeepSeek-V3). What GGUF does not
store is filled in the way llama.cpp itself fills it in when it runs the file (Gemma's query scaling,
Gemma 3's local/global layer pattern and local rope base, Qwen3-MoE's renormalized expert weights,
DeepSeek's yarn mscale).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from candelabra.core.weights import CheckpointError
from candelabra.core.weights.gguf_file import GGUFFile, TensorInfo

_REQUIRED = object()


@dataclass(frozen=True)
class Architecture:
    hf_class: str
    model_type: str
    hidden_act: str
    layer_norm: bool = False  # LayerNorm with layer_norm_eps rather than RMSNorm with rms_norm_eps
    extras: Callable[[Metadata, dict], dict] | None = None  # keys only this architecture has
    # What a file of this architecture is when it holds experts (`{arch}.expert_count` above 0).
    with_experts: Architecture | None = None


class Metadata:
    """Typed access to a GGUF file's metadata; architecture keys are named without their prefix."""

    def __init__(self, file: GGUFFile, arch: str) -> None:
        self.file, self.arch = file, arch

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.file.metadata

    def raw(self, full_key: str, default: object = _REQUIRED) -> object:
        if full_key in self.file.metadata:
            return self.file.metadata[full_key]
        if default is _REQUIRED:
            raise CheckpointError(self.file.path, f"lacks the metadata key {full_key!r}, which {self.arch} models need")
        return default

    def integer(self, key: str, default: object = _REQUIRED, full: bool = False) -> int:
        full_key = key if full else f"{self.arch}.{key}"
        value = self.raw(full_key, default)
        if isinstance(value, np.ndarray) and value.size and np.all(value == value.flat[0]):
            value = value.flat[0].item()  # a per-layer array that is the same for every layer
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, np.ndarray):
                raise CheckpointError(self.file.path, f"{full_key} varies per layer, which candelabra does not support")
            raise CheckpointError(self.file.path, f"metadata {full_key!r} is {value!r}, expected an integer")
        return value

    def positive(self, key: str, default: object = _REQUIRED) -> int:
        value = self.integer(key, default)
        if value <= 0:
            raise CheckpointError(self.file.path, f"metadata {self.arch}.{key} is {value}, expected a positive integer")
        return value

    def number(self, key: str, default: object = _REQUIRED) -> float:
        if not self.has(key) and default is not _REQUIRED:
            return default  # type: ignore[return-value]
        value = self.raw(f"{self.arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(self.file.path, f"metadata {self.arch}.{key} is {value!r}, expected a number")
        return float(value)

    def text(self, key: str, default: object = _REQUIRED) -> str:
        value = self.raw(f"{self.arch}.{key}", default)
        if not isinstance(value, str):
            raise CheckpointError(self.file.path, f"metadata {self.arch}.{key} is {value!r}, expected a string")
        return value


def synthesize_config(file: GGUFFile) -> dict:
    arch_name = file.metadata.get("general.architecture")
    if arch_name is None:
        raise CheckpointError(file.path, "lacks the metadata key 'general.architecture'; is it a model file?")
    if arch_name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise CheckpointError(file.path, f"holds a {arch_name!r} model; candelabra reads GGUF files of: {supported}")
    arch = ARCHITECTURES[arch_name]
    meta = Metadata(file, arch_name)
    if arch.with_experts is not None and meta.integer("expert_count", 0) > 0:
        arch = arch.with_experts
    config = base_config(meta, arch)
    if arch.extras is not None:
        config.update(arch.extras(meta, config))
    return config


def base_config(meta: Metadata, arch: Architecture) -> dict:
    hidden_size = meta.positive("embedding_length")
    heads = meta.positive("attention.head_count")
    head_dim = meta.positive("attention.key_length", hidden_size // heads)
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden_size,
        "intermediate_size": meta.positive("feed_forward_length"),
        "num_hidden_layers": meta.positive("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.positive("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.positive("context_length"),
        "hidden_act": arch.hidden_act,
        "rope_theta": meta.number("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in meta.file.tensors,
    }
    if arch.layer_norm:
        config["layer_norm_eps"] = meta.number("attention.layer_norm_epsilon")
    else:
        config["rms_norm_eps"] = meta.number("attention.layer_norm_rms_epsilon")
    if meta.has("rope.dimension_count"):
        config["partial_rotary_factor"] = meta.positive("rope.dimension_count") / head_dim
    if (rope_scaling := rope_scaling_from_metadata(meta)) is not None:
        config["rope_scaling"] = rope_scaling
    if meta.integer("attention.sliding_window", 0) > 0:
        config["sliding_window"] = meta.integer("attention.sliding_window")
    for gguf_key, hf_key in TOKEN_IDS.items():
        if gguf_key in meta.file.metadata:
            config[hf_key] = meta.integer(gguf_key, full=True)
    return config


TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def vocab_size(meta: Metadata) -> int:
    """The embedding's row count, as Hugging Face counts it (it may exceed the tokenizer's)."""
    embedding = meta.file.tensors.get("token_embd.weight")
    if embedding is not None:
        return embedding.shape[0]
    tokens = meta.raw("tokenizer.ggml.tokens", None)
    if tokens is None:
        raise CheckpointError(meta.file.path, "has neither a token_embd.weight tensor nor tokenizer.ggml.tokens")
    return len(tokens)


def rope_scaling_from_metadata(meta: Metadata) -> dict | None:
    if meta.has("rope.scale_linear"):  # the key older converters wrote
        return {"rope_type": "linear", "factor": meta.number("rope.scale_linear")}
    kind = meta.text("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.number("rope.scaling.factor")}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": meta.number("rope.scaling.factor"),
            "original_max_position_embeddings": meta.positive("rope.scaling.original_context_length"),
        }
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if meta.has(f"rope.scaling.{gguf_key}"):
                scaling[hf_key] = meta.number(f"rope.scaling.{gguf_key}")
        return scaling
    if kind == "longrope":
        return None  # Phi-3 keeps its factors in tensors; phi3_extras reads them
    raise CheckpointError(meta.file.path, f"uses rope scaling {kind!r}; candelabra supports linear, yarn and longrope")


def has_tensor(meta: Metadata, name: str) -> bool:
    return name in meta.file.tensors


def read_vector(meta: Metadata, name: str) -> list[float]:
    info: TensorInfo = meta.file.tensors[name]
    return meta.file.read_rows(info).reshape(-1).tolist()


# Per-architecture keys.


def llama_extras(meta: Metadata, config: dict) -> dict:
    extras = {
        "attention_bias": has_tensor(meta, "blk.0.attn_q.bias"),
        "mlp_bias": has_tensor(meta, "blk.0.ffn_up.bias"),
    }
    if has_tensor(meta, "rope_freqs.weight"):
        factors = np.array(read_vector(meta, "rope_freqs.weight"))
        if not np.allclose(factors, 1.0):
            extras["rope_scaling"] = llama3_rope_scaling(meta, config, factors)
    return extras


def llama3_rope_scaling(meta: Metadata, config: dict, factors: np.ndarray) -> dict:
    """Llama 3.1's rope scaling recovered from the per-frequency factors llama.cpp stores.

    The factors depend on (factor, low_freq_factor, high_freq_factor, original context) only
    through factor and two combinations of the others, so any original context length fits
    exactly; the file's own value is used when it has one, else Llama 3's 8192.
    """
    original = meta.positive("rope.scaling.original_context_length", 8192)
    rotary_dim = 2 * len(factors)
    inv_freq = config["rope_theta"] ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    inverse_wavelength = inv_freq / (2 * math.pi)
    factor = float(factors.max())
    blended = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    low_freq_factor, high_freq_factor = 1.0, 4.0
    if blended.sum() >= 2:
        # Between the thresholds 1/f = (1 - s)/factor + s with s linear in 1/wavelength.
        smooth = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inverse_wavelength[blended], smooth, 1)
        low_freq_factor = -intercept * original / slope
        high_freq_factor = low_freq_factor + original / slope
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low_freq_factor),
        "high_freq_factor": float(high_freq_factor),
        "original_max_position_embeddings": original,
    }
    if not np.allclose(llama3_factors(scaling, inverse_wavelength), factors, rtol=1e-4):
        raise CheckpointError(meta.file.path, "has rope_freqs.weight factors that do not follow Llama 3 rope scaling")
    return scaling


def llama3_factors(scaling: dict, inverse_wavelength: np.ndarray) -> np.ndarray:
    """What each frequency is divided by under Llama 3 rope scaling."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = np.clip((original * inverse_wavelength - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def attention_bias_extras(meta: Metadata, config: dict) -> dict:
    return {"attention_bias": has_tensor(meta, "blk.0.attn_q.bias") or has_tensor(meta, "blk.0.attn_qkv.bias")}


def query_pre_attn_scalar(config: dict, large_model_layers: int) -> int:
    # llama.cpp scales queries by 1/sqrt(hidden/heads) for Gemma 2 27B (46 layers) and Gemma 3 27B
    # (62 layers), by 1/sqrt(head_dim) otherwise; their Hugging Face configs say the same.
    if config["num_hidden_layers"] == large_model_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def expert_extras(meta: Metadata, config: dict) -> dict:
    """The experts' count and how many a token takes, as Mixtral's config.json names them."""
    experts, used = meta.positive("expert_count"), meta.positive("expert_used_count")
    if used > experts:
        raise CheckpointError(meta.file.path, f"routes each token to {used} of its {experts} experts")
    return {"num_local_experts": experts, "num_experts_per_tok": used}


def qwen3moe_extras(meta: Metadata, config: dict) -> dict:
    """Qwen3-MoE's expert settings: every layer sparse, as llama.cpp runs it, the chosen experts'
    weights renormalized (the Hub's configs say norm_topk_prob true) unless `expert_weights_norm`
    says otherwise."""
    routed = expert_extras(meta, config)
    return {
        **attention_bias_extras(meta, config),
        "num_experts": routed["num_local_experts"],
        "num_experts_per_tok": routed["num_experts_per_tok"],
        "moe_intermediate_size": meta.positive("expert_feed_forward_length"),
        "norm_topk_prob": bool(meta.raw(f"{meta.arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


class ExpertGating(enum.IntEnum):
    """`{arch}.expert_gating_func`'s values (gguf.ExpertGatingFuncType)."""

    SOFTMAX = 1
    SIGMOID = 2


def deepseek2_extras(meta: Metadata, config: dict) -> dict:
    """DeepSeek V2 or V3 (llama.cpp calls both deepseek2) with the config.json keys of the Hub's
    checkpoints: latent attention's ranks and a head's widths, the routed and shared experts, the
    dense first layers, grouped routing, and yarn with DeepSeek's mscale."""
    v3 = scores_with_sigmoid(meta)
    extras = {**latent_attention_extras(meta, config), **deepseek_expert_extras(meta, v3),
              **deepseek_yarn_extras(meta, config)}
    if v3:
        extras.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return extras


def scores_with_sigmoid(meta: Metadata) -> bool:
    """Whether the router scores with a sigmoid, as DeepSeek-V3's does. Converters before V3 wrote no
    gating function (llama.cpp then runs V2's softmax); a file that lacks it but holds V3's correction
    bias (exp_probs_b) is taken for a V3."""
    if not meta.has("expert_gating_func"):
        return any(name.endswith(".exp_probs_b.bias") for name in meta.file.tensors)
    value = meta.integer("expert_gating_func")
    if value not in set(ExpertGating):
        supported = ", ".join(f"{gating.value} ({gating.name.lower()})" for gating in ExpertGating)
        raise CheckpointError(meta.file.path, f"scores its experts with gating function {value}; "
                                              f"candelabra reads {supported}")
    return value == ExpertGating.SIGMOID


def latent_attention_extras(meta: Metadata, config: dict) -> dict:
    """Latent attention's sizes. Converters since April 2025 write the latent's widths as key_length
    (kv_lora_rank + rope) and value_length (kv_lora_rank), one KV head, and a head's own widths as
    key_length_mla and value_length_mla; older ones wrote a head's widths as key_length and
    value_length."""
    rope = meta.positive("rope.dimension_count")
    suffix = "_mla" if meta.has("attention.key_length_mla") else ""
    query_width = meta.positive(f"attention.key_length{suffix}")
    if query_width <= rope:
        raise CheckpointError(meta.file.path, f"has query heads {query_width} wide, which leaves nothing beside "
                                              f"their {rope} rotary features")
    q_lora_rank = meta.positive("attention.q_lora_rank") if meta.has("attention.q_lora_rank") else None
    if (q_lora_rank is None) == has_tensor(meta, "blk.0.attn_q_a.weight"):
        problem = ("holds attn_q_a tensors but no attention.q_lora_rank" if q_lora_rank is None else
                   f"says attention.q_lora_rank is {q_lora_rank} but holds no attn_q_a tensors")
        raise CheckpointError(meta.file.path, problem)
    heads = config["num_attention_heads"]
    return {
        "num_key_value_heads": heads,  # the file says 1: the latent, which every head reads
        "head_dim": rope,  # what transformers and candelabra build the rotary table for
        "partial_rotary_factor": 1.0,
        "kv_lora_rank": meta.positive("attention.kv_lora_rank"),
        "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": query_width - rope,
        "v_head_dim": meta.positive(f"attention.value_length{suffix}"),
    }


def deepseek_expert_extras(meta: Metadata, v3: bool) -> dict:
    """The experts' settings, with llama.cpp's defaults where a key is absent: no dense first layers,
    no shared experts, one group, weights neither renormalized nor scaled. Groups are scored as the
    Hub's configs say: by their best two experts for V3 (noaux_tc), by their best one for V2
    (group_limited_greedy)."""
    routed = expert_extras(meta, {})
    experts = routed["num_local_experts"]
    # llama.cpp reads 0 (or no key) as no groups
    groups = meta.integer("expert_group_count", 0) or 1
    used_groups = meta.integer("expert_group_used_count", 0) or groups
    if experts % groups or used_groups > groups:
        raise CheckpointError(meta.file.path, f"routes to {used_groups} of {groups} groups of its {experts} experts")
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": routed["num_experts_per_tok"],
        "moe_intermediate_size": meta.positive("expert_feed_forward_length"),
        "n_shared_experts": meta.integer("expert_shared_count", 0),
        "first_k_dense_replace": meta.integer("leading_dense_block_count", 0),
        "moe_layer_freq": 1,
        "routed_scaling_factor": meta.number("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.raw(f"{meta.arch}.expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": used_groups,
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
    }


def deepseek_yarn_extras(meta: Metadata, config: dict) -> dict:
    """llama.cpp runs DeepSeek's yarn with its attention scaled by (1 + m ln factor)^2 and cos and sin
    left unscaled, m being `rope.scaling.yarn_log_multiplier` (the converter writes 0.1 * mscale_all_dim):
    DeepSeek's yarn with mscale = mscale_all_dim = m / 0.1, as the Hub's configs have them."""
    scaling = config.get("rope_scaling")
    if scaling is None or scaling["rope_type"] != "yarn" or not meta.has("rope.scaling.yarn_log_multiplier"):
        return {}
    mscale = meta.number("rope.scaling.yarn_log_multiplier") / 0.1
    return {"rope_scaling": {**scaling, "mscale": mscale, "mscale_all_dim": mscale}}


def gemma_extras(meta: Metadata, config: dict) -> dict:
    return {"hidden_activation": "gelu_pytorch_tanh"}


def gemma2_extras(meta: Metadata, config: dict) -> dict:
    layers = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar(config, large_model_layers=46),
        "attn_logit_softcapping": meta.number("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.number("final_logit_softcapping", 30.0),
        "layer_types": ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(layers)],
    }


GEMMA3_SLIDING_WINDOW_PATTERN = 6  # five local layers, then one global; llama.cpp hardcodes it too
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def gemma3_extras(meta: Metadata, config: dict) -> dict:
    layers = config["num_hidden_layers"]
    extras = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar(config, large_model_layers=62),
        "rope_theta": meta.number("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": meta.number("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": meta.number("final_logit_softcapping", None),
    }
    if "sliding_window" not in config:
        extras["sliding_window_pattern"] = 1
        extras["layer_types"] = ["full_attention"] * layers
        return extras
    pattern = meta.raw(f"{meta.arch}.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, np.ndarray):  # one flag per layer: true where the layer is local
        if len(pattern) != layers:
            raise CheckpointError(meta.file.path, f"has {len(pattern)} sliding-window flags for {layers} layers")
        extras["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern.tolist()]
        return extras
    pattern = meta.integer("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    extras["sliding_window_pattern"] = pattern
    extras["layer_types"] = [
        "sliding_attention" if (layer + 1) % pattern else "full_attention" for layer in range(layers)
    ]
    return extras


def phi3_extras(meta: Metadata, config: dict) -> dict:
    extras: dict = {}
    if meta.has("rope.scaling.original_context_length"):
        extras["original_max_position_embeddings"] = meta.positive("rope.scaling.original_context_length")
    if has_tensor(meta, "rope_factors_long.weight") and has_tensor(meta, "rope_factors_short.weight"):
        extras["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": read_vector(meta, "rope_factors_long.weight"),
            "short_factor": read_vector(meta, "rope_factors_short.weight"),
        }
    return extras


def phi2_extras(meta: Metadata, config: dict) -> dict:
    return {"qk_layernorm": False}


def stablelm_extras(meta: Metadata, config: dict) -> dict:
    parallel = meta.raw(f"{meta.arch}.use_parallel_residual", not has_tensor(meta, "blk.0.ffn_norm.weight"))
    return {
        "use_qkv_bias": has_tensor(meta, "blk.0.attn_q.bias"),
        "qk_layernorm": has_tensor(meta, "blk.0.attn_q_norm.weight"),
        "use_parallel_residual": bool(parallel),
    }


MIXTRAL = Architecture("MixtralForCausalLM", "mixtral", "silu", extras=expert_extras)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaForCausalLM", "llama", "silu", extras=llama_extras, with_experts=MIXTRAL),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", "silu"),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", "silu", extras=attention_bias_extras),
    "qwen3moe": Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "silu", extras=qwen3moe_extras),
    "gemma": Architecture("GemmaForCausalLM", "gemma", "gelu_pytorch_tanh", extras=gemma_extras),
    "gemma2": Architecture("Gemma2ForCausalLM", "gemma2", "gelu_pytorch_tanh", extras=gemma2_extras),
    "gemma3": Architecture("Gemma3ForCausalLM", "gemma3_text", "gelu_pytorch_tanh", extras=gemma3_extras),
    "phi3": Architecture("Phi3ForCausalLM", "phi3", "silu", extras=phi3_extras),
    "phi2": Architecture("PhiForCausalLM", "phi", "gelu_new", layer_norm=True, extras=phi2_extras),
    "stablelm": Architecture("StableLmForCausalLM", "stablelm", "silu", layer_norm=True, extras=stablelm_extras),
    "glm4": Architecture("Glm4ForCausalLM", "glm4", "silu", extras=attention_bias_extras),
    "deepseek2": Architecture("DeepseekV2ForCausalLM", "deepseek_v2", "silu", extras=deepseek2_extras),
}
