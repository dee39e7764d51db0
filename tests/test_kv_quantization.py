"""A quantized KV cache's rows: the layout kv_cache.py states, the same bytes from numpy and torch, and
the cache's size and effect on a model."""

import numpy as np
import pytest
import torch

from candelabra.backends.torch.quantized_kv import dequantize_rows, quantize_rows
from candelabra.conformance.compare import QUANTIZED_KV_MODEL_NMSE_THRESHOLDS, nmse
from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.kv_quantization import FP8_E4M3_VALUES, dequantize_kv_rows, quantize_kv_rows
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.llm import LLM
from candelabra.core.loading.model import load_model
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from candelabra.core.worker.model_runner import ModelRunner
from candelabra.plugins import backend_class

STORAGE = {"int8": torch.int8, "fp8": torch.uint8}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(folder, seed=7)
    return folder


def test_an_int8_row_is_its_rounded_codes_then_its_float32_scale_little_endian():
    row = np.array([[0.5, -1.27, 0.004, 1.0]], dtype=np.float32)
    stored = quantize_kv_rows(row, "int8")
    scale = np.float32(1.27) / np.float32(127)
    assert stored.dtype == np.int8 and stored.shape == (1, 8)
    assert stored[0, :4].tolist() == [50, -127, 0, 100]
    assert stored[0, 4:].view(np.uint8).tobytes() == scale.astype("<f4").tobytes()
    assert quantize_kv_rows(np.zeros((1, 4), np.float32), "int8").tolist() == [[0] * 8]


def test_fp8_codes_are_the_e4m3fn_bits_torch_rounds_to_halfway_cases_included():
    assert FP8_E4M3_VALUES[0x7E] == 448 and FP8_E4M3_VALUES[0x01] == 2.0**-9 and np.isnan(FP8_E4M3_VALUES[0xFF])
    grid = FP8_E4M3_VALUES[:0x7F]
    halfway = (grid[:-1] + grid[1:]) / 2
    values = np.concatenate([[448.0], halfway, -halfway, np.random.default_rng(3).uniform(-448, 448, 3000)])
    values = values.astype(np.float32)  # with 448 among them the scale is 1: the codes are the values rounded
    codes = quantize_kv_rows(values[None], "fp8")[0, :-4].view(np.uint8)
    assert np.array_equal(codes, torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy())


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_numpy_and_torch_store_the_same_bytes_and_read_the_same_values(kv_dtype):
    rows = np.random.default_rng(5).standard_normal((9, 3, 64)).astype(np.float32)
    rows[2, 1] = 0
    stored = quantize_kv_rows(rows, kv_dtype)
    from_torch = quantize_rows(torch.from_numpy(rows), STORAGE[kv_dtype])
    assert np.array_equal(from_torch.numpy(), stored)
    assert np.array_equal(dequantize_rows(from_torch.transpose(0, 1)).transpose(0, 1).numpy(),
                          dequantize_kv_rows(stored, kv_dtype))
    assert nmse(dequantize_kv_rows(stored, kv_dtype), rows) < (1e-4 if kv_dtype == "int8" else 2e-3)


def test_an_int8_cache_takes_a_quarter_of_float32s_bytes_plus_its_scales():
    float32 = KVCacheSpec(24, 1, 16, 2, 64, "float32")
    int8 = KVCacheSpec(24, 1, 16, 2, 64, "int8")
    assert int8.block_shape == (1, 16, 2, 68) and int8.storage_dtype == "int8"
    assert int8.bytes_per_token * 4 == float32.bytes_per_token * 68 // 64


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_an_int8_cache_moves_a_float32_models_logits_within_the_measured_limit(checkpoint, backend):
    backend = backend_class(backend)()
    model = load_model(SafetensorsCheckpoint(checkpoint), backend, "float32")
    tokens = np.random.default_rng().integers(3, 150, 40)

    def logits(kv_cache_dtype):
        runner = ModelRunner(model, num_blocks=6, block_size=16, kv_cache_dtype=kv_cache_dtype)
        runner.logits(tokens[:39], StepMetadata.build([39], [39], [[4, 1, 3]], 16))
        return backend.to_host(runner.logits(tokens[39:], StepMetadata.build([1], [40], [[4, 1, 3]], 16)))

    assert 0 < nmse(logits("int8"), logits(None)) < QUANTIZED_KV_MODEL_NMSE_THRESHOLDS["int8"]


def test_llm_fits_more_blocks_of_an_int8_cache_in_the_same_memory_and_generates(checkpoint):
    full = LLM(checkpoint, backend="cpu", kvcache_mem_gpu=1, kvcache_mem_cpu=0)
    quantized = LLM(checkpoint, backend="cpu", kv_cache_dtype="int8", kvcache_mem_gpu=1, kvcache_mem_cpu=1)
    spec = quantized.engine.runner.kv_spec
    assert spec.dtype == "int8" and quantized.engine.runner.caches[0].key.dtype == np.int8
    assert quantized.engine.config.num_blocks == 2**20 // spec.bytes_per_block
    assert quantized.engine.config.num_blocks > 3 * full.engine.config.num_blocks  # 20 bytes a row, not 64
    out = quantized.generate([[5, 9, 23, 42]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                             progress=False)
    assert len(out[0].outputs[0].token_ids) == 6
