"""Weights reach a backend named, with their role, and still quantized where it keeps the format.

A GGUF file with K-quant linear weights (random blocks: Python cannot make K-quants) is loaded on
a backend that keeps every GGUF format and on one that keeps none. The first must get the
file's own blocks, in Hugging Face's row order, for the linear and LM-head roles only, and
compute what the second computes from float weights; conformance must count quantized `linear`
cases as not supported where no format is kept, and fail a kernel that gets one wrong. A MoE GGUF's
quantized experts reach a backend that keeps their format for the experts role as the file's blocks,
stacked, and any other backend dense.
"""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from candelabra.backends.cpu import CpuBackend
from candelabra.conformance import oracle
from candelabra.conformance.compare import MODEL_NMSE_THRESHOLDS, ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD, nmse
from candelabra.conformance.gguf_models import (
    convert_to_gguf,
    gguf_metadata,
    permute_like_llama_cpp,
    tiny_model,
    write_gguf,
)
from candelabra.conformance.harness import FAILED, NOT_SUPPORTED, PASSED, run_case
from candelabra.conformance.model_cases import GGUFModelCase, run_model_case
from candelabra.conformance.op_cases import op_cases
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.contract.weights import QUANTIZABLE_ROLES, QUANTIZED_FORMATS, QuantizedTensor, WeightRole
from candelabra.core.loading.model import load_model
from candelabra.core.weights.gguf import GGUFCheckpoint
from quantized_backends import (
    QuantizedCpuBackend,
    QuantizedLinearDropsBias,
    QuantizedRoundsActivations,
    RecordingCpuBackend,
    RoundsActivationsSwapsHalves,
    RoundsActivationsUnsaid,
)

# ---------------------------------------------------------------------------------------------
# QuantizedTensor


def test_blocks_are_the_file_bytes_one_row_of_blocks_per_output_row():
    """Q8_0 and Q4_0 decoded by hand from ggml's block layout: a float16 scale, then the quants."""
    rng = np.random.default_rng()
    q8 = random_quantized(rng, "Q8_0", 3, 64)
    blocks = q8.blocks.reshape(3, 2, 34)
    scales = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    expected = (scales * blocks[..., 2:].view(np.int8)).reshape(3, 64)
    np.testing.assert_array_equal(q8.dequantize(), expected)

    q4 = random_quantized(rng, "Q4_0", 2, 32)
    scale = q4.blocks[:, :2].copy().view(np.float16).astype(np.float32)
    quants = np.concatenate([q4.blocks[:, 2:] & 0xF, q4.blocks[:, 2:] >> 4], axis=1).astype(np.float32)
    np.testing.assert_array_equal(q4.dequantize(), scale * (quants - 8))
    assert q4.dequantize().dtype == np.float32 and q4.shape == (2, 32)


def test_concatenated_rows_dequantize_to_the_stacked_weights():
    rng = np.random.default_rng()
    parts = [random_quantized(rng, "Q5_K", rows, 512) for rows in (3, 1, 4)]
    fused = QuantizedTensor.concatenate(parts)
    assert fused.shape == (8, 512) and fused.format == "Q5_K"
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="differ in format or width"):
        QuantizedTensor.concatenate([parts[0], random_quantized(rng, "Q6_K", 2, 512)])


def test_stacked_experts_dequantize_to_the_stacked_weights_and_unstack_to_them():
    rng = np.random.default_rng()
    experts = [random_quantized(rng, "Q4_K", 3, 256) for _ in range(4)]
    stacked = QuantizedTensor.stack(experts)
    assert stacked.shape == (4, 3, 256) and stacked.format == "Q4_K"
    np.testing.assert_array_equal(stacked.dequantize(), np.stack([e.dequantize() for e in experts]))
    for expert, back in zip(experts, stacked.unstack()):
        assert back.shape == expert.shape
        np.testing.assert_array_equal(back.blocks, expert.blocks)
    with pytest.raises(ValueError, match="differ in format or width"):
        QuantizedTensor.stack([experts[0], random_quantized(rng, "Q4_K", 2, 256)])
    with pytest.raises(ValueError, match="not 2-D"):
        QuantizedTensor.concatenate([stacked, stacked])
    with pytest.raises(ValueError, match="is not a stack of experts"):
        experts[0].unstack()


@pytest.mark.parametrize("format, blocks, shape, message", [
    ("F16", np.zeros((2, 64), np.uint8), (2, 32), "'F16' is not a quantized format; candelabra reads Q8_0"),
    ("Q9_9", np.zeros((2, 64), np.uint8), (2, 32), "'Q9_9' is not a quantized format"),
    ("Q4_K", np.zeros((2, 144), np.uint8), (2, 100), "Q4_K packs 256 values per block; 100 columns"),
    ("Q4_0", np.zeros((2, 36), np.uint8), (2, 32), r"uint8 \[2, 18\], got uint8 \[2, 36\]"),
    ("Q4_0", np.zeros((2, 18), np.int8), (2, 32), r"got int8 \[2, 18\]"),
    ("Q4_0", np.zeros((2, 18), np.uint8), (64,), "2-D"),
    ("Q4_0", np.zeros((3, 2, 18), np.uint8), (2, 2, 32), r"2 x 2 x 32 weight are uint8 \[2, 2, 18\]"),
])
def test_malformed_quantized_tensor_is_refused_in_one_line(format, blocks, shape, message):
    with pytest.raises(ValueError, match=message) as error:
        QuantizedTensor(format, blocks, shape)
    assert "\n" not in str(error.value)


def test_a_backend_that_keeps_formats_must_take_them_in_upload_weight():
    class ClaimsQ4K(CpuBackend):
        quantized_formats = frozenset({"Q4_K"})

        def upload_weight(self, name, role, weight, dtype):
            return super(CpuBackend, self).upload_weight(name, role, weight, dtype)

    weight = random_quantized(np.random.default_rng(), "Q4_K", 2, 256)
    with pytest.raises(TypeError, match="got proj.weight as Q4_K blocks, but its upload_weight takes dense"):
        ClaimsQ4K().upload_weight("proj.weight", WeightRole.LINEAR, weight, "float32")


# ---------------------------------------------------------------------------------------------
# A GGUF checkpoint with K-quant linear weights

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 4, 2, 64, 512, 100
# Layer 0's v_proj is Q6_K, as llama.cpp's Q4_K_M files have in some layers: its fused qkv mixes
# formats and must reach the backend dense. Layer 1 is all Q4_K.
LAYER_FORMATS = [
    {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
     "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"},
    {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q4_K",
     "gate_proj": "Q5_K", "up_proj": "Q5_K", "down_proj": "Q4_K"},
]  # fmt: skip
SHAPES = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
          "gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN), "down_proj": (HIDDEN, FFN)}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_k_quant_llama(path, tied: bool):
    """A two-layer llama GGUF with random K-quant blocks; returns each Hugging Face weight's
    QuantizedTensor in Hugging Face row order (q and k are written permuted, as the converter does)."""
    rng = np.random.default_rng()
    metadata = {**gguf_metadata("llama"), "llama.block_count": 2, "llama.embedding_length": HIDDEN,
                "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
                "llama.attention.head_count_kv": KV_HEADS, "llama.attention.key_length": HEAD_DIM,
                "llama.attention.value_length": HEAD_DIM, "llama.rope.dimension_count": HEAD_DIM}
    stored = {"model.embed_tokens.weight": random_quantized(rng, "Q4_K", VOCAB, HIDDEN)}
    tensors = {"token_embd.weight": (stored["model.embed_tokens.weight"].blocks, Q.Q4_K),
               "output_norm.weight": rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)}
    if not tied:
        stored["lm_head.weight"] = random_quantized(rng, "Q6_K", VOCAB, HIDDEN)
        tensors["output.weight"] = (stored["lm_head.weight"].blocks, Q.Q6_K)
    for layer, formats in enumerate(LAYER_FORMATS):
        for module, format in formats.items():
            weight = random_quantized(rng, format, *SHAPES[module])
            prefix = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            stored[f"model.layers.{layer}.{prefix}.{module}.weight"] = weight
            blocks = weight.blocks
            if module in ("q_proj", "k_proj"):
                blocks = permute_like_llama_cpp(blocks, HEADS if module == "q_proj" else KV_HEADS)
            tensors[f"blk.{layer}.{GGUF_NAMES[module]}.weight"] = (blocks, Q[format])
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{norm}.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    write_gguf(path, "llama", metadata, tensors)
    return stored


@pytest.fixture(scope="module", params=[False, True], ids=["own-lm-head", "tied"])
def loaded(request, tmp_path_factory):
    """(what was stored, model and backend keeping every format, model and backend keeping none)."""
    path = tmp_path_factory.mktemp("k-quants") / "llama.gguf"
    stored = write_k_quant_llama(path, tied=request.param)
    with GGUFCheckpoint(path) as checkpoint:
        quantized, dense = QuantizedCpuBackend(), RecordingCpuBackend()
        return stored, (load_model(checkpoint, quantized, "float32"), quantized), \
            (load_model(checkpoint, dense, "float32"), dense)


def test_checkpoint_gives_k_quant_blocks_as_stored_in_hugging_face_row_order(tmp_path):
    path = tmp_path / "llama.gguf"
    stored = write_k_quant_llama(path, tied=False)
    with GGUFCheckpoint(path) as checkpoint:
        for name, expected in stored.items():
            assert checkpoint.quantized_format(name) == expected.format, name
            got = checkpoint.load_quantized(name)
            assert (got.format, got.shape) == (expected.format, expected.shape), name
            np.testing.assert_array_equal(got.blocks, expected.blocks, err_msg=name)
            np.testing.assert_array_equal(got.dequantize(), checkpoint.load(name), err_msg=name)
        assert checkpoint.quantized_format("model.norm.weight") is None
        with pytest.raises(ValueError, match="'model.norm.weight' in .* is not stored quantized"):
            checkpoint.load_quantized("model.norm.weight")


def test_q4_k_linear_reaches_a_backend_that_keeps_it_as_the_files_blocks(loaded):
    stored, (model, backend), _ = loaded
    down = "model.layers.1.mlp.down_proj.weight"
    received = backend.uploads[down, WeightRole.LINEAR]
    assert isinstance(received, QuantizedTensor) and received.format == "Q4_K"
    assert received.shape == (HIDDEN, FFN)
    np.testing.assert_array_equal(received.blocks, stored[down].blocks)
    assert model.layers[1].mlp_out is received

    x = np.random.default_rng().standard_normal((5, FFN)).astype(np.float32)
    out = backend.ops.linear(x, model.layers[1].mlp_out)
    assert nmse(out, oracle.linear(x, stored[down].dequantize())) < 1e-12


def test_fused_projections_stay_quantized_only_when_their_parts_share_a_format(loaded):
    stored, (_, backend), _ = loaded
    qkv = backend.uploads["model.layers.1.self_attn.qkv_proj.weight", WeightRole.LINEAR]
    parts = [stored[f"model.layers.1.self_attn.{m}.weight"] for m in ("q_proj", "k_proj", "v_proj")]
    assert isinstance(qkv, QuantizedTensor) and qkv.format == "Q4_K"
    np.testing.assert_array_equal(qkv.blocks, np.concatenate([p.blocks for p in parts]))
    gate_up = backend.uploads["model.layers.1.mlp.gate_up_proj.weight", WeightRole.LINEAR]
    assert gate_up.format == "Q5_K" and gate_up.shape == (2 * FFN, HIDDEN)

    mixed = backend.uploads["model.layers.0.self_attn.qkv_proj.weight", WeightRole.LINEAR]
    parts = [stored[f"model.layers.0.self_attn.{m}.weight"] for m in ("q_proj", "k_proj", "v_proj")]
    assert isinstance(mixed, np.ndarray) and mixed.dtype == np.float32
    np.testing.assert_array_equal(mixed, np.concatenate([p.dequantize() for p in parts]))


def test_only_linear_and_lm_head_roles_arrive_quantized(loaded):
    stored, (model, backend), (_, dense_backend) = loaded
    tied = "lm_head.weight" not in stored
    roles = {role for _, role in backend.uploads}
    # this llama has no biases, no experts and no latent attention
    assert roles == set(WeightRole) - {WeightRole.BIAS, WeightRole.EXPERTS, WeightRole.PER_HEAD}
    for (name, role), weight in backend.uploads.items():
        if role in (WeightRole.EMBEDDING, WeightRole.NORM):
            assert isinstance(weight, np.ndarray) and weight.dtype == np.float32, name
    lm_head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    lm_head = backend.uploads[lm_head_name, WeightRole.LM_HEAD]
    assert isinstance(lm_head, QuantizedTensor) and model.lm_head is lm_head
    np.testing.assert_array_equal(lm_head.blocks, stored[lm_head_name].blocks)
    np.testing.assert_array_equal(backend.uploads["model.embed_tokens.weight", WeightRole.EMBEDDING],
                                  stored["model.embed_tokens.weight"].dequantize())
    # The backend that keeps no format gets float weights everywhere, under the same names and roles.
    assert set(dense_backend.uploads) == set(backend.uploads)
    assert all(isinstance(w, np.ndarray) and w.dtype == np.float32 for w in dense_backend.uploads.values())


def test_quantized_and_float_weights_give_the_same_logits(loaded):
    _, (model, backend), (dense_model, dense_backend) = loaded
    hidden = np.random.default_rng().standard_normal((9, HIDDEN)).astype(np.float32)
    rows = np.array([8, 0, 3, 3], dtype=np.int32)
    logits = model.compute_logits(backend.to_device(hidden), backend.to_device(rows))
    expected = dense_model.compute_logits(dense_backend.to_device(hidden), dense_backend.to_device(rows))
    assert logits.shape == (4, VOCAB)
    assert nmse(logits, expected) < 1e-12


# ---------------------------------------------------------------------------------------------
# A tied LM head: the embedding uploaded again with role lm_head


@pytest.mark.parametrize("backend_name", ["cpu", "metal"])
def test_dense_tied_lm_head_is_the_embedding_tensor_itself(tmp_path, backend_name):
    from candelabra.plugins import installed_plugins

    backend_class = installed_plugins().backends.get(backend_name)
    if not backend_class.probe().available:
        pytest.skip(backend_class.probe().reason)
    rng = np.random.default_rng()
    metadata = {**gguf_metadata("qwen2"), "qwen2.block_count": 1}
    tensors = {"token_embd.weight": rng.standard_normal((VOCAB, 64)).astype(np.float32),
               "output_norm.weight": rng.standard_normal(64).astype(np.float32)}
    for name, shape in {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
                        "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96)}.items():
        tensors[f"blk.0.{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
    for name in ("attn_norm", "ffn_norm"):
        tensors[f"blk.0.{name}.weight"] = rng.standard_normal(64).astype(np.float32)
    path = write_gguf(tmp_path / "tied.gguf", "qwen2", metadata, tensors)
    with GGUFCheckpoint(path) as checkpoint:
        model = load_model(checkpoint, backend_class(), "float32")
    assert model.lm_head is model.embed_tokens


# ---------------------------------------------------------------------------------------------
# Conformance: quantized linear cases


def _quantized_cases(*ops):
    """The quantized cases in float32, of `ops` (default: every op)."""
    return [case for case in op_cases(("float32",)) if case.weight_format and (not ops or case.op in ops)]


def test_every_format_candelabra_reads_has_quantized_linear_cases():
    cases = _quantized_cases()
    assert {case.weight_format for case in cases} == set(QUANTIZED_FORMATS)
    assert {case.op for case in cases} == {"linear", "gated_linear", "rms_norm_linear", "rms_norm_gated_mlp",
                                           "moe_experts"}
    assert {dict(case.params).get("role", "linear") for case in cases} == {"linear", "lm_head"}
    assert any(dict(case.params).get("column_order") for case in cases), "an act-order weight's case"


def test_quantized_linear_and_experts_pass_on_a_backend_that_keeps_every_format():
    backend = QuantizedCpuBackend()
    results = [run_case(backend, case, seed) for seed, case in enumerate(_quantized_cases())]
    assert {r.status for r in results} == {PASSED}, [r.message for r in results if r.status != PASSED]
    assert max(r.worst_nmse for r in results) < 1e-12


def test_quantized_thresholds_allow_activations_rounded_to_8_bits_per_block():
    backend = QuantizedRoundsActivations()
    results = [run_case(backend, case, seed) for seed, case in enumerate(_quantized_cases("linear"))]
    assert {r.status for r in results} == {PASSED}, [r.message for r in results if r.status != PASSED]
    assert min(r.worst_nmse for r in results) > 1e-6, "activations were rounded"


@pytest.mark.parametrize("case", [GGUFModelCase("qwen2", "Q5_0"), GGUFModelCase("llama", "Q4_1"),
                                  GGUFModelCase("qwen3moe", "Q4_0")], ids=lambda case: case.name)
def test_the_models_level_holds_a_backend_that_says_it_rounds_activations_to_the_rounded_limit(case):
    said = run_model_case(QuantizedRoundsActivations(), case, seed=3)
    assert said.status == PASSED and said.activations == "int8", said.message
    assert said.nmse > MODEL_NMSE_THRESHOLDS["float32"], "activations were rounded"
    unsaid = run_model_case(RoundsActivationsUnsaid(), case, seed=3)
    assert unsaid.status == FAILED and unsaid.activations is None and "logits NMSE" in unsaid.message
    assert unsaid.nmse == pytest.approx(said.nmse, rel=0.5)


@pytest.mark.parametrize("case", [GGUFModelCase("qwen2", "Q5_0"), GGUFModelCase("llama", "Q4_1")],
                         ids=lambda case: case.name)
def test_a_backend_that_rounds_activations_and_decodes_blocks_wrongly_still_fails(case):
    result = run_model_case(RoundsActivationsSwapsHalves(), case, seed=3)
    assert result.status == FAILED and result.nmse > 100 * ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD


def test_a_dense_model_is_held_to_the_dtypes_limit_whatever_the_backend_says_of_activations():
    result = run_model_case(QuantizedRoundsActivations(), GGUFModelCase("qwen2", "F16"), seed=3)
    assert result.status == PASSED and result.activations is None


def test_quantized_linear_is_not_supported_where_no_format_is_kept():
    results = [run_case(CpuBackend(), case, seed) for seed, case in enumerate(_quantized_cases())]
    assert {r.status for r in results} == {NOT_SUPPORTED}
    assert all("keeps no" in r.message and r.weight_format in r.message for r in results)


def test_quantized_experts_are_not_supported_where_the_format_is_kept_for_linear_weights_only():
    cases = _quantized_cases("moe_experts")
    results = [run_case(KeepsLinearWeightsOnly(), case, seed) for seed, case in enumerate(cases)]
    assert {r.status for r in results} == {NOT_SUPPORTED}
    assert all(f"keeps no {r.weight_format} experts" in r.message for r in results)


def test_a_quantized_kernel_that_drops_the_bias_fails_exactly_the_cases_with_one():
    backend = QuantizedLinearDropsBias()
    for seed, case in enumerate(_quantized_cases("linear")):
        result = run_case(backend, case, seed)
        assert result.status == (FAILED if dict(case.params)["bias"] else PASSED), case.id


# ---------------------------------------------------------------------------------------------
# A MoE GGUF: its experts reach the backend as one 3-D QuantizedTensor, for the experts role only


class KeepsLinearWeightsOnly(QuantizedCpuBackend):
    """Keeps every format, but for the linear and LM-head roles only: its experts arrive dense."""

    name = "cpu-quantized-linear-only"
    quantized_roles = QUANTIZABLE_ROLES


@pytest.fixture(scope="module")
def quantized_experts(tmp_path_factory):
    """A Qwen3-MoE GGUF with Q8_0 experts: its path, and gguf's own reading of its tensors."""
    path = tmp_path_factory.mktemp("moe") / "qwen3moe-q8_0.gguf"
    convert_to_gguf(tiny_model("qwen3moe"), "qwen3moe", path, ggml_type=Q.Q8_0)
    return path, {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}


def test_quantized_experts_reach_a_backend_that_keeps_them_as_the_files_blocks_stacked(quantized_experts):
    path, stored = quantized_experts
    with GGUFCheckpoint(path) as checkpoint:
        backend, dense = QuantizedCpuBackend(), KeepsLinearWeightsOnly()
        load_model(checkpoint, backend, "float32"), load_model(checkpoint, dense, "float32")
    gate_up = backend.uploads["model.layers.1.mlp.experts.gate_up_proj", WeightRole.EXPERTS]
    down = backend.uploads["model.layers.1.mlp.experts.down_proj", WeightRole.EXPERTS]
    assert isinstance(gate_up, QuantizedTensor) and (gate_up.format, gate_up.shape) == ("Q8_0", (4, 128, 64))
    assert (down.format, down.shape) == ("Q8_0", (4, 64, 64))
    # gguf's reader gives each 3-D tensor's blocks as [experts, rows, bytes]: gate rows, then up rows.
    blocks = {part: np.asarray(stored[f"blk.1.ffn_{part}_exps.weight"].data) for part in ("gate", "up", "down")}
    np.testing.assert_array_equal(gate_up.blocks, np.concatenate([blocks["gate"], blocks["up"]], axis=1))
    np.testing.assert_array_equal(down.blocks, blocks["down"])
    router = backend.uploads["model.layers.1.mlp.gate.weight", WeightRole.LINEAR]
    assert isinstance(router, np.ndarray), "llama.cpp leaves a router float32"
    # Where the format is kept for linear weights only, the experts arrive dense, with the same values.
    dense_gate_up = dense.uploads["model.layers.1.mlp.experts.gate_up_proj", WeightRole.EXPERTS]
    assert isinstance(dense_gate_up, np.ndarray) and dense_gate_up.dtype == np.float32
    np.testing.assert_array_equal(dense_gate_up, gate_up.dequantize())
    assert isinstance(dense.uploads["model.layers.1.self_attn.qkv_proj.weight", WeightRole.LINEAR], QuantizedTensor)


def test_a_moe_gguf_with_quantized_experts_matches_transformers_on_a_backend_that_keeps_them():
    backend = QuantizedCpuBackend()
    result = run_model_case(backend, GGUFModelCase("mixtral", "Q4_0"), seed=2)
    assert result.status == PASSED, result.message
    kept = {role for (_, role), weight in backend.uploads.items() if isinstance(weight, QuantizedTensor)}
    assert kept == {WeightRole.LINEAR, WeightRole.LM_HEAD, WeightRole.EXPERTS}


# ---------------------------------------------------------------------------------------------
# Whole models: quantized weights kept by the backend give transformers' logits and tokens


@pytest.mark.slow
@pytest.mark.parametrize("arch, ggml_type", [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("gemma3", "Q5_1")])
def test_gguf_model_conformance_passes_with_weights_kept_quantized(arch, ggml_type):
    backend = QuantizedCpuBackend()
    result = run_model_case(backend, GGUFModelCase(arch, ggml_type), seed=4)
    assert result.status == PASSED, result.message
    kept = [(name, role) for (name, role), w in backend.uploads.items() if isinstance(w, QuantizedTensor)]
    assert {role for _, role in kept} == {WeightRole.LINEAR, WeightRole.LM_HEAD}
    assert all(backend.uploads[key].format == ggml_type for key in kept)
