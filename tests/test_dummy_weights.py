"""`--load-format dummy`: random weights in the shapes of a config.json.

The tensors listed for each architecture are those transformers saves for the same config; tiny
dummy models run on the numpy backend with finite, spread logits; the seed fixes the weights;
quantized dummy weights reach a backend that keeps their format as QuantizedTensor; Llama-3-8B's
config is counted without drawing a weight; bad flags are refused in one line before anything starts.
"""

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.conformance.model_cases import MODEL_CASES, ModelCase, make_reference
from candelabra.core import cli
from candelabra.core.contract.weights import QuantizedTensor, WeightRole
from candelabra.core.llm import LLM
from candelabra.core.loading import dummy as dummy_module
from candelabra.core.loading.dummy import STD, DummyCheckpoint
from candelabra.core.loading.model import load_model
from candelabra.core.models.config import ModelConfig
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights import CheckpointError
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from candelabra.plugins import installed_plugins
from quantized_backends import QuantizedCpuBackend, RecordingCpuBackend
from support import prefill_and_decode

LLAMA_3_8B = Path(__file__).resolve().parent.parent / "bench" / "configs" / "llama-3-8b"

# Beside the conformance cases, the config switches that add or remove tensors.
SWITCH_CASES = [
    ModelCase("llama-biases", "LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    ModelCase("llama-tied", "LlamaConfig", {"tie_word_embeddings": True}),
    ModelCase("qwen3-attention-bias", "Qwen3Config", {"head_dim": 32, "attention_bias": True}),
    ModelCase("glm4-without-bias", "Glm4Config", {"head_dim": 16, "attention_bias": False}),
    ModelCase("gemma-untied", "GemmaConfig", {"head_dim": 16, "tie_word_embeddings": False}),
]
CASES = MODEL_CASES + SWITCH_CASES

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case's folder, as transformers saves a tiny random model of it."""
    folders = {}
    for case in CASES:
        folder = tmp_path_factory.mktemp(case.name)
        make_reference(case, seed=0).save_pretrained(folder)
        folders[case.name] = folder
    return folders


def write_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA | changes))
    return folder


def shapes(checkpoint) -> dict[str, tuple[int, ...]]:
    return {name: tuple(checkpoint.tensor_shape(name)) for name in checkpoint.tensor_names()}


# ---------------------------------------------------------------------------------------------
# Names and shapes


def test_the_cases_cover_every_architecture_candelabra_supports(saved):
    in_tree = {r.name for r in installed_plugins().model_architectures.registrations()
               if r.value.__module__.startswith("candelabra.core.models.")}
    covered = {json.loads((folder / "config.json").read_text())["architectures"][0] for folder in saved.values()}
    assert in_tree and in_tree <= covered, f"no shape case for {sorted(in_tree - covered)}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_dummy_lists_exactly_the_tensors_transformers_saves(saved, case):
    with SafetensorsCheckpoint(saved[case.name]) as real:
        expected = shapes(real)
    assert shapes(DummyCheckpoint(saved[case.name])) == expected


# ---------------------------------------------------------------------------------------------
# Tiny dummy models run


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_a_tiny_dummy_model_of_every_architecture_gives_finite_spread_logits(saved, case):
    checkpoint = DummyCheckpoint(saved[case.name], seed=3)
    model = load_model(checkpoint, CpuBackend(), "float32")
    prompt = np.random.default_rng(3).integers(3, model.config.vocab_size, 9)
    logits, tokens = prefill_and_decode(model, prompt, steps=3)
    assert np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 1e-3  # not flat: the random weights reach the output
    assert all(0 <= token < model.config.vocab_size for token in tokens)


def test_llm_serves_a_config_alone_through_the_stand_in_tokenizer(tmp_path, monkeypatch, tiny_llm):
    monkeypatch.setenv("CANDELABRA_CACHE", str(tmp_path / "cache"))
    folder = write_config(tmp_path / "tiny")
    llm = tiny_llm(folder=folder, load_format="dummy")
    assert isinstance(llm.checkpoint, DummyCheckpoint)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    text, ids = llm.generate(["héllo, world", [5, 6, 7]], params, progress=False)
    for output in (text, ids):
        completion = output.outputs[0]
        assert len(completion.token_ids) == 4 and all(0 <= t < 300 for t in completion.token_ids)
        assert all(np.isfinite(entry.logprob) for entry in completion.logprobs)
    tokenizer = llm.tokenizer
    encoded = tokenizer.encode("héllo, world")
    assert encoded[0] == 1 and len(encoded) == 1 + len("héllo, world".encode())  # BOS, then one per byte
    assert tokenizer.decode(encoded) == "héllo, world"
    assert tokenizer.decode([299, 2], skip_special_tokens=False) == "<299><|eos|>"
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, ignore_eos=True)).outputs


def test_the_folders_own_tokenizer_wins_over_the_stand_in(tmp_path):
    folder = write_config(tmp_path)
    assert DummyCheckpoint(folder).tokenizer_files()["pretrained_model_name_or_path"] != str(folder)
    (folder / "tokenizer.json").write_text("{}")
    assert DummyCheckpoint(folder).tokenizer_files() == {"pretrained_model_name_or_path": str(folder)}


def test_a_vocabulary_too_small_for_bytes_asks_for_tokenizer_files(tmp_path):
    checkpoint = DummyCheckpoint(write_config(tmp_path, vocab_size=200))
    with pytest.raises(CheckpointError, match="too small for the byte-level stand-in.*tokenizer.json"):
        checkpoint.tokenizer_files()


# ---------------------------------------------------------------------------------------------
# Values


def test_the_seed_fixes_every_tensor_and_names_draw_apart(tmp_path):
    folder = write_config(tmp_path)
    first, again, other = DummyCheckpoint(folder), DummyCheckpoint(folder, seed=0), DummyCheckpoint(folder, seed=1)
    for name in first.tensor_names():
        values = first.load(name)
        assert values.dtype == np.float32 and values.shape == first.tensor_shape(name)
        assert np.array_equal(values, first.load(name)) and np.array_equal(values, again.load(name))
        assert not np.array_equal(values, other.load(name))
    q, k = (first.load(f"model.layers.0.self_attn.{n}_proj.weight") for n in "qk")
    assert not np.array_equal(q[: k.shape[0]], k)


def test_values_are_sized_like_a_trained_models(tmp_path):
    llama = DummyCheckpoint(write_config(tmp_path / "llama", vocab_size=20000))  # embedding: two draw chunks
    embedding = llama.load("model.embed_tokens.weight")
    assert embedding.size > dummy_module.CHUNK
    assert abs(embedding.std() - STD) < 0.001 and abs(embedding.mean()) < 0.001
    first, second = embedding.reshape(-1)[: dummy_module.CHUNK], embedding.reshape(-1)[dummy_module.CHUNK :]
    assert not np.array_equal(first[: second.size], second)  # the chunks are drawn apart
    norm = llama.load("model.layers.1.input_layernorm.weight")
    assert abs(norm.mean() - 1) < 0.01 and 0 < norm.std() < 0.05

    gemma = DummyCheckpoint(write_config(tmp_path / "gemma", architectures=["GemmaForCausalLM"], head_dim=16))
    assert abs(gemma.load("model.norm.weight").mean()) < 0.01  # Gemma multiplies by 1 + w

    phi = DummyCheckpoint(write_config(tmp_path / "phi", architectures=["PhiForCausalLM"]))
    bias = phi.load("model.layers.0.mlp.fc1.bias")
    assert abs(bias.mean()) < 0.01 and bias.std() < 0.05


def test_the_values_do_not_depend_on_how_many_threads_draw_them(tmp_path, monkeypatch):
    checkpoint = DummyCheckpoint(write_config(tmp_path, vocab_size=40000))
    many = checkpoint.load("model.embed_tokens.weight")
    monkeypatch.setattr(dummy_module.os, "cpu_count", lambda: 1)
    assert np.array_equal(many, checkpoint.load("model.embed_tokens.weight"))


# ---------------------------------------------------------------------------------------------
# Quantized dummy weights

QUANTIZABLE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("format", ["Q4_K", "Q8_0", "INT4_G128"])
def test_quantized_dummy_weights_reach_a_backend_that_keeps_the_format_quantized(tmp_path, format):
    checkpoint = DummyCheckpoint(write_config(tmp_path, **QUANTIZABLE), quantization=format.lower())
    backend = QuantizedCpuBackend()
    model = load_model(checkpoint, backend, "float32")
    roles = {role for _, role in backend.uploads}
    assert {WeightRole.LINEAR, WeightRole.LM_HEAD, WeightRole.EMBEDDING, WeightRole.NORM} <= roles
    for (name, role), weight in backend.uploads.items():
        if role in (WeightRole.LINEAR, WeightRole.LM_HEAD):
            assert isinstance(weight, QuantizedTensor) and weight.format == format, name
        else:
            assert not isinstance(weight, QuantizedTensor), name
    logits, _ = prefill_and_decode(model, np.arange(3, 10), steps=2)
    assert np.isfinite(logits).all() and logits.std(axis=-1).min() > 1e-3

    name = "model.layers.1.mlp.down_proj.weight"
    quantized = checkpoint.load_quantized(name)
    assert quantized.shape == (256, 512) and checkpoint.quantized_format(name) == format
    assert np.array_equal(checkpoint.load(name), quantized.dequantize())  # load is the same weight, dense
    assert abs(np.sqrt(np.mean(np.square(quantized.dequantize(), dtype=np.float64))) - STD) < 0.002
    assert np.array_equal(quantized.blocks, checkpoint.load_quantized(name).blocks)


def test_a_backend_that_keeps_no_format_gets_the_quantized_dummy_weights_dense(tmp_path):
    checkpoint = DummyCheckpoint(write_config(tmp_path, **QUANTIZABLE), quantization="Q4_K")
    backend = RecordingCpuBackend()
    load_model(checkpoint, backend, "float32")
    assert not any(isinstance(weight, QuantizedTensor) for weight in backend.uploads.values())


def test_widths_that_are_not_whole_blocks_stay_dense(tmp_path):
    checkpoint = DummyCheckpoint(write_config(tmp_path), quantization="Q4_K")  # hidden 64 < 256 per block
    assert all(checkpoint.quantized_format(name) is None for name in checkpoint.tensor_names())
    with pytest.raises(ValueError, match="not stored quantized"):
        checkpoint.load_quantized("lm_head.weight")


# ---------------------------------------------------------------------------------------------
# Llama-3-8B, counted and never drawn


def test_the_llama_3_8b_config_parses_as_published():
    config = ModelConfig.from_hf(json.loads((LLAMA_3_8B / "config.json").read_text()))
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (
        "LlamaForCausalLM", 4096, 32, 32, 8, 128, 14336, 128256)
    assert (config.rope.theta, config.max_position_embeddings, config.norm_eps) == (500000.0, 8192, 1e-5)
    assert (config.bos_token_id, config.eos_token_ids, config.tie_word_embeddings) == (128000, (128001,), False)
    assert config.raw["torch_dtype"] == "bfloat16"


def test_the_llama_3_8b_dummy_counts_its_parameters_without_drawing_them():
    tracemalloc.start()
    try:
        checkpoint = DummyCheckpoint(LLAMA_3_8B, quantization="Q4_K")
        count = checkpoint.parameter_count()
        names = checkpoint.tensor_names()
        formats = {name: checkpoint.quantized_format(name) for name in names}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 8_030_261_248  # 8.03e9, Meta's published size
    assert len(names) == 2 + 32 * 9 + 1
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB allocated: weights were drawn"
    assert formats["model.embed_tokens.weight"] is None and formats["model.norm.weight"] is None
    assert formats["lm_head.weight"] == "Q4_K" and formats["model.layers.31.mlp.down_proj.weight"] == "Q4_K"


# ---------------------------------------------------------------------------------------------
# Flags


def serve(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["serve", "--backend", "cpu", "--port", "0", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, code, message", [
    (["--load-format", "bogus"], 2, "error: --load-format bogus is unknown; choose one of auto, dummy"),
    (["--load-format", "dummy", "--dummy-quantization", "Q9_9"], 2,
     "error: --dummy-quantization Q9_9 is not a quantized GGUF format or grouped int4 (GPTQ's, AWQ's); "
     "choose one of Q8_0"),
    (["--dummy-quantization", "Q4_K"], 2, "error: --dummy-quantization Q4_K applies to --load-format dummy only"),
    (["--load-format", "dummy"], 1, "error: --load-format dummy: needs a config.json to shape the weights"),
])
def test_bad_flag_combinations_are_refused_in_one_line(capsys, argv, code, message):
    returned, err = serve(capsys, *argv)
    assert returned == code and err.count("error:") == 1 and err.strip().splitlines()[-1].startswith(message)


def test_dummy_with_a_folder_without_config_json_starts_nothing(capsys, tmp_path):
    returned, err = serve(capsys, "--load-format", "dummy", "--weight-path", str(tmp_path))
    assert returned == 1 and err.count("error:") == 1
    assert f"error: {tmp_path}: holds no config.json; --load-format dummy" in err.strip().splitlines()[-1]
    assert "serving" not in err and "loading weights" not in err


def test_a_file_that_is_not_a_config_json_is_refused(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="model.gguf: is not a config.json; --load-format dummy"):
        DummyCheckpoint(model)
    assert DummyCheckpoint(write_config(tmp_path / "named") / "config.json").path == tmp_path / "named"


def test_an_unknown_architecture_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="no model architecture named 'NoSuchForCausalLM'") as error:
        DummyCheckpoint(write_config(tmp_path, architectures=["NoSuchForCausalLM"]))
    assert "\n" not in str(error.value)


def test_llm_refuses_an_unknown_load_format():
    with pytest.raises(ValueError, match="--load-format safetensors is unknown"):
        LLM("anything", backend="cpu", load_format="safetensors")
