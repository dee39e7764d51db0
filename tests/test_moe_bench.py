"""bench/moe_vs_llama_cpp.py writes `--load-format dummy`'s weights as a qwen3moe GGUF file that both
servers load: candelabra reads back the very model the dummy checkpoint gives. (The benchmark gives the
file the default model's tokenizer; here a small one keeps the test quick.)"""

import importlib.util
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from candelabra.backends.cpu import CpuBackend
from candelabra.core.loading.dummy import DummyCheckpoint
from candelabra.core.loading.model import load_model
from candelabra.core.weights.gguf import GGUFCheckpoint
from live_server import byte_pair_tokenizer
from support import prefill_and_decode

SCRIPT = Path(__file__).parent.parent / "bench" / "moe_vs_llama_cpp.py"
TINY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}


def bench_module():
    spec = importlib.util.spec_from_file_location("moe_vs_llama_cpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_gguf_holds_the_dummy_weights(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    written = bench_module().write_dummy_gguf(config, tmp_path / "tiny.gguf", GGMLQuantizationType.F32,
                                              byte_pair_tokenizer(TINY["vocab_size"]))
    prompt = np.array([9, 280, 42, 7, 123])
    with GGUFCheckpoint(written) as gguf_checkpoint:
        assert gguf_checkpoint.config["architectures"] == ["Qwen3MoeForCausalLM"]
        from_gguf = prefill_and_decode(load_model(gguf_checkpoint, CpuBackend(), "float32"), prompt, steps=3)
    dummy = prefill_and_decode(load_model(DummyCheckpoint(config), CpuBackend(), "float32"), prompt, steps=3)
    np.testing.assert_allclose(from_gguf[0], dummy[0], rtol=1e-5, atol=1e-5)
    assert from_gguf[1] == dummy[1]
