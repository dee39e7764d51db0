"""The torch backend: its conformance, its choice of dtype, and what it does beyond the ops."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from candelabra.backends.torch.backend import TorchBackend
from candelabra.backends.torch.cpu.features import default_dtypes, has_native_bfloat16, parse_cpu_flags
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import OP_NAMES
from candelabra.core.contract.weights import QUANTIZED_FORMATS, WeightRole
from candelabra.plugins import backend_class
from support import needs_smaps, probe_without, run_candelabra


def test_torch_is_installed_available_and_implements_every_op():
    assert backend_class("torch") is TorchBackend
    probe = TorchBackend.probe()
    assert probe.available and probe.priority == 50 and f"torch {torch.__version__}" in probe.detail
    backend = TorchBackend()
    assert set(backend.dtypes) == {"float32", "float16", "bfloat16"}
    assert all(backend.ops.supports(op) for op in OP_NAMES)
    assert backend.quantized_formats == frozenset(QUANTIZED_FORMATS)


CACHE_RESIDENCY = """
import sys
sys.path.insert(0, sys.argv[1])
from support import resident_kib_at
from candelabra.backends.torch.backend import TorchBackend
from candelabra.core.contract.kv_cache import KVCacheSpec

backend = TorchBackend()
assert backend.kv_cache_committed_on_write() and backend.max_num_batched_tokens() == 512
spec = KVCacheSpec(num_layers=1, num_blocks=16384, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
key = backend.allocate_kv_cache(spec)[0].key  # 64 MiB, untouched
before = resident_kib_at(key.data_ptr(), key.numel() * 2)
key[:1024].fill_(1.0)  # 4 MiB written
print(before, resident_kib_at(key.data_ptr(), key.numel() * 2))
"""


@needs_smaps
def test_on_a_cpu_the_cache_is_committed_as_written_and_steps_are_small():
    """In a fresh process, as a server allocates its cache: one that has run many tests may have
    used up its memory mappings, and glibc then serves even a 64 MiB calloc from the heap."""
    run = subprocess.run([sys.executable, "-c", CACHE_RESIDENCY, str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    before, after = map(int, run.stdout.split())
    assert before < 8 * 1024 and 3 * 1024 < after < 12 * 1024, (before, after)


@pytest.mark.slow
def test_torch_passes_every_op_case_at_every_dtype(tmp_path):
    results = tmp_path / "torch.json"
    run = run_candelabra("conformance", "--backend", "torch", "--level", "ops", "--json", str(results))

    assert run.returncode == 0, run.stdout[-5000:] + run.stderr
    document = json.loads(results.read_text())
    assert {case["status"] for case in document["cases"]} == {"passed"}
    formats = {case["weight_format"] for case in document["cases"] if case["weight_format"]}
    assert formats == set(QUANTIZED_FORMATS)
    assert set(document["summary_by_dtype"]["paged_attention"]) == {"float32", "float16", "bfloat16"}


@pytest.mark.parametrize("cpuinfo, native", [
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", True),
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n", True),
    ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n", False),
    ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", True),
    ("processor\t: 0\nFeatures\t: fp asimd\n", False),
])
def test_bfloat16_is_the_default_only_where_the_cpu_computes_it(cpuinfo, native):
    assert has_native_bfloat16(parse_cpu_flags(cpuinfo)) is native
    assert default_dtypes(native)[0] == ("bfloat16" if native else "float32")
    assert set(default_dtypes(native)) == {"float32", "float16", "bfloat16"}


def test_this_machines_default_dtype_follows_its_cpu():
    assert TorchBackend.dtypes[0] == ("bfloat16" if has_native_bfloat16() else "float32")


def test_start_up_uses_every_core_and_says_which_dtype_and_why(caplog):
    import logging
    import os

    with caplog.at_level(logging.INFO, logger="candelabra"):
        TorchBackend()
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"default dtype {TorchBackend.dtypes[0]}" in message and "threads" in message


def test_probe_explains_a_missing_torch():
    first, second = probe_without("torch", "candelabra.backends.torch.backend:TorchBackend")
    assert first.startswith("False torch is not installed") and "pip install 'candelabra[torch]'" in first
    assert second.startswith("refused: torch is not installed")


@pytest.mark.parametrize("format", ["Q4_K", "Q4_0", "Q5_0"])
def test_a_quantized_weight_is_kept_in_the_form_the_kernel_table_names_here(format, tmp_path, monkeypatch):
    from candelabra.backends.torch.kernel_table import isa_level, rows_for

    monkeypatch.setenv("CANDELABRA_KERNEL_TABLES", str(tmp_path))  # no tuned table: the one in code
    weight = random_quantized(np.random.default_rng(3), format, 64, 256)
    backend = TorchBackend()
    kept = backend.upload_weight("w", WeightRole.LINEAR, weight, "bfloat16")
    selector = backend.kernel_selector("bfloat16")
    selection = selector.selected[next(key for key in selector.selected if key[:2] == (format, (64, 256)))]
    assert kept.choice == selection.choice and kept.form == selection.choice.form
    assert selection.row in rows_for(format, "bfloat16", selector.activations, isa_level())
    assert not list(tmp_path.rglob("*.json"))  # nothing measured, nothing written


def test_in_float32_int8_formats_keep_their_exact_values(tmp_path, monkeypatch):
    """int8 rows would change the values: in float32 the weight is dense or its blocks as stored."""
    monkeypatch.setenv("CANDELABRA_CACHE", str(tmp_path))
    weight = random_quantized(np.random.default_rng(3), "Q5_0", 64, 256)
    kept = TorchBackend().upload_weight("w", WeightRole.LINEAR, weight, "float32")
    assert getattr(kept, "form", "plain") in ("plain", "dense", "blocks")
    values = kept if isinstance(kept, torch.Tensor) else kept.dense()
    assert values.dtype == torch.float32 and np.array_equal(values.numpy(), weight.dequantize())


def test_a_tied_lm_head_is_the_embedding_tensor_itself():
    backend = TorchBackend()
    table = np.random.default_rng(4).standard_normal((32, 16), dtype=np.float32)
    embedding = backend.upload_weight("model.embed_tokens.weight", WeightRole.EMBEDDING, table, "bfloat16")
    assert backend.upload_weight("model.embed_tokens.weight", WeightRole.LM_HEAD, table, "bfloat16") is embedding
    other = backend.upload_weight("model.embed_tokens.weight", WeightRole.LM_HEAD, table.copy(), "bfloat16")
    assert other is not embedding and torch.equal(other, embedding)


@pytest.mark.parametrize("format, dtype, forms", [("Q8_0", "bfloat16", {"blocks", "int8", "dense"}),
                                                   ("Q4_K", "bfloat16", {"blocks", "int4", "dense"}),
                                                   ("Q8_0", "float32", {"blocks", "plain"})])
def test_a_quantized_embedding_is_kept_in_a_readable_form_and_shared_with_a_tied_lm_head(format, dtype, forms):
    backend = TorchBackend()
    assert WeightRole.EMBEDDING in backend.quantized_roles
    table = random_quantized(np.random.default_rng(5), format, 48, 256)
    embedding = backend.upload_weight("model.embed_tokens.weight", WeightRole.EMBEDDING, table, dtype)
    assert getattr(embedding, "form", "plain") in forms
    assert backend.upload_weight("model.embed_tokens.weight", WeightRole.LM_HEAD, table, dtype) is embedding
    ids = torch.tensor([[3, 47, 0], [3, 12, 9]])
    rows = backend.ops.embedding(ids, embedding).float().numpy()
    dequantized = table.dequantize()[ids.numpy()]
    assert rows.shape == (2, 3, 256)
    assert np.sum(np.square(rows - dequantized)) / np.sum(np.square(dequantized)) < 3e-4


def test_fetch_from_device_memory_packs_every_result_into_one_copy():
    """The packing a device with memory of its own uses, run on CPU tensors: every dtype and shape
    comes back as `to_host` gives it."""
    backend = TorchBackend()
    rng = np.random.default_rng(5)
    tensors = (torch.from_numpy(rng.integers(0, 150_000, 7, dtype=np.int32)),
               torch.from_numpy(rng.standard_normal(7, dtype=np.float32)),
               torch.from_numpy(rng.integers(0, 150_000, (7, 3), dtype=np.int32)),
               torch.from_numpy(rng.standard_normal((7, 0), dtype=np.float32)),
               torch.from_numpy(rng.standard_normal((2, 5), dtype=np.float32)).to(torch.bfloat16))
    backend.torch_device = torch.device("meta")  # anything but "cpu" takes the packing path
    packed = backend.fetch(*tensors)
    for got, tensor in zip(packed, tensors):
        expected = tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        assert got.dtype == expected.dtype and got.shape == expected.shape and np.array_equal(got, expected)


def test_swap_space_is_host_memory_in_the_cache_dtype():
    backend = TorchBackend()
    spec = KVCacheSpec(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    swap = backend.allocate_swap_space(spec)
    assert len(swap) == 2 and all(part.device.type == "cpu" and part.dtype == torch.bfloat16
                                  and tuple(part.shape) == spec.block_shape for layer in swap for part in layer)


@pytest.mark.slow
def test_torch_passes_the_models_and_engine_levels_in_bfloat16(tmp_path):
    results = tmp_path / "torch.json"
    # Of the GPTQ/AWQ cases only act-order's: the others differ in how their checkpoints are read, which
    # the float32 models level checks, not in what bfloat16 computes (CI's time).
    run = run_candelabra("conformance", "--backend", "torch", "--level", "models", "--level", "engine",
                         "--dtype", "bfloat16", "--json", str(results),
                         "--", "-k", "not (gptq and not act) and not awq")

    assert run.returncode == 0, run.stdout[-5000:] + run.stderr
    document = json.loads(results.read_text())
    assert document["dtype"] == "bfloat16"
    assert {case["status"] for case in document["models"]} == {"passed"}
    assert {case["status"] for case in document["engine"]} == {"passed"}


def test_conformance_refuses_a_dtype_the_backend_does_not_compute_in():
    run = run_candelabra("conformance", "--backend", "cpu", "--level", "engine", "--dtype", "bfloat16")
    assert run.returncode != 0
    assert "backend 'cpu' does not compute in bfloat16; it offers float32" in run.stdout + run.stderr


def test_batches_larger_than_a_sampling_chunk_draw_what_numpy_draws():
    """Rows are sampled in chunks; across chunk borders every row keeps its own parameters."""
    from candelabra.backends.cpu import sampling as numpy_sampling
    from candelabra.backends.torch.sampling import ROWS_PER_CHUNK, TorchSampling, sample
    from candelabra.core.contract.step_metadata import SamplingMetadata, pad_token_lists

    rng = np.random.default_rng(8)
    rows, vocab = 2 * ROWS_PER_CHUNK + 5, 3000
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    tokens = [rng.integers(0, vocab, rng.integers(0, 9)).tolist() for _ in range(rows)]
    meta = SamplingMetadata(
        temperature=rng.choice([0.0, 0.7, 1.3], rows).astype(np.float32),
        top_k=rng.choice([0, 5, 50], rows).astype(np.int32), top_p=rng.choice([1.0, 0.9], rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.05], rows).astype(np.float32),
        repetition_penalty=rng.choice([1.0, 1.2], rows).astype(np.float32),
        presence_penalty=rng.choice([0.0, 0.5], rows).astype(np.float32),
        frequency_penalty=rng.choice([0.0, 0.3], rows).astype(np.float32),
        penalty_tokens=pad_token_lists(tokens), output_tokens=pad_token_lists(tokens),
        bias_token_ids=pad_token_lists([[int(rng.integers(vocab))] for _ in range(rows)]),
        bias_values=rng.uniform(-5, 5, (rows, 1)).astype(np.float32),
        uniform=rng.random(rows, dtype=np.float32), num_top_logprobs=3)

    ours = sample(torch.from_numpy(logits), TorchSampling.prepare(meta, torch.device("cpu")))
    expected = numpy_sampling.sample(logits, meta)

    assert np.array_equal(ours.token_ids.numpy(), expected.token_ids)
    assert np.allclose(ours.logprobs.numpy(), expected.logprobs, atol=1e-4)
    assert np.array_equal(ours.top_token_ids.numpy(), expected.top_token_ids)


def test_memory_freed_while_loading_goes_back_to_the_os_at_warm_up():
    import psutil

    from candelabra.backends.torch.host_memory import keep_freed_memory_for_reuse

    backend = TorchBackend()
    if not keep_freed_memory_for_reuse():
        pytest.skip("the C library is not glibc: no mallopt, no malloc_trim")
    # 24 MiB blocks sit under the raised mmap threshold: freed, they stay in the heap
    blocks = [torch.ones(6 * 2**20, dtype=torch.float32) for _ in range(8)]
    del blocks
    kept = psutil.Process().memory_info().rss
    backend.step_executor(model=None).warm_up([], max_num_seqs=1)
    assert psutil.Process().memory_info().rss < kept - 100 * 2**20
