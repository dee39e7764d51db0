"""Tiny random models of every architecture, written as GGUF the way llama.cpp's converter
writes them: gguf's own Hugging Face -> GGUF tensor names, the converter's q/k permutation
(llama, and Mixtral, which GGUF files call llama) and norm shift (Gemma), a MoE layer's experts
stacked into one 3-D tensor per projection, DeepSeek's kv_b_proj whole or split in two as its
converters of each period wrote it, its metadata keys, 2-D weights and experts in a chosen GGML
type (a router stays float32, as llama.cpp's quantizer leaves it).

The GGUF loader's tests and the GGUF model conformance cases both build on this.
"""

from __future__ import annotations

import copy
import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize


def write_gguf(path, arch, metadata, tensors):
    """A GGUF file with `metadata` {key: value} and `tensors` {name: float array, or (raw bytes,
    GGML type) for data already quantized}."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def encoded(array, ggml_type):
    """`array` as the writer takes it in `ggml_type`."""
    data = quantize(array.astype(np.float32), ggml_type)
    return data if ggml_type in (Q.F32, Q.F16) else (data, ggml_type)


def round_tripped(array, ggml_type):
    """What a reader should return for `array` stored as `ggml_type`."""
    data = quantize(array.astype(np.float32), ggml_type)
    return dequantize(data, ggml_type).astype(np.float32).reshape(array.shape)


COMMON = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


RMS = {"rms_norm_eps": 1e-6}


LAYER_NORM = {"layer_norm_eps": 1e-5}
# Llama 3 rope scaling squeezed into 8 frequencies, two of them between the thresholds.


# Llama 3 rope scaling squeezed into 8 frequencies, two of them between the thresholds.


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 256,
}


PHI3_LONGROPE = {"rope_type": "longrope", "long_factor": [1.0, 1.5, 2.0, 4.0], "short_factor": [1.0, 1.1, 1.2, 1.3]}


DEEPSEEK = {"num_key_value_heads": 4, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "moe_intermediate_size": 32, "first_k_dense_replace": 1, "tie_word_embeddings": False, **RMS}


# GGUF architecture -> transformers config for a tiny random model of it.


CASES = {
    "llama": {"model_type": "llama", "head_dim": 16, "tie_word_embeddings": False, "attention_bias": True, **RMS,
              "rope_theta": 10000.0, "rope_scaling": LLAMA3_SCALING},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1e6, **RMS},
    "qwen3": {"model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True, **RMS},
    "gemma": {"model_type": "gemma", "head_dim": 32, "num_key_value_heads": 1, **RMS},
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 40.0, "final_logit_softcapping": 20.0, **RMS},
    "gemma3": {"model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 4,
               "query_pre_attn_scalar": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4, **RMS},
    "phi3": {"model_type": "phi3", "tie_word_embeddings": False, "partial_rotary_factor": 0.5,
             "rope_scaling": PHI3_LONGROPE, "original_max_position_embeddings": 64, **RMS},
    "phi2": {"model_type": "phi", "num_key_value_heads": 4, "partial_rotary_factor": 0.5, **LAYER_NORM},
    "stablelm": {"model_type": "stablelm", "qk_layernorm": True, "use_qkv_bias": True,
                 "use_parallel_residual": False, "partial_rotary_factor": 0.25, **LAYER_NORM},
    "glm4": {"model_type": "glm4", "head_dim": 16, "attention_bias": True, "partial_rotary_factor": 0.5, **RMS},
    # 4 experts, 2 a token; every Qwen3-MoE layer sparse and renormalizing, as llama.cpp runs it.
    "mixtral": {"model_type": "mixtral", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": False, "rope_theta": 1e6, **RMS},
    "qwen3moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 64, "norm_topk_prob": True, "tie_word_embeddings": True, **RMS},
    # DeepSeek-V2-Lite's shape (no query bottleneck, yarn with its mscale) and V3's (a query bottleneck,
    # sigmoid scores with a correction bias, 2 of 4 groups, renormalized): 8 experts, 2 a token, one
    # shared expert, a dense first layer; every width a multiple of 32, so Q8_0 and Q4_0 blocks fit.
    "deepseek-v2": {"model_type": "deepseek_v2", **DEEPSEEK, "q_lora_rank": None, "routed_scaling_factor": 1.5,
                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "mscale": 0.707, "mscale_all_dim": 0.707}},
    "deepseek-v3": {"model_type": "deepseek_v3", **DEEPSEEK, "q_lora_rank": 32, "n_group": 4, "topk_group": 2,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5},
}

# The standard deviation of a tiny model's random weights: 0.3, but 0.15 for the MoE cases (as the
# models level's own MoE cases draw them). At 0.3 bfloat16's rounding flipped near-ties between two
# experts often enough to fail the models level in bfloat16 (logits NMSE up to 1.8e-2 over 6 seeds on
# the torch backend); at 0.15 the worst was 6.1e-4.
WEIGHT_SCALE = {"mixtral": 0.15, "qwen3moe": 0.15, "deepseek-v2": 0.15, "deepseek-v3": 0.15}

# The GGUF architecture of a case named otherwise: llama.cpp calls Mixtral llama, DeepSeek V2 and V3 deepseek2.
GGUF_ARCHITECTURE = {"mixtral": "llama", "deepseek-v2": "deepseek2", "deepseek-v3": "deepseek2"}
# Where the Hub's checkpoints keep a MoE family's experts, one tensor each: (block, gate, up, down).
HUB_EXPERTS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
               "qwen3moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
               "deepseek-v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
               "deepseek-v3": ("mlp", "gate_proj", "up_proj", "down_proj")}
# The DeepSeek cases written as llama.cpp's converters have since April 2025: kv_b_proj split into
# attn_k_b and attn_v_b, the latent's widths as key_length and value_length and a head's as
# key_length_mla and value_length_mla, one KV head, the gating function and expert groups. The
# others as converters wrote them before: kv_b_proj whole, a head's widths as key_length and
# value_length, and (as before DeepSeek-V3) no gating function, which means V2's softmax.
SPLIT_KV_B = {"deepseek-v3"}


HF_CLASSES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "phi2": "PhiForCausalLM", "stablelm": "StableLmForCausalLM",
    "glm4": "Glm4ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek-v2": "DeepseekV2ForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM",
}  # fmt: skip


def tiny_model(arch, seed: int = 0):
    """A random transformers model for `arch` in float32, every parameter (norms too) random and
    a bfloat16 value, as real checkpoints' are (so Gemma's norm + 1 - 1 is exact); DeepSeek-V3's
    correction bias random too (transformers makes it zeros)."""
    import torch
    import transformers

    settings = copy.deepcopy({**COMMON, **CASES[arch]})  # transformers edits the rope dicts it is given
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter).mul(WEIGHT_SCALE.get(arch, 0.3)).bfloat16().float())
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    return model


def settings_of(arch):
    return {**COMMON, **CASES[arch]}


def gguf_architecture(arch):
    return GGUF_ARCHITECTURE.get(arch, arch)


def hub_state_dict(model, arch):
    """`model`'s tensors as float32 numpy arrays under the names the Hub's checkpoints (and a GGUF
    checkpoint) give them: transformers 5's fused experts, [E, 2I, H] gate then up and [E, H, I], split
    into one tensor per expert and projection."""
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    if arch not in HUB_EXPERTS:
        return state
    block, gate, up, down = HUB_EXPERTS[arch]
    hub = {}
    for name, tensor in state.items():
        layer = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.(?:gate_up|down)_proj)", name)
        if layer is None:
            hub[name] = tensor
            continue
        prefix, part = f"model.layers.{layer.group(1)}.{block}", layer.group(2)
        if part == "gate.weight":  # the router
            hub[f"{prefix}.gate.weight"] = tensor
        elif part == "experts.down_proj":
            hub.update({f"{prefix}.experts.{e}.{down}.weight": expert for e, expert in enumerate(tensor)})
        else:
            for e, expert in enumerate(tensor):
                hub[f"{prefix}.experts.{e}.{gate}.weight"], hub[f"{prefix}.experts.{e}.{up}.weight"] = \
                    np.split(expert, 2)
    return hub


def transformers_state_dict(tensors, arch):
    """`hub_state_dict`'s inverse: Hub-named tensors as transformers 5's modules take them."""
    if arch not in HUB_EXPERTS:
        return dict(tensors)
    block, gate, up, down = HUB_EXPERTS[arch]
    state, experts = {}, {}
    for name, tensor in tensors.items():
        found = re.fullmatch(rf"model\.layers\.(\d+)\.{block}\.(gate\.weight|experts\.(\d+)\.(\w+)\.weight)", name)
        if found is None:
            state[name] = tensor
        elif found.group(3) is None:
            state[f"model.layers.{found.group(1)}.mlp.gate.weight"] = tensor
        else:
            experts.setdefault(int(found.group(1)), {})[int(found.group(3)), found.group(4)] = tensor
    for layer, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        prefix = f"model.layers.{layer}.mlp.experts"
        state[f"{prefix}.gate_up_proj"] = np.stack([np.concatenate([parts[e, gate], parts[e, up]])
                                                    for e in range(count)])
        state[f"{prefix}.down_proj"] = np.stack([parts[e, down] for e in range(count)])
    return state


def split_kv_b(weights, arch):
    """DeepseekV2Model.modify_tensors in llama.cpp's convert_hf_to_gguf.py: kv_b_proj, [heads * (nope +
    v_head), kv_lora_rank], as attn_k_b, each head's key rows transposed, [heads, kv_lora_rank, nope],
    and attn_v_b, each head's value rows, [heads, v_head, kv_lora_rank]."""
    s = settings_of(arch)
    per_head = weights.reshape(s["num_key_value_heads"], s["qk_nope_head_dim"] + s["v_head_dim"], -1)
    key, value = np.split(per_head, [s["qk_nope_head_dim"]], axis=1)
    return np.ascontiguousarray(key.transpose(0, 2, 1)), np.ascontiguousarray(value)


def stored_parameter(name, array, ggml_type, arch):
    """What a reader should return for the transformers parameter `name` of an `arch` model written as
    `ggml_type`: the parameter through the quantizer, or for a split kv_b_proj its two halves each
    through it, put back together."""
    if arch not in SPLIT_KV_B or not name.endswith("kv_b_proj.weight"):
        return round_tripped(array, ggml_type)
    key, value = (round_tripped(half, ggml_type) for half in split_kv_b(array, arch))
    return np.concatenate([key.transpose(0, 2, 1), value], axis=1).reshape(array.shape)


def quantized_by_converter(name, ndim):
    """Whether llama.cpp stores the Hugging Face parameter `name` in a file's chosen type: every 2-D
    weight and 3-D experts, but not a MoE router, which its quantizer leaves float32."""
    return ndim >= 2 and not name.endswith(".gate.weight")


def head_dim_of(arch):
    """A head's width as config.json says it: DeepSeek's rotary part's, as transformers sets it."""
    settings = settings_of(arch)
    default = settings["hidden_size"] // settings["num_attention_heads"]
    return settings.get("head_dim", settings.get("qk_rope_head_dim", default))


def gguf_metadata(arch):
    """The hyperparameters llama.cpp's converter writes for this architecture."""
    s, a = settings_of(arch), gguf_architecture(arch)
    metadata = {
        f"{a}.context_length": s["max_position_embeddings"],
        f"{a}.embedding_length": s["hidden_size"],
        f"{a}.block_count": s["num_hidden_layers"],
        f"{a}.feed_forward_length": s["intermediate_size"],
        f"{a}.attention.head_count": s["num_attention_heads"],
        f"{a}.attention.head_count_kv": s["num_key_value_heads"],
        f"{a}.rope.freq_base": float(s.get("rope_theta", 10000.0)),
        "tokenizer.ggml.bos_token_id": s["bos_token_id"],
        "tokenizer.ggml.eos_token_id": s["eos_token_id"],
        "tokenizer.ggml.padding_token_id": s["pad_token_id"],
    }
    if "rms_norm_eps" in s:
        metadata[f"{a}.attention.layer_norm_rms_epsilon"] = s["rms_norm_eps"]
    else:
        metadata[f"{a}.attention.layer_norm_epsilon"] = s["layer_norm_eps"]
    if "head_dim" in s:
        metadata[f"{a}.attention.key_length"] = metadata[f"{a}.attention.value_length"] = s["head_dim"]
    if a in ("llama", "phi3", "phi2", "stablelm", "glm4"):
        metadata[f"{a}.rope.dimension_count"] = int(head_dim_of(arch) * s.get("partial_rotary_factor", 1.0))
    if arch in HUB_EXPERTS:
        metadata[f"{a}.expert_count"] = s.get("num_local_experts") or s.get("num_experts") or s["n_routed_experts"]
        metadata[f"{a}.expert_used_count"] = s["num_experts_per_tok"]
    if "moe_intermediate_size" in s:
        metadata[f"{a}.expert_feed_forward_length"] = s["moe_intermediate_size"]
    if "sliding_window" in s:
        metadata[f"{a}.attention.sliding_window"] = s["sliding_window"]
    if arch == "gemma2":
        metadata[f"{a}.attn_logit_softcapping"] = s["attn_logit_softcapping"]
        metadata[f"{a}.final_logit_softcapping"] = s["final_logit_softcapping"]
    if arch == "phi3":
        metadata[f"{a}.rope.scaling.original_context_length"] = s["original_max_position_embeddings"]
    if arch == "stablelm":
        metadata[f"{a}.use_parallel_residual"] = s["use_parallel_residual"]
    if a == "deepseek2":
        metadata.update(deepseek_metadata(arch))
    return metadata


def deepseek_metadata(arch):
    """DeepseekV2Model.set_gguf_parameters in llama.cpp's convert_hf_to_gguf.py, of the period `arch`
    is written as (see SPLIT_KV_B)."""
    s, a = settings_of(arch), gguf_architecture(arch)
    rank, rope, nope = s["kv_lora_rank"], s["qk_rope_head_dim"], s["qk_nope_head_dim"]
    metadata = {
        f"{a}.leading_dense_block_count": s["first_k_dense_replace"],
        f"{a}.attention.kv_lora_rank": rank,
        f"{a}.rope.dimension_count": rope,
        f"{a}.expert_shared_count": s["n_shared_experts"],
        f"{a}.expert_weights_scale": s["routed_scaling_factor"],
    }
    if s["q_lora_rank"]:
        metadata[f"{a}.attention.q_lora_rank"] = s["q_lora_rank"]
    if arch in SPLIT_KV_B:
        metadata.update({
            f"{a}.attention.head_count_kv": 1,
            f"{a}.attention.key_length": rank + rope,
            f"{a}.attention.value_length": rank,
            f"{a}.attention.key_length_mla": nope + rope,
            f"{a}.attention.value_length_mla": s["v_head_dim"],
            f"{a}.expert_gating_func": 2 if s["model_type"] == "deepseek_v3" else 1,  # sigmoid, softmax
            f"{a}.expert_group_count": s.get("n_group") or 1,
            f"{a}.expert_group_used_count": s.get("topk_group") or 1,
        })
        if s.get("norm_topk_prob"):
            metadata[f"{a}.expert_weights_norm"] = True
    else:
        metadata.update({f"{a}.attention.key_length": nope + rope, f"{a}.attention.value_length": s["v_head_dim"],
                         f"{a}.expert_weights_norm": bool(s.get("norm_topk_prob"))})
    if scaling := s.get("rope_scaling"):
        metadata.update({
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": scaling["factor"],
            f"{a}.rope.scaling.original_context_length": scaling["original_max_position_embeddings"],
            f"{a}.rope.scaling.yarn_log_multiplier": 0.1 * scaling["mscale_all_dim"],
        })
    return metadata


def permute_like_llama_cpp(weights, n_heads):
    """LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py, for q_proj/k_proj rows."""
    rows = weights.shape[0]
    permuted = weights.reshape(n_heads, 2, rows // n_heads // 2, *weights.shape[1:]).swapaxes(1, 2)
    return permuted.reshape(weights.shape)


def llama3_rope_factors(arch):
    """The rope_freqs.weight llama.cpp's converter writes for Llama 3 rope scaling."""
    s = settings_of(arch)
    scaling, dim = s["rope_scaling"], head_dim_of(arch)
    factors = []
    for freq in 1.0 / (s["rope_theta"] ** (np.arange(0, dim, 2) / dim)):
        wavelength = 2 * np.pi / freq
        original = scaling["original_max_position_embeddings"]
        if wavelength < original / scaling["high_freq_factor"]:
            factors.append(1.0)
        elif wavelength > original / scaling["low_freq_factor"]:
            factors.append(scaling["factor"])
        else:
            smooth = (original / wavelength - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def convert_to_gguf(model, arch, path, ggml_type=Q.F32, fuse_qkv=False, metadata=None, others=None):
    """`model` written as llama.cpp's converter writes it: tensors named by gguf's own table,
    q/k rows permuted (llama and Mixtral), norms + 1 (Gemma), StableLM's per-head norms stacked,
    experts as 3-D [experts, rows, columns] gate, up and down tensors, DeepSeek's kv_b_proj split
    where SPLIT_KV_B says; 2-D and 3-D weights stored as `ggml_type`, routers float32; with
    `fuse_qkv`, q/k/v fused into attn_qkv. `metadata` adds to (or overrides) the hyperparameters,
    e.g. a tokenizer's keys. `others` stores the weights of some projections in other types, by
    transformers' projection name ({"v_proj": Q.Q8_0})."""
    s, gguf_arch = settings_of(arch), gguf_architecture(arch)
    arch_enum = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}[gguf_arch]
    name_map = gguf.get_tensor_name_map(arch_enum, s["num_hidden_layers"])
    tensors, stacked_norms, types = {}, {}, {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        if hf_name.endswith("e_score_correction_bias"):  # the converter renames it so
            hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        module, suffix = hf_name.rsplit(".", 1)
        if ".norms." in module:
            stacked, head = module.rsplit(".norms.", 1)
            stacked_norms.setdefault(stacked, {})[int(head)] = data
            continue
        experts = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", hf_name)
        if experts is not None:
            tensors.update(stacked_experts(int(experts.group(1)), experts.group(2), data))
            continue
        if gguf_arch == "llama" and module.endswith("q_proj"):
            data = permute_like_llama_cpp(data, s["num_attention_heads"])
        if gguf_arch == "llama" and module.endswith("k_proj"):
            data = permute_like_llama_cpp(data, s["num_key_value_heads"])
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1
        if arch in SPLIT_KV_B and module.endswith("kv_b_proj"):
            for half, part in zip(("k_b_proj", "v_b_proj"), split_kv_b(data, arch)):
                tensors[f"{name_map.get_name(module.replace('kv_b_proj', half))}.{suffix}"] = part
            continue
        gguf_name = name_map.get_name(module)
        assert gguf_name is not None, f"gguf has no GGUF name for {module}"
        tensors[f"{gguf_name}.{suffix}"] = data
        types[f"{gguf_name}.{suffix}"] = (others or {}).get(module.rsplit(".", 1)[-1], ggml_type)
    for module, heads in stacked_norms.items():
        tensors[f"{name_map.get_name(module)}.weight"] = np.stack([heads[head] for head in sorted(heads)])
    if fuse_qkv:
        for layer in range(s["num_hidden_layers"]):
            for suffix in ("weight", "bias"):
                parts = [tensors.pop(f"blk.{layer}.attn_{x}.{suffix}", None) for x in "qkv"]
                if parts[0] is not None:
                    tensors[f"blk.{layer}.attn_qkv.{suffix}"] = np.concatenate(parts)
    if arch == "llama":
        tensors["rope_freqs.weight"] = llama3_rope_factors(arch)
    if arch == "phi3":
        tensors["rope_factors_long.weight"] = np.array(s["rope_scaling"]["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(s["rope_scaling"]["short_factor"], dtype=np.float32)
    stored = {
        name: encoded(data, types.get(name, ggml_type)) if data.ndim >= 2 and not name.startswith("rope_")
        and ROUTER not in name
        else data
        for name, data in tensors.items()
    }
    write_gguf(path, gguf_arch, gguf_metadata(arch) | (metadata or {}), stored)
    return tensors


ROUTER = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].removeprefix("blk.{bid}.")


def stacked_experts(layer, projection, data):
    """transformers 5's fused experts of one layer (gate_up_proj [E, 2I, H], gate rows first, or
    down_proj [E, H, I]) as the GGUF tensors llama.cpp's converter stacks them into."""
    def name(tensor):
        return f"{gguf.TENSOR_NAMES[tensor].format(bid=layer)}.weight"

    if projection == "down_proj":
        return {name(gguf.MODEL_TENSOR.FFN_DOWN_EXP): data}
    gate, up = (np.ascontiguousarray(half) for half in np.split(data, 2, axis=1))
    return {name(gguf.MODEL_TENSOR.FFN_GATE_EXP): gate, name(gguf.MODEL_TENSOR.FFN_UP_EXP): up}
