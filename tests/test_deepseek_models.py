"""DeepSeek V2 and V3: their routers and latent attention read from config.json, yarn's mscale where
DeepSeek puts it, the latent KV cache a model asks for, a tensor-parallel rank's share of the experts,
clear refusals (a backend without the latent attention ops, a kv_b_proj of the wrong size), and a tiny
DeepSeek-V3 served through `LLM` greedily as transformers generates. (Logits at every position against
transformers are the models level's "deepseek-v2" and "deepseek-v3" cases, and at TP=2 against TP=1 the
parallel level's.)"""

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from candelabra.backends.cpu import CpuBackend
from candelabra.backends.cpu.ops import NumpyOps
from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.conformance.model_cases import MODEL_CASES, config_json, make_reference
from candelabra.core.contract.ops import OpNotSupported, Ops
from candelabra.core.llm import LLM
from candelabra.core.loading.model import load_model
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.models.rope import attention_factor
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from support import LoadOnlyCommunicator

DEEPSEEK_V2, DEEPSEEK_V3 = (next(c for c in MODEL_CASES if c.name == name) for name in ("deepseek-v2", "deepseek-v3"))


class _OpsWithoutLatentAttention(NumpyOps):
    per_head_linear = Ops.per_head_linear
    paged_latent_attention = Ops.paged_latent_attention


class CpuWithoutLatentAttention(CpuBackend):
    name = "cpu-without-latent-attention"

    def __init__(self):
        super().__init__()
        self.ops = _OpsWithoutLatentAttention()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The DeepSeek-V3 case's folder with a word-level tokenizer, and its transformers model."""
    folder, model = tmp_path_factory.mktemp("deepseek-v3"), make_reference(DEEPSEEK_V3, seed=7)
    write_tiny_checkpoint(folder, seed=0)  # for its tokenizer; the model is replaced
    model.save_pretrained(folder)
    return folder, model


# ---------------------------------------------------------------------------------------------
# config.json


def test_deepseek_v3_routes_by_sigmoid_within_its_best_groups_and_scales_the_renormalized_weights():
    config = ModelConfig.from_hf(config_json(DEEPSEEK_V3) | {"num_hidden_layers": 4, "first_k_dense_replace": 2})
    moe = config.moe
    assert (moe.scoring, moe.group_scoring, moe.num_groups, moe.top_groups) == ("sigmoid", "top2_sum", 4, 2)
    assert moe.renormalize and moe.routed_scale == 2.5 and moe.shared_intermediate_size == 32
    assert [moe.is_sparse(layer) for layer in range(4)] == [False, False, True, True]
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim) == (24, 32, 24, 24)
    assert config.head_dim == 8  # the rotary part's width, which the rotary table and the cache use


def test_deepseek_v2_groups_only_with_group_limited_greedy_and_keeps_its_weights_unless_told():
    written = config_json(DEEPSEEK_V2)
    grouped = ModelConfig.from_hf(written).moe
    assert (grouped.scoring, grouped.group_scoring, grouped.num_groups, grouped.top_groups) == ("softmax", "max", 4, 2)
    assert not grouped.renormalize and grouped.routed_scale == 1.5
    greedy = ModelConfig.from_hf(written | {"topk_method": "greedy"}).moe
    assert (greedy.num_groups, greedy.top_groups) == (1, 1)
    # DeepSeek's own V2 code: a layer is sparse from first_k_dense_replace on, every moe_layer_freq-th
    every_other = ModelConfig.from_hf(written | {"num_hidden_layers": 5, "moe_layer_freq": 2}).moe
    assert [every_other.is_sparse(layer) for layer in range(5)] == [False, False, True, False, True]
    assert ModelConfig.from_hf(written).mla.q_lora_rank is None


def test_yarn_mscale_scales_the_softmax_and_the_rotary_table_as_transformers_does():
    import torch
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
            "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    settings = config_json(DEEPSEEK_V3) | {"rope_parameters": yarn, "max_position_embeddings": 2560}
    reference = transformers.DeepseekV3Config(**{k: v for k, v in settings.items() if k != "architectures"})
    config = ModelConfig.from_hf(settings)
    expected_scale = DeepseekV3Attention(reference, layer_idx=0).scaling
    assert config.attention_scale == pytest.approx(expected_scale, rel=1e-12)
    assert config.attention_scale != pytest.approx(config.mla.qk_head_dim**-0.5)  # mscale does apply
    with torch.no_grad():
        expected_factor = DeepseekV3RotaryEmbedding(reference).attention_scaling
    assert attention_factor(config.rope.scaling) == pytest.approx(expected_factor, rel=1e-12)
    assert expected_factor != pytest.approx(1.0)


def test_the_deep_seek_model_type_word_names_both_deepseek_versions_only():
    ModelConfig.from_hf(config_json(DEEPSEEK_V2)).check_model_type("deep-seek")
    ModelConfig.from_hf(config_json(DEEPSEEK_V3)).check_model_type("deep-seek")
    llama = next(c for c in MODEL_CASES if c.name == "llama")
    with pytest.raises(ConfigError, match="deep-seek"):
        ModelConfig.from_hf(config_json(llama)).check_model_type("deep-seek")


# ---------------------------------------------------------------------------------------------
# The latent cache


def test_the_model_asks_for_a_latent_cache_of_one_rotary_key_and_one_latent_per_token(saved):
    folder, _ = saved
    llm = LLM(folder, backend="cpu", kvcache_mem_gpu=1, kvcache_mem_cpu=0)
    try:
        spec = llm.engine.runner.kv_spec
        caches = llm.engine.runner.caches
    finally:
        llm.close()
    assert (spec.num_kv_heads, spec.head_dim, spec.value_dim) == (1, 8, 32)
    assert spec.bytes_per_token == 3 * (8 + 32) * 4  # float32, three layers
    assert caches[0].key.shape[2:] == (1, 8) and caches[0].value.shape[2:] == (1, 32)


# ---------------------------------------------------------------------------------------------
# Tensor parallelism


def test_a_rank_keeps_the_whole_router_half_the_routed_experts_and_half_the_shared_experts_features(saved):
    folder, _ = saved
    with SafetensorsCheckpoint(folder) as checkpoint:
        whole, second = (load_model(checkpoint, CpuBackend(), "float32", communicator=communicator)
                         for communicator in (None, LoadOnlyCommunicator(1, 2)))
    for layer, share in zip(whole.layers, second.layers):
        if layer.experts is None:  # the dense first layer
            continue
        experts, half = layer.experts, len(layer.experts.gate_up) // 2
        assert share.experts.first == half
        np.testing.assert_array_equal(share.experts.gate_up, experts.gate_up[half:])
        np.testing.assert_array_equal(share.experts.router, experts.router)
        np.testing.assert_array_equal(share.experts.correction_bias, experts.correction_bias)
        assert share.experts.shared_down.shape[1] * 2 == experts.shared_down.shape[1]


# ---------------------------------------------------------------------------------------------
# Refusals


def test_a_backend_without_the_latent_attention_ops_is_refused_naming_them_before_loading(saved):
    folder, _ = saved
    with pytest.raises(OpNotSupported) as refused:
        LLM(folder, backend=CpuWithoutLatentAttention, kvcache_mem_gpu=1, kvcache_mem_cpu=0)
    assert "per_head_linear" in str(refused.value) and "paged_latent_attention" in str(refused.value)


def test_a_kv_b_proj_that_does_not_fit_the_heads_is_refused_naming_it(saved, tmp_path):
    folder, _ = saved
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name][:-8])
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with SafetensorsCheckpoint(tmp_path) as checkpoint, pytest.raises(ConfigError) as refused:
        load_model(checkpoint, CpuBackend(), "float32")
    assert name in str(refused.value) and "[160, 32]" in str(refused.value)


# ---------------------------------------------------------------------------------------------
# Serving


def test_llm_serves_a_tiny_deepseek_v3_greedily_as_transformers_generates(saved):
    import torch

    folder, model = saved
    prompts = [[5, 17, 42, 8, 99, 23], [7, 3, 120, 64]]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(8):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            expected.append(tokens[len(prompt):])
    llm = LLM(folder, backend="torch", dtype="float32", kvcache_mem_gpu=1, kvcache_mem_cpu=0)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), progress=False)
    finally:
        llm.close()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected


# ---------------------------------------------------------------------------------------------
# bench/kv_cache_bytes.py


def test_the_latent_cache_holds_576_values_a_token_and_layer_at_deepseek_v2_lite_shapes():
    import importlib.util
    import json
    from pathlib import Path

    bench = Path(__file__).parent.parent / "bench"
    spec = importlib.util.spec_from_file_location("kv_cache_bytes", bench / "kv_cache_bytes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lite = ModelConfig.from_hf(json.loads((bench / "configs" / "deepseek-v2-lite" / "config.json").read_text()))
    kept, expanded = module.kv_bytes_per_token(lite, "bfloat16")
    assert kept == 27 * (512 + 64) * 2
    assert expanded == 27 * 16 * ((128 + 64) + 128) * 2
    llama = ModelConfig.from_hf(json.loads((bench / "configs" / "llama-3-8b" / "config.json").read_text()))
    assert module.kv_bytes_per_token(llama, "bfloat16") == (32 * 8 * 128 * 2 * 2, None)
