"""The cuda backend as a whole: what it says where it cannot run, the whole op conformance level
on the GPU or through the Triton interpreter on CPU tensors, and decode steps through the persistent
padded buffers the CUDA graphs replay."""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from candelabra.backends.cuda import availability
from candelabra.backends.cuda.backend import CudaBackend
from candelabra.backends.cuda.graphs import capture_size
from candelabra.backends.cuda.quantized import INT4_FORMATS
from candelabra.backends.torch.backend import TorchBackend
from candelabra.core.contract.ops import OP_NAMES
from support import run_candelabra

pytestmark = pytest.mark.skipif(not CudaBackend.probe().available, reason=CudaBackend.probe().reason)


def fake_torch(cuda_version, available=False, count=0):
    cuda = SimpleNamespace(is_available=lambda: available, device_count=lambda: count)
    return SimpleNamespace(version=SimpleNamespace(cuda=cuda_version), cuda=cuda, __version__="2.13.0")


def test_a_cpu_build_of_torch_is_named_as_the_reason():
    reason = availability.cuda_missing(fake_torch(None))
    assert reason.startswith("torch has no CUDA") and "CPU build" in reason and "TRITON_INTERPRET=1" in reason


def test_no_visible_device_is_named_with_the_variable_read(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = availability.cuda_missing(fake_torch("13.0"))
    assert reason.startswith("no CUDA device") and "CUDA_VISIBLE_DEVICES=''" in reason


def test_a_visible_device_is_no_reason():
    assert availability.cuda_missing(fake_torch("13.0", available=True, count=1)) is None


def test_listed_as_unavailable_without_the_interpreter_on_a_machine_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    listed = run_candelabra("backends", "--json")  # as a user runs it: without this process's TRITON_INTERPRET
    assert listed.returncode == 0, listed.stderr
    cuda = next(b for b in json.loads(listed.stdout)["backends"] if b["name"] == "cuda")
    assert cuda["available"] is False and "torch has no CUDA" in cuda["detail"]


def test_the_interpreter_runs_in_float32_and_float16_and_auto_never_picks_it():
    if not availability.interpreting():
        pytest.skip("the kernels run on the GPU here")
    probe = CudaBackend.probe()
    assert probe.priority < 10 and "interpreter" in probe.detail
    assert CudaBackend.dtypes == ("float32", "float16")
    assert all(CudaBackend().ops.supports(op) for op in OP_NAMES)


def test_the_cuda_backend_never_says_it_rounds_activations_though_the_cpu_kernels_may(monkeypatch):
    monkeypatch.setenv("CANDELABRA_INT8_ACTIVATIONS", "1")
    assert CudaBackend().activation_rounding() is None
    assert TorchBackend().activation_rounding() == "int8"


# The interpreter runs one Python thread: the level is run as two processes at once, paged_attention
# (the longest part) and the rest, which halves the wait on a 2-core CI machine. Both run float16 only,
# and attention at head size 128 (the one most models serve at) and 16-token blocks only, but for its
# soft-cap cases (head size 256); tests/test_cuda_paged_attention.py runs head sizes 64, 80 and 256
# against the float64 oracle. The kernels' own tests run every
# kernel against the float64 oracle in float32 and float16 (tests/test_cuda_*.py, attention at 32-token
# blocks and other cache dtypes too), and the float32 half of the level cost CI about 300 s of the 30
# minutes it must stay under. float16 with a float32 cache takes the float32-dot tiles here too. Of the
# quantized caches' cases only int8's writes, copies and swaps run: their attention and fused rotary
# cases took 160 s here for int8 alone, and tests/test_cuda_quantized_kv.py checks those kernels (int8
# and fp8) against the float64 oracle on the decoded bytes.
# Grouped int4 weights (GPTQ, AWQ) are expanded to the GGUF formats' groups of 32 for the same GEMM: the
# level runs INT4_G128 (an act-order case among them); test_cuda_int4_matmul converts every group size.
# Quantized LM heads and Q4_0 or INT4_G128 experts go through that GEMM at other shapes (30 to 60 s).
INTERPRETED_INT4_FORMATS = frozenset(INT4_FORMATS) - {"INT4_G32", "INT4_G64", "INT4_G256"}
LEFT_TO_KERNEL_TESTS = ("(int8 and (paged_attention or rotary or latent)) or fp8 or int4_g32 or int4_g64 or int4_g256 "
                        "or (format and lm_head) or (moe_experts and (q4_0 or int4_g128))")
INTERPRETER_SHARDS = (f"paged_attention-float16 and ((128-heads and 16-batch) or softcap) "
                      f"and not ({LEFT_TO_KERNEL_TESTS})",
                      f"not paged_attention and float16 and not ({LEFT_TO_KERNEL_TESTS})")


@pytest.mark.slow
def test_every_op_case_passes_on_the_gpu_or_through_the_interpreter(tmp_path):
    """`candelabra conformance --backend cuda --level ops`, where this process runs the kernels: every
    Triton kernel in float16 (see INTERPRETER_SHARDS), every GGUF format through `linear`. CI runs it
    without a GPU, on CPU tensors through the interpreter (TRITON_INTERPRET=1, inherited)."""
    runs = []
    for index, selection in enumerate(INTERPRETER_SHARDS):
        results = tmp_path / f"cuda-{index}.json"
        command = [sys.executable, "-m", "candelabra.core.cli", "conformance", "--backend", "cuda", "--level", "ops",
                   "--json", str(results), "--", "-k", selection]
        runs.append((results, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    cases = []
    for results, run in runs:
        output, _ = run.communicate(timeout=2400)
        assert run.returncode == 0, output[-5000:]
        cases += json.loads(results.read_text())["cases"]

    assert cases and {case["status"] for case in cases} == {"passed"}
    assert {case["op"] for case in cases} >= set(OP_NAMES)
    assert {case["dtype"] for case in cases if case["op"] != "write_kv"} == {"float16"}
    formats = {case["weight_format"] for case in cases if case["weight_format"]}
    assert formats >= INTERPRETED_INT4_FORMATS


def test_capture_sizes_pad_up_and_stop_at_the_largest():
    assert [capture_size(n, 64) for n in (1, 3, 8, 9, 17, 64, 65)] == [1, 4, 8, 16, 24, 64, None]


@pytest.mark.parametrize("scheduled_ahead", [False, True])
def test_decodes_through_the_graph_buffers_generate_what_the_reference_does(tiny_llm, scheduled_ahead):
    """The steps a CUDA graph replays, run op by op on its persistent padded buffers (capture=False):
    the start-up warm-up runs every size a batch of three pads to and writes nothing to the cache;
    then the decodes of three sequences refill the buffers of four with new lengths at every step,
    and every token matches the numpy reference's. Scheduled ahead, each step's tokens are copied into
    the buffers on the device from the samples of the step before, which the host has not seen yet."""
    from candelabra.backends.cuda.graphs import CudaGraphExecutor
    from candelabra.core.requests.sampling_params import SamplingParams

    prompts = [[5, 9, 23, 42, 7, 11], [3, 4], list(range(7, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    reference = tiny_llm(seed=13).generate(prompts, params, progress=False)

    # Scheduled ahead, the long prompt is prefilled in chunks beside the others' decodes: those mixed steps run
    # op by op and take their pending tokens on the device too.
    ahead = dict(async_scheduling=True, prefill_chunk_size=8, max_num_batched_tokens=16) if scheduled_ahead else {}
    llm = tiny_llm(seed=13, backend=CudaBackend, dtype="float32", **ahead)
    executor = CudaGraphExecutor(llm.backend, llm.model, capture=False)
    fed = []
    if scheduled_ahead:
        run = executor.run
        executor.run = lambda inputs, caches, feed=None: fed.append(feed) or run(inputs, caches, feed)
    runner = llm.engine.runner
    runner.executor = executor
    before = [(cache.key.clone(), cache.value.clone()) for cache in runner.caches]
    runner.warm_up(max_num_seqs=3)
    assert set(executor._static) == {(1, 16), (2, 16), (4, 16)}, "every size up to three sequences pad to"
    for (key, value), cache in zip(before, runner.caches):
        torch.testing.assert_close(cache.key, key, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(cache.value, value, rtol=0, atol=0, equal_nan=True)
    ours = llm.generate(prompts, params, progress=False)

    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]
    if scheduled_ahead:  # every token after a sequence's first came from the step before, some beside a chunk
        counts = [len(feed.positions) for feed in fed if feed is not None]
        assert sum(counts) == len(prompts) * (params.max_tokens - 1) and min(counts) < len(prompts) < max(counts) + 1

    def logprobs(outputs):
        return np.array([[entry.logprob for entry in o.outputs[0].logprobs] for o in outputs])

    np.testing.assert_allclose(logprobs(ours), logprobs(reference), rtol=1e-4, atol=1e-5)


def test_tensor_parallel_steps_and_the_flag_run_without_graphs_and_say_why():
    from types import SimpleNamespace

    from candelabra.backends.cuda.backend import why_no_graphs

    assert why_no_graphs("cuda", False, None) is None
    assert why_no_graphs("cuda", False, SimpleNamespace(world_size=1)) is None
    assert "--disable-cuda-graph" in why_no_graphs("cuda", True, None)
    assert "tensor parallelism over 2 ranks" in why_no_graphs("cuda", False, SimpleNamespace(world_size=2))
    assert "interpreter" in why_no_graphs("cpu", False, None)
    assert "experts in host memory" in why_no_graphs("cuda", False, None, offloads_experts=True)
    assert "quantized one by one" in why_no_graphs("cuda", False, None, quantized_experts=True)


def test_int4_experts_are_kept_one_int4_weight_per_expert_and_other_formats_as_one_dense_tensor():
    """The int4 GEMM takes each expert's rows as it takes a linear weight's; formats it has no kernel for are
    dequantized, as linear weights of those formats are."""
    from candelabra.backends.cuda.quantized import Int4CudaWeight
    from candelabra.backends.torch.expert_weights import ExpertWeights
    from candelabra.conformance.quantized_weights import random_quantized
    from candelabra.core.contract.weights import QuantizedTensor, WeightRole

    rng = np.random.default_rng(3)
    backend = CudaBackend()
    int4 = QuantizedTensor.stack([random_quantized(rng, "Q4_K", 64, 256) for _ in range(3)])
    kept = backend.upload_weight("experts.down_proj", WeightRole.EXPERTS, int4, "float32")
    assert isinstance(kept, ExpertWeights) and kept.shape == (3, 64, 256)
    assert all(isinstance(expert, Int4CudaWeight) for expert in kept.experts)
    int8 = QuantizedTensor.stack([random_quantized(rng, "Q8_0", 64, 256) for _ in range(3)])
    dense = backend.upload_weight("experts.down_proj", WeightRole.EXPERTS, int8, "float32")
    assert isinstance(dense, torch.Tensor) and dense.shape == (3, 64, 256)
    np.testing.assert_array_equal(dense.cpu().numpy(), int8.dequantize())
