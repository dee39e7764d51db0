"""The KV cache's dtype (declared per backend, chosen with kv_cache_dtype) and its size (megabytes
when given, else a share of the backend's free memory, capped at what the engine can fill)."""

from dataclasses import replace

import numpy as np
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.backends.metal import MetalBackend
from candelabra.conformance.compare import nmse
from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.llm import LLM
from candelabra.core.loading.model import load_model
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from candelabra.core.worker.kv_cache_size import blocks_in, device_cache_size, one_block
from candelabra.core.worker.model_runner import ModelRunner
from live_server import LiveServer, write_chat_checkpoint
from support import run_candelabra

MIB = 2**20
needs_metal = pytest.mark.skipif(not MetalBackend.probe().available, reason="MLX is not installed")


class SixtyFourMiBFree(CpuBackend):
    """The numpy backend on a machine with 64 MiB free, so that shares of it are known exactly."""

    name = "cpu-64mib"

    def free_memory(self) -> int:
        return 64 * MIB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(folder, seed=7)
    return folder


def block_bytes(llm) -> int:
    return llm.engine.runner.kv_spec.bytes_per_block


# dtype

def test_a_backend_keeps_its_cache_in_the_compute_dtype_unless_it_declares_more():
    assert CpuBackend.kv_cache_dtypes("float32") == ("float32", "int8")
    assert CpuBackend.check_kv_cache_dtype("float32", "float32") == "float32"
    with pytest.raises(ValueError) as caught:
        CpuBackend.check_kv_cache_dtype("float16", "float32")
    assert str(caught.value) == "backend 'cpu' computing in float32 keeps its KV cache in float32, int8, not float16"
    assert MetalBackend.kv_cache_dtypes("float32") == ("float32", "float16", "bfloat16")
    assert MetalBackend.kv_cache_dtypes("bfloat16")[0] == "bfloat16"


def test_llm_refuses_a_kv_cache_dtype_the_backend_does_not_declare(checkpoint):
    with pytest.raises(ValueError, match="backend 'cpu' computing in float32 keeps its KV cache in float32, int8, "
                                         "not bfloat16"):
        LLM(checkpoint, backend="cpu", kv_cache_dtype="bfloat16", kvcache_mem_gpu=1, kvcache_mem_cpu=0)


@pytest.mark.parametrize("flag, dtype", [("f16", "float16"), ("fp8", "fp8")])
def test_serve_refuses_a_kv_cache_dtype_before_loading(checkpoint, flag, dtype):
    result = run_candelabra("serve", "--weight-path", str(checkpoint), "--backend", "cpu", "--kv-cache-dtype", flag,
                            "--port", "0")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == ("error: backend 'cpu' computing in float32 keeps its KV cache in "
                                              f"float32, int8, not {dtype}")


@needs_metal
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_float32_model_over_a_half_precision_cache_gives_nearly_the_same_logits(checkpoint, kv_dtype):
    backend = MetalBackend()
    model = load_model(SafetensorsCheckpoint(checkpoint), backend, "float32")
    tokens = np.random.default_rng().integers(3, 150, 40)

    def logits(kv_cache_dtype):
        runner = ModelRunner(model, num_blocks=6, block_size=16, kv_cache_dtype=kv_cache_dtype)
        runner.logits(tokens[:39], StepMetadata.build([39], [39], [[4, 1, 3]], 16))
        decoded = runner.logits(tokens[39:], StepMetadata.build([1], [40], [[4, 1, 3]], 16))
        assert backend.dtype_of(runner.caches[0].key) == runner.kv_spec.dtype == (kv_cache_dtype or "float32")
        return backend.to_host(decoded)

    exact, rounded = logits(None), logits(kv_dtype)
    # keys and values rounded to 11 (float16) or 8 (bfloat16) bits change the logits that little, not more
    assert 0 < nmse(rounded, exact) < (1e-5 if kv_dtype == "float16" else 1e-3)


@needs_metal
def test_llm_generates_over_a_float16_cache_of_half_the_size(checkpoint):
    full = LLM(checkpoint, backend="metal", dtype="float32", kvcache_mem_gpu=1, kvcache_mem_cpu=0)
    half = LLM(checkpoint, backend="metal", dtype="float32", kv_cache_dtype="float16", kvcache_mem_gpu=1,
               kvcache_mem_cpu=1)
    assert half.engine.runner.kv_spec.dtype == "float16" and block_bytes(half) * 2 == block_bytes(full)
    assert half.engine.config.num_blocks == 2 * full.engine.config.num_blocks
    out = half.generate([[5, 9, 23, 42]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        progress=False)
    assert len(out[0].outputs[0].token_ids) == 6


# size

def test_an_explicit_size_in_megabytes_wins_over_a_fraction(checkpoint):
    llm = LLM(checkpoint, backend=SixtyFourMiBFree, kvcache_mem_gpu=1, kv_fraction=0.5, kvcache_mem_cpu=0)
    assert llm.engine.config.num_blocks == MIB // block_bytes(llm)
    assert llm.kv_cache_chosen_by == "kvcache_mem_gpu 1 MB"


@pytest.mark.parametrize("fraction, chosen_by", [
    (0.5, "0.5 of the 64 MiB free on cpu-64mib (kv_fraction)"),
    (None, "0.25 of the 64 MiB free on cpu-64mib (the backend's default share)"),
])
def test_without_megabytes_the_cache_takes_a_share_of_the_free_memory(checkpoint, fraction, chosen_by):
    llm = LLM(checkpoint, backend=SixtyFourMiBFree, kv_fraction=fraction, kvcache_mem_cpu=0, max_num_seqs=256)
    share = fraction or 0.25
    assert llm.engine.config.num_blocks == int(share * 64 * MIB) // block_bytes(llm)
    assert llm.kv_cache_chosen_by == chosen_by


def test_a_share_is_capped_at_what_the_running_sequences_can_fill(checkpoint):
    llm = LLM(checkpoint, backend=SixtyFourMiBFree, kv_fraction=1.0, kvcache_mem_cpu=0, max_num_seqs=3,
              max_model_len=100)
    assert llm.engine.config.num_blocks == 3 * 7  # 100 tokens take 7 blocks of 16
    assert llm.kv_cache_chosen_by.endswith(", capped at what 3 sequences of 100 tokens can fill")


def test_shares_that_are_not_shares_and_memory_that_holds_no_block_are_refused(checkpoint):
    model = LLM(checkpoint, backend="cpu", kvcache_mem_gpu=1, kvcache_mem_cpu=0).model
    block = one_block(model, 16, "float32")
    for fraction in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match=f"kv_fraction is a share of the free memory, more than 0 and at most 1, "
                                             f"not {fraction:g}"):
            device_cache_size(SixtyFourMiBFree(), block, None, fraction, 8, 512)

    class NothingFree(CpuBackend):
        def free_memory(self):
            return block.bytes_per_block - 1

    with pytest.raises(ValueError, match=r"the KV cache, 1 of the 0 MiB free on cpu, holds no block: one block of "
                                         r"16 tokens takes .* MB; give kvcache_mem_gpu in MB"):
        device_cache_size(NothingFree(), block, None, 1.0, 8, 512)


def test_serve_says_how_it_sized_the_kv_cache_and_its_dtype(tmp_path):
    folder = write_chat_checkpoint(tmp_path)
    with LiveServer("--weight-path", str(folder), "--backend", "cpu", "--kv-fraction", "0.5", "--max-num-seqs", "2",
                    "--max-model-len", "64", "--kvcache-mem-cpu", "0", "--kv-cache-dtype", "int8") as server:
        startup = server.startup
    assert "KV cache  128 tokens (8 blocks of 16, 0 MiB in int8)" in startup
    assert "sized by 0.5 of the " in startup
    assert " free on cpu (kv_fraction), capped at what 2 sequences of 64 tokens can fill" in startup


# what the backend chooses

class SmallStepsFixedMemory(CpuBackend):
    """The numpy backend as a device whose cache memory is its own from the start, preferring small steps."""

    name = "cpu-small-steps"

    def kv_cache_committed_on_write(self) -> bool:
        return False

    def max_num_batched_tokens(self) -> int:
        return 96


def test_the_backend_chooses_the_step_budget_and_block_order_the_user_leaves_unset(checkpoint):
    chosen = LLM(checkpoint, backend=SmallStepsFixedMemory, kvcache_mem_gpu=1, kvcache_mem_cpu=0,
                 max_num_batched_tokens=None)
    assert chosen.engine.config.max_num_batched_tokens == 96
    assert chosen.engine.core.blocks.reuse_written_first is False
    assert LLM(checkpoint, backend="cpu", kvcache_mem_gpu=1).engine.core.blocks.reuse_written_first is True

    given = LLM(checkpoint, backend=SmallStepsFixedMemory, kvcache_mem_gpu=1, kvcache_mem_cpu=0,
                max_num_batched_tokens=300, reuse_written_blocks_first=True)
    assert given.engine.config.max_num_batched_tokens == 300 and given.engine.core.blocks.reuse_written_first
    # Without chunked prefill a step must hold a whole prompt, so the backend's budget does not apply.
    whole = LLM(checkpoint, backend=SmallStepsFixedMemory, kvcache_mem_gpu=1, kvcache_mem_cpu=0, prefill_chunk_size=0,
                max_model_len=512)
    assert whole.engine.config.max_num_batched_tokens == 2048


def test_kv_cache_spec_sizes_blocks_from_memory():
    spec = KVCacheSpec(num_layers=24, num_blocks=1, block_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    assert spec.bytes_per_block == 24 * 2 * 16 * 2 * 64 * 2
    blocks = blocks_in(512, spec, "kvcache_mem_gpu")
    assert blocks == 512 * 2**20 // spec.bytes_per_block
    assert replace(spec, num_blocks=blocks).capacity_tokens == blocks * 16
    with pytest.raises(ValueError, match=r"kvcache_mem_gpu \(0.001 MB\) holds no KV cache block"):
        blocks_in(0.001, spec, "kvcache_mem_gpu")
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        KVCacheSpec(1, 1, 16, 0, 64)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'float8'; expected one of float32, float16, bfloat16, "
                                         "int8, fp8"):
        KVCacheSpec(1, 1, 16, 1, 64, "float8")
