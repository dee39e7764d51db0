"""Our GGML quantizers (candelabra.core.weights.quantize) against the two references there are: the
gguf package's quantizers for the legacy formats, byte for byte, and llama.cpp's reference
quantizers for every format, through the numbers bench/kquant_reference_error.py measured with
llama.cpp's libggml-base on conformance.quantizer_inputs (2026-11, llama.cpp of llama-cpp-python
0.3.36): the relative RMS error of each format, and a digest of its bytes."""

import hashlib

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

import candelabra.core.weights.quantize as quantizers
from candelabra.conformance.quantizer_inputs import random_normal_weights, real_weights, relative_rms_error
from candelabra.core.weights.quantize import BLOCK_QUANTIZERS, quantize

LEGACY_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

# llama.cpp's relative RMS error per format and input; ours must be within ERROR_MARGIN of it.
LLAMA_CPP_ERROR = {
    ("Q4_0", "random"): 0.085812, ("Q4_0", "real"): 0.109149,
    ("Q4_1", "random"): 0.078151, ("Q4_1", "real"): 0.083702,
    ("Q5_0", "random"): 0.042619, ("Q5_0", "real"): 0.032482,
    ("Q5_1", "random"): 0.037863, ("Q5_1", "real"): 0.039098,
    ("Q8_0", "random"): 0.005345, ("Q8_0", "real"): 0.005207,
    ("Q2_K", "random"): 0.297936, ("Q2_K", "real"): 0.311444,
    ("Q3_K", "random"): 0.150401, ("Q3_K", "real"): 0.164235,
    ("Q4_K", "random"): 0.071354, ("Q4_K", "real"): 0.075888,
    ("Q5_K", "random"): 0.036023, ("Q5_K", "real"): 0.036399,
    ("Q6_K", "random"): 0.017700, ("Q6_K", "real"): 0.009466,
}  # fmt: skip
ERROR_MARGIN = 0.02

# The first 16 hex digits of the sha256 of llama.cpp's blocks for the same inputs.
LLAMA_CPP_SHA256 = {
    ("Q4_0", "random"): "98c8d19de8788812", ("Q4_0", "real"): "06df46cf06de0ee3",
    ("Q4_1", "random"): "70835d358c859562", ("Q4_1", "real"): "1a6d1f985b04c631",
    ("Q5_0", "random"): "449babe68d95aa65", ("Q5_0", "real"): "3ed5d3a378a8c1ad",
    ("Q5_1", "random"): "dc4b86ff4277aeff", ("Q5_1", "real"): "2c85fe53598993da",
    ("Q8_0", "random"): "415831f7d19eae77", ("Q8_0", "real"): "b98856838f8bbd7e",
    ("Q2_K", "random"): "45c6122552badc28", ("Q2_K", "real"): "1ffedc511aaf2187",
    ("Q3_K", "random"): "30685216de601b46", ("Q3_K", "real"): "58423ee2a7468611",
    ("Q4_K", "random"): "c174efd360a9c4ee", ("Q4_K", "real"): "e08ce09819e449cf",
    ("Q5_K", "random"): "5d77076484133716", ("Q5_K", "real"): "bb5b39c964828db8",
    ("Q6_K", "random"): "9f37e59fdf370f94", ("Q6_K", "real"): "526eacff67d0b6f4",
}  # fmt: skip

CASES = sorted(LLAMA_CPP_ERROR, key=lambda case: (case[1], list(BLOCK_QUANTIZERS).index(case[0])))


@pytest.fixture(scope="module")
def inputs():
    return {"random": random_normal_weights(), "real": real_weights()}


@pytest.fixture(scope="module")
def quantized(inputs):
    """Our blocks for each (format, input), made once."""
    made = {}

    def get(format: str, input_name: str):
        if (format, input_name) not in made:
            made[format, input_name] = quantize(inputs[input_name], format)
        return made[format, input_name]

    return get


def awkward_blocks(rng: np.random.Generator, values_per_block: int) -> np.ndarray:
    """Blocks of random scales, and the blocks that test a quantizer's edges: zeros, a constant,
    values all of one sign, two values of largest magnitude and opposite signs, and tiny values."""
    blocks = (rng.standard_normal((96, values_per_block)) * rng.uniform(0, 4, (96, 1))).astype(np.float32)
    blocks[0] = 0
    blocks[1] = 1.5
    blocks[2] = np.abs(blocks[2])
    blocks[3] = -np.abs(blocks[3])
    blocks[4, :2] = (5.0, -5.0)
    blocks[5] *= 1e-20
    blocks[6, ::2] = 0
    return blocks


@pytest.mark.parametrize("format", LEGACY_FORMATS)
def test_the_legacy_formats_are_the_gguf_packages_bytes(format):
    weight = awkward_blocks(np.random.default_rng(7), 32).reshape(-1, 256)
    ours = quantize(weight, format).blocks
    theirs = gguf_quantize(weight, GGMLQuantizationType[format])
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize(("format", "input_name"), CASES)
def test_each_format_is_as_accurate_as_llama_cpps_reference_quantizer(format, input_name, inputs, quantized):
    error = relative_rms_error(inputs[input_name], quantized(format, input_name).dequantize())
    assert error == pytest.approx(LLAMA_CPP_ERROR[format, input_name], rel=ERROR_MARGIN)


@pytest.mark.parametrize(("format", "input_name"), CASES)
def test_each_format_gives_llama_cpps_bytes(format, input_name, quantized):
    digest = hashlib.sha256(quantized(format, input_name).blocks.tobytes()).hexdigest()[:16]
    assert digest == LLAMA_CPP_SHA256[format, input_name]


@pytest.mark.parametrize("format", [*LEGACY_FORMATS, "Q4_K", "Q6_K"])
def test_a_weight_already_on_a_formats_grid_comes_back_unchanged(format):
    """What gguf decodes from our blocks is a weight our quantizer keeps exactly: the codes and
    scales it meant are the ones it wrote (the other k-quants search again and may move)."""
    weight = awkward_blocks(np.random.default_rng(3), 256)
    on_grid = quantize(weight, format).dequantize()
    assert np.array_equal(quantize(on_grid, format).dequantize(), on_grid)


def test_quantizing_in_chunks_on_several_threads_gives_the_bytes_of_one_call(monkeypatch):
    weight = np.random.default_rng(1).standard_normal((40, 2048), dtype=np.float32)
    whole = quantize(weight, "Q4_K", threads=1).blocks
    monkeypatch.setattr(quantizers, "CHUNK_VALUES", 3 * 256)  # chunk boundaries inside rows
    assert np.array_equal(quantize(weight, "Q4_K", threads=3).blocks, whole)


@pytest.mark.parametrize(("format", "shape", "expected"), [
    ("Q4_K", (4, 896), "whole blocks of 256 values"),
    ("Q8_0", (4 * 32,), "2-D weights"),
    ("Q7_K", (4, 256), "cannot quantize to Q7_K"),
])
def test_a_weight_that_does_not_fill_whole_blocks_is_refused(format, shape, expected):
    with pytest.raises(ValueError, match=expected):
        quantize(np.zeros(shape, np.float32), format)
