"""In-situ quantization (`--isq`, `LLM(isq=...)`): which weights a dense checkpoint hands over in which
format, what it refuses, and the flags that ask for it. The models level checks the quantized model's
logits against transformers (conformance's ISQ_MODEL_CASES)."""

import json
import logging

import numpy as np
import pytest

from candelabra.core import cli
from candelabra.core.loading.dummy import DummyCheckpoint
from candelabra.core.loading.in_situ import InSituQuantized, isq_format
from candelabra.core.loading.quant_flag import parse_quant
from candelabra.core.weights.default_model import default_model_path
from candelabra.core.weights.gguf import GGUFCheckpoint
from support import one_line_checkpoint_error


def dense_folder(folder, hidden_size: int, intermediate_size: int = 128, tie_word_embeddings: bool = False):
    """A folder holding the config.json of a tiny two-layer Qwen2, for random dense weights."""
    config = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 211, "hidden_size": hidden_size,
              "intermediate_size": intermediate_size, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": tie_word_embeddings}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def formats_by_tensor(checkpoint, layer_names):
    return {name: checkpoint.quantized_format(f"model.layers.0.{name}.weight") for name in layer_names}


@pytest.mark.parametrize("spelling", ["q4k", "Q4_K", "q4_k"])
def test_isq_takes_candle_vllms_and_ggmls_names_of_a_format(spelling):
    assert isq_format(spelling) == "Q4_K"


def test_an_unknown_isq_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"--isq q7k is not a format .* q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k"):
        isq_format("q7k")


def test_weights_take_the_format_where_blocks_fit_else_q8_0_else_stay_dense(tmp_path):
    """in_features 256: Q4_K; the down projection's 272 are not whole blocks of 32: dense. The LM head
    (not tied) is quantized, the embedding table and the norms are not."""
    checkpoint = InSituQuantized(DummyCheckpoint(dense_folder(tmp_path, hidden_size=256, intermediate_size=272)),
                                 "q4k")
    assert formats_by_tensor(checkpoint, ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"]) \
        == {"self_attn.q_proj": "Q4_K", "self_attn.o_proj": "Q4_K", "mlp.up_proj": "Q4_K", "mlp.down_proj": None}
    assert checkpoint.quantized_format("lm_head.weight") == "Q4_K"
    assert checkpoint.quantized_format("model.embed_tokens.weight") is None
    assert checkpoint.quantized_format("model.layers.0.self_attn.q_proj.bias") is None
    assert "stay dense" in checkpoint.summary()


def test_a_tied_lm_head_quantizes_the_embedding_table_and_blocks_of_32_fall_back_to_q8_0(tmp_path):
    folder = dense_folder(tmp_path, hidden_size=96, intermediate_size=256, tie_word_embeddings=True)
    checkpoint = InSituQuantized(DummyCheckpoint(folder), "Q6_K")
    assert formats_by_tensor(checkpoint, ["self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"]) \
        == {"self_attn.k_proj": "Q8_0", "mlp.gate_proj": "Q8_0", "mlp.down_proj": "Q6_K"}
    assert checkpoint.quantized_format("model.embed_tokens.weight") == "Q8_0"


def test_a_quantized_weight_dequantizes_to_what_load_returns(tmp_path):
    """Backends that keep the format and backends that do not run the same weights."""
    checkpoint = InSituQuantized(DummyCheckpoint(dense_folder(tmp_path, hidden_size=256, intermediate_size=256)),
                                 "q3k")
    name = "model.layers.1.mlp.down_proj.weight"
    dense = checkpoint.dense.load(name)
    quantized = checkpoint.load_quantized(name)
    assert quantized.format == "Q3_K" and quantized.shape == dense.shape
    assert np.array_equal(checkpoint.load(name), quantized.dequantize())
    assert 0 < np.sqrt(np.mean((quantized.dequantize() - dense) ** 2) / np.mean(dense**2)) < 0.2


def test_a_checkpoint_quantized_already_is_refused(tmp_path):
    one_line_checkpoint_error(lambda: InSituQuantized(GGUFCheckpoint(default_model_path()), "q4k"),
                              "is quantized already (Q", "--isq q4_k quantizes a dense checkpoint")
    quantized_dummy = DummyCheckpoint(dense_folder(tmp_path, hidden_size=64), quantization="Q4_0")
    one_line_checkpoint_error(lambda: InSituQuantized(quantized_dummy, "q8_0"), "is quantized already (Q4_0)")


def test_the_llm_option_quantizes_at_load_and_says_what_it_made(tiny_llm, caplog):
    with caplog.at_level(logging.INFO, logger="candelabra"):
        llm = tiny_llm(3, isq="q5_0")
    assert "in-situ quantization to Q5_0: 15 in Q5_0" in caplog.text  # two layers of 7, and the LM head
    assert len(llm.generate([[5, 6, 7]], progress=False)[0].outputs[0].token_ids) > 0


def serve_args(*argv: str):
    return cli._parser(chosen="serve").parse_args(["serve", *argv])


@pytest.mark.parametrize(("flags", "format"), [
    (["--isq", "q6k"], "Q6_K"), (["--quant", "q4k"], "Q4_K"), (["--quant", "gguf", "--isq", "Q8_0"], "Q8_0"),
    (["--quant", "q4_1", "--isq", "Q4_1"], "Q4_1"), ([], None),
])
def test_quant_with_a_ggml_format_means_isq(flags, format):
    args = serve_args(*flags)
    assert parse_quant(args.quant, args.isq)[1] == format


@pytest.mark.parametrize(("flags", "problem"), [
    (["--quant", "q4k", "--isq", "q5k"], "--quant q4k and --isq q5k name different formats"),
    (["--quant", "int3"], "--quant int3 is not known; choose one of gptq, awq, marlin, gguf, or a format for in-situ"),
    (["--isq", "gguf"], "--isq gguf is not a format"),
])
def test_isq_flags_that_name_nothing_or_disagree_are_refused(flags, problem):
    args = serve_args(*flags)
    with pytest.raises(ValueError, match=problem):
        parse_quant(args.quant, args.isq)
