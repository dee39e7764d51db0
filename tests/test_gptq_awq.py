"""GPTQ and AWQ safetensors checkpoints: each layout's packed tensors read back as each element's
definition says (checked one element at a time in plain Python), kept as grouped int4 weights
where that is exact (act-order as a column order) and dequantized with a reason where not; configs
candelabra cannot read refused naming what they say; `--quant` checked against the checkpoint; and
a tiny act-order model kept quantized matching transformers, and MoE models whose experts are packed one
by one stacked quantized, or dequantized where act-order gave each expert its own column order.
"""

import json
import logging
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import save_file

from candelabra.conformance.model_cases import (
    INT4_MODEL_CASES,
    MODEL_CASES,
    Int4ModelCase,
    make_reference,
    run_model_case,
)
from candelabra.conformance.quantized_checkpoints import AWQ_ORDER, Int4Layout, write_int4_checkpoint
from candelabra.core.contract.weights import QuantizedTensor, WeightRole
from candelabra.core.loading.model import load_model
from candelabra.core.loading.open import open_model
from candelabra.core.loading.quant_flag import check_quant, parse_quant
from candelabra.core.models.sharding import pad_rows, take_columns, take_rows
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from quantized_backends import QuantizedCpuBackend
from support import one_line_checkpoint_error

NAME = "model.layers.0.mlp.down_proj"


def element(tensors: dict, config: dict, n: int, k: int) -> float:
    """Weight [n, k] of the one linear in `tensors`, decoded from its definition, one element."""
    def nibble(word, position):
        return (int(word) >> (4 * position)) & 0xF

    qweight, qzeros, scales = (tensors[f"{NAME}.{part}"] for part in ("qweight", "qzeros", "scales"))
    if config["quant_method"] == "awq":
        group = k // config["group_size"]
        position = AWQ_ORDER.index(n % 8)
        q, z = nibble(qweight[k, n // 8], position), nibble(qzeros[group, n // 8], position)
    else:
        group = int(tensors[f"{NAME}.g_idx"][k])
        q = nibble(qweight[k // 8, n], k % 8)
        z = nibble(qzeros[group, n // 8], n % 8) + (1 if config.get("checkpoint_format", "gptq") == "gptq" else 0)
    return (q - z) * float(scales[group, n])


def write_linear(folder, config: dict, rows: int, columns: int, seed: int, g_idx=None, zero_nibbles=None) -> dict:
    """A checkpoint of one linear with random packed words (and `g_idx`, else in order); its tensors."""
    rng = np.random.default_rng(seed)
    group = columns if config["group_size"] == -1 else config["group_size"]
    words = lambda *shape: rng.integers(-2**31, 2**31, shape).astype(np.int32)  # noqa: E731
    if config["quant_method"] == "awq":
        tensors = {"qweight": words(columns, rows // 8), "qzeros": words(columns // group, rows // 8)}
    else:
        tensors = {"qweight": words(columns // 8, rows), "qzeros": words(columns // group, rows // 8),
                   "g_idx": (np.arange(columns) // group if g_idx is None else g_idx).astype(np.int32)}
    if zero_nibbles is not None:
        tensors["qzeros"] = np.full_like(tensors["qzeros"], zero_nibbles)
    tensors["scales"] = rng.uniform(0.01, 0.1, (columns // group, rows)).astype(np.float16)
    tensors = {f"{NAME}.{part}": value for part, value in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"quantization_config": config}))
    return tensors


def expected_weight(tensors: dict, config: dict, rows: int, columns: int) -> np.ndarray:
    return np.array([[element(tensors, config, n, k) for k in range(columns)] for n in range(rows)], np.float32)


GPTQ_V2_SYM = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "gptq_v2"}
GPTQ_V1_ASYM = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("config, expected_format", [
    (GPTQ_V2_SYM, "INT4_G32"),
    ({**GPTQ_V1_ASYM, "desc_act": False}, None),  # random v1 words hold stored zeros of 15: 16 after the + 1
    ({**GPTQ_V2_SYM, "group_size": -1}, "INT4_G64"),  # 192 features: the largest int4 group dividing them
    ({**GPTQ_V2_SYM, "group_size": 64}, "INT4_G64"),
    (AWQ, "INT4_G32"),
], ids=["gptq-v2", "gptq-v1-zero-16", "gptq-one-group-a-row", "gptq-g64", "awq"])
def test_each_layout_reads_as_each_element_is_defined(tmp_path, config, expected_format):
    tensors = write_linear(tmp_path, config, rows=16, columns=192, seed=1)
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        assert checkpoint.tensor_names() == [f"{NAME}.weight"]
        assert checkpoint.tensor_shape(f"{NAME}.weight") == (16, 192)
        assert checkpoint.quantized_format(f"{NAME}.weight") == expected_format
        np.testing.assert_array_equal(checkpoint.load(f"{NAME}.weight"), expected_weight(tensors, config, 16, 192))
        if expected_format is not None:
            assert checkpoint.load_quantized(f"{NAME}.weight").format == expected_format


def test_v1_zero_points_are_stored_minus_one_and_kept_quantized_below_16(tmp_path):
    config = {**GPTQ_V1_ASYM, "desc_act": False}
    tensors = write_linear(tmp_path, config, rows=16, columns=64, seed=2, zero_nibbles=0x76543210)
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        weight = checkpoint.load_quantized(f"{NAME}.weight")
    np.testing.assert_array_equal(weight.dequantize(), expected_weight(tensors, config, 16, 64))
    zeros = weight.blocks.reshape(16, 2, -1)[..., 2:4].copy().view(np.float16)[..., 0]
    assert np.array_equal(zeros[:8, 0], np.arange(1, 9))  # output feature n's stored zero is n % 8, plus one


def test_act_order_keeps_its_groups_stored_contiguous_under_a_column_order(tmp_path):
    g_idx = np.argsort(np.random.default_rng(3).permutation(128)) // 32
    tensors = write_linear(tmp_path, {**GPTQ_V1_ASYM, "sym": True}, rows=16, columns=128, seed=3, g_idx=g_idx,
                           zero_nibbles=0x77777777)
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        weight = checkpoint.load_quantized(f"{NAME}.weight")
    assert weight.format == "INT4_G32"
    np.testing.assert_array_equal(weight.column_order, np.argsort(g_idx, kind="stable"))
    np.testing.assert_array_equal(weight.dequantize(), expected_weight(tensors, GPTQ_V1_ASYM, 16, 128))
    x = np.random.default_rng(4).standard_normal((3, 128)).astype(np.float32)
    stored = QuantizedTensor(weight.format, weight.blocks, weight.shape).dequantize()
    np.testing.assert_allclose(x[:, weight.column_order] @ stored.T, x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def test_act_order_groups_of_unequal_sizes_are_dequantized_saying_why(tmp_path, caplog):
    g_idx = np.sort(np.random.default_rng(5).integers(0, 4, 128))[::-1].copy()
    tensors = write_linear(tmp_path, GPTQ_V1_ASYM, rows=16, columns=128, seed=5, g_idx=g_idx, zero_nibbles=0x11)
    with SafetensorsCheckpoint(tmp_path) as checkpoint, caplog.at_level(logging.INFO, "candelabra"):
        assert checkpoint.quantized_format(f"{NAME}.weight") is None
        weight = checkpoint.load(f"{NAME}.weight")
    np.testing.assert_array_equal(weight, expected_weight(tensors, GPTQ_V1_ASYM, 16, 128))
    assert "g_idx does not give every group exactly group_size input features" in caplog.text


@pytest.mark.parametrize("settings, expected", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with 8 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point False"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0"),
])
def test_a_quantization_candelabra_cannot_read_is_refused_naming_it(tmp_path, settings, expected):
    write_linear(tmp_path, AWQ, rows=16, columns=64, seed=6)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": settings}))
    message = one_line_checkpoint_error(lambda: SafetensorsCheckpoint(tmp_path), "config.json", expected)
    assert "GPTQ" in message or "zero_point" in message or "group_size" in message


def test_packed_tensors_without_a_quantization_config_are_refused(tmp_path):
    write_linear(tmp_path, AWQ, rows=16, columns=64, seed=7)
    (tmp_path / "config.json").write_text("{}")
    one_line_checkpoint_error(lambda: SafetensorsCheckpoint(tmp_path), f"{NAME}.qweight", "quantize_config.json")


def test_autogptq_quantize_config_json_is_read_as_gptq(tmp_path):
    write_linear(tmp_path, GPTQ_V2_SYM, rows=16, columns=64, seed=8)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "sym": True,
                                                               "checkpoint_format": "gptq_v2"}))
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        assert checkpoint.quant_method == "gptq" and checkpoint.quantized_format(f"{NAME}.weight") == "INT4_G32"


# ---------------------------------------------------------------------------------------------
# --quant


def test_quant_flag_must_agree_with_the_checkpoint(tmp_path):
    write_linear(tmp_path, AWQ, rows=16, columns=64, seed=9)
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        for accepted in (None, "awq", "AWQ", "marlin"):
            check_quant(accepted, checkpoint)
        with pytest.raises(ValueError, match=r"--quant gptq serves GPTQ checkpoints, but .* is AWQ-quantized"):
            check_quant("gptq", checkpoint)
    (tmp_path / "config.json").write_text("{}")
    save_file({"model.norm.weight": np.ones(4, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"--quant marlin serves GPTQ or AWQ checkpoints, but .* is not quantized"):
        open_model(tmp_path, quant="marlin")
    with pytest.raises(ValueError, match="--quant q3 is not known; choose one of gptq, awq, marlin, gguf"):
        parse_quant("q3")


# ---------------------------------------------------------------------------------------------
# Sharding and fusing


def test_rows_keep_the_column_order_and_columns_of_a_permuted_weight_are_dequantized(tmp_path):
    g_idx = np.argsort(np.random.default_rng(10).permutation(128)) // 32
    write_linear(tmp_path, {**GPTQ_V2_SYM, "sym": False}, rows=16, columns=128, seed=10, g_idx=g_idx)
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        weight = checkpoint.load_quantized(f"{NAME}.weight")
    dense = weight.dequantize()
    kept = [2, 3, 4, 9, 10, 11]
    rows = take_rows(weight, [range(2, 5), range(9, 12)])
    assert isinstance(rows, QuantizedTensor) and np.array_equal(rows.column_order, weight.column_order)
    np.testing.assert_array_equal(rows.dequantize(), dense[kept])
    np.testing.assert_array_equal(pad_rows(rows, 8).dequantize(), np.concatenate([dense[kept], np.zeros((2, 128))]))
    columns = take_columns(weight, range(32, 64))
    assert isinstance(columns, np.ndarray)
    np.testing.assert_array_equal(columns, dense[:, 32:64])


@pytest.fixture(scope="module")
def act_order_case():
    return next(case for case in INT4_MODEL_CASES if "act-order" in case.name)


def test_an_act_order_model_kept_quantized_matches_transformers(act_order_case):
    backend = QuantizedCpuBackend()
    result = run_model_case(backend, act_order_case, seed=12)
    assert result.status == "passed", result.message
    qkv = backend.uploads["model.layers.0.self_attn.qkv_proj.weight", WeightRole.LINEAR]
    down = backend.uploads["model.layers.1.mlp.down_proj.weight", WeightRole.LINEAR]
    assert qkv.format == "INT4_G32" and qkv.column_order is not None and down.column_order is not None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_shard_keeps_act_order_rows_quantized_and_dequantizes_its_columns(
        tmp_path, act_order_case, rank):
    from support import LoadOnlyCommunicator

    write_int4_checkpoint(make_reference(act_order_case, seed=15), act_order_case.layout, tmp_path, seed=15)
    backend = QuantizedCpuBackend()
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        load_model(checkpoint, backend, communicator=LoadOnlyCommunicator(rank, 2))
        whole = {name: checkpoint.load(name) for name in checkpoint.tensor_names()}
    layer = "model.layers.1"
    gate_up = backend.uploads[f"{layer}.mlp.gate_up_proj.weight", WeightRole.LINEAR]
    down = backend.uploads[f"{layer}.mlp.down_proj.weight", WeightRole.LINEAR]
    features = slice(rank * 128, (rank + 1) * 128)
    assert isinstance(gate_up, QuantizedTensor) and gate_up.column_order is not None
    np.testing.assert_array_equal(gate_up.dequantize(), np.concatenate(
        [whole[f"{layer}.mlp.{part}_proj.weight"][features] for part in ("gate", "up")]))
    assert isinstance(down, np.ndarray)  # its act-order columns are spread over every group
    np.testing.assert_array_equal(down, whole[f"{layer}.mlp.down_proj.weight"][:, features])


def test_projections_fused_from_different_act_orders_are_dequantized(tmp_path, act_order_case, monkeypatch):
    import candelabra.conformance.quantized_checkpoints as builders

    monkeypatch.setattr(builders, "SHARED_INPUT", {})  # each projection its own g_idx, unlike a real checkpoint
    reference = make_reference(act_order_case, seed=13)
    write_int4_checkpoint(reference, act_order_case.layout, tmp_path, seed=13)
    backend = QuantizedCpuBackend()
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        load_model(checkpoint, backend)
    qkv = backend.uploads["model.layers.0.self_attn.qkv_proj.weight", WeightRole.LINEAR]
    out = backend.uploads["model.layers.0.self_attn.o_proj.weight", WeightRole.LINEAR]
    assert isinstance(qkv, np.ndarray) and isinstance(out, QuantizedTensor)
    expected = np.concatenate([reference.model.layers[0].self_attn.get_submodule(f"{p}_proj").weight.detach().numpy()
                               for p in "qkv"])
    np.testing.assert_array_equal(qkv, expected)


# MoE checkpoints as the Hub's GPTQ and AWQ ones store their experts, one linear per expert and projection
# (the models level's GPTQ Qwen3-MoE, and these); under act-order each expert has a g_idx of its own (its
# inputs' statistics order its columns).
GPTQ_MOE = next(case for case in INT4_MODEL_CASES if case.routes_experts)
MOE_INT4_CASES = [
    GPTQ_MOE,
    replace(GPTQ_MOE, name="gptq-qwen3-moe-v1-act-order-g32", layout=Int4Layout("gptq", 32, desc_act=True, v1=True)),
    Int4ModelCase("awq-mixtral-g32", "MixtralConfig", Int4Layout("awq", 32),
                  next(case for case in MODEL_CASES if case.name == "mixtral").settings, routes_experts=True),
]


@pytest.mark.parametrize("case", MOE_INT4_CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("backend_name", ["quantized-cpu", "torch"])
def test_moe_experts_packed_one_by_one_are_stacked_and_match_transformers(case, backend_name, caplog):
    """Each expert's packed linears are read and stacked into the layer's two 3-D weights: kept int4 where
    every expert's columns come in one order, dequantized (and logged) where act-order gave each its own."""
    from candelabra.backends.torch.backend import TorchBackend

    backend = QuantizedCpuBackend() if backend_name == "quantized-cpu" else TorchBackend()
    with caplog.at_level(logging.INFO, logger="candelabra"):
        result = run_model_case(backend, case, seed=21)
    assert result.status == "passed", result.message
    reordered = "the experts dequantized to float32 at load to be stacked" in caplog.text
    assert reordered == case.layout.desc_act
    if backend_name == "quantized-cpu":
        experts = [backend.uploads[f"model.layers.0.mlp.experts.{part}", WeightRole.EXPERTS]
                   for part in ("gate_up_proj", "down_proj")]
        kinds = {type(weight) for weight in experts}
        assert kinds == ({np.ndarray} if case.layout.desc_act else {QuantizedTensor})
        assert isinstance(backend.uploads["model.layers.0.self_attn.qkv_proj.weight", WeightRole.LINEAR],
                          QuantizedTensor)


# ---------------------------------------------------------------------------------------------
# The engine


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_an_engine_over_gptq_and_awq_checkpoints_generates_what_their_dequantized_weights_do(
        tmp_path, tiny_llm, backend):
    """The engine's tiny model (word-level tokenizer) with its linears packed as act-order GPTQ v1
    and as AWQ, each against the same model holding the dequantized weights, in float32: in bfloat16 the
    int4 kernel and the dense product round differently, and which one runs is chosen by timing, so a
    near tie could part the greedy tokens (the models level holds bfloat16 to transformers up to a tie)."""
    from candelabra.conformance.engine_cases import write_tiny_checkpoint
    from candelabra.conformance.quantized_checkpoints import Int4Layout, write_int4_copy
    from candelabra.core.requests.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 23, 42, 7, 11], list(range(7, 40))]
    for quant, layout in (("gptq", Int4Layout("gptq", 32, desc_act=True, v1=True)), ("awq", Int4Layout("awq", 64))):
        dense, packed = tmp_path / f"{quant}-dense", tmp_path / quant
        dense.mkdir()
        write_tiny_checkpoint(dense, seed=14)
        write_int4_copy(dense, packed, layout, seed=14)
        outputs = [tiny_llm(folder=folder, backend=backend, dtype="float32", **options).generate(prompts, params,
                                                                                                progress=False)
                   for folder, options in ((dense, {}), (packed, {"quant": "marlin" if quant == "awq" else quant}))]
        expected, actual = ([o.outputs[0].token_ids for o in output] for output in outputs)
        assert actual == expected, quant
