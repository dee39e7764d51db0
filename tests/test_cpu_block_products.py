"""GGUF weights multiplied as stored by the C kernels of backends/torch/cpu/block_products.py, against a float64
product of the weight gguf decodes."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from candelabra.backends.torch.cpu import block_products, kernel_build, kernel_library
from candelabra.backends.torch.cpu.block_products import NATIVE_FORMATS, NativeBlocksWeight, native_blocks_available
from candelabra.backends.torch.cpu.features import cpu_flags
from candelabra.backends.torch.kernel_table import INT8_ACTIVATIONS_VARIABLE
from candelabra.conformance.compare import QUANTIZED_NMSE_THRESHOLDS
from candelabra.conformance.quantized_weights import random_quantized

pytestmark = pytest.mark.skipif(kernel_build.find_compiler() is None,
                                reason="no C compiler (cc, gcc or clang): the install built no kernels")

# A float32 kernel's error is its rounding (about 1e-14 here); a wrong decode is far above this.
FLOAT32_NMSE = 1e-9
# bfloat16 and float16 round x @ W.T itself: about 3e-6 and 1e-8 NMSE
ROUNDED_NMSE = {torch.bfloat16: 3e-5, torch.float16: 1e-6}
OUT_ROWS = 91  # no multiple of a tile or a thread's share, and enough rows (x 768) for two threads


def columns(format: str) -> int:
    """A width that is not a multiple of 256 where the format's blocks allow it."""
    return 768 if format.endswith("_K") else 800


def nmse(output: torch.Tensor, reference: np.ndarray) -> float:
    return float(np.sum(np.square(output.double().numpy() - reference)) / np.sum(np.square(reference)))


def weight_and_values(format: str, seed: int, dtype: torch.dtype = torch.float32, rows: int = OUT_ROWS):
    weight = random_quantized(np.random.default_rng(seed), format, rows, columns(format))
    return NativeBlocksWeight.from_quantized(weight, dtype), weight.dequantize().astype(np.float64)


def random_x(seed: int, rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, width))).to(dtype)


@pytest.fixture(scope="module", autouse=True)
def built():
    available, detail = native_blocks_available()
    assert available, detail  # a compiler exists (else skipped), so the install built them


@pytest.mark.parametrize("rows", [1, 3, 13, 40])
@pytest.mark.parametrize("format", sorted(NATIVE_FORMATS))
def test_the_float_kernel_multiplies_to_float32_rounding(format, rows):
    kept, values = weight_and_values(format, seed=rows)
    x = random_x(100 + rows, rows, kept.shape[1])
    assert nmse(kept.kernels()["blocks_float"](x), x.double().numpy() @ values.T) <= FLOAT32_NMSE


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("format", sorted(NATIVE_FORMATS))
def test_the_int8_kernel_stays_within_the_formats_conformance_threshold(format, rows):
    kept, values = weight_and_values(format, seed=rows)
    x = random_x(100 + rows, rows, kept.shape[1])
    error = nmse(kept.kernels()["blocks_int8"](x), x.double().numpy() @ values.T)
    # rounding x to int8 in blocks of 32 costs about 3e-5 to 6e-5 on these weights: far from zero, as
    # a kernel that silently ran in float would be
    assert 1e-6 < error <= QUANTIZED_NMSE_THRESHOLDS[format]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("format", ["Q5_0", "Q6_K", "Q4_1"])
def test_both_kernels_take_and_give_the_compute_dtype(format, dtype):
    kept, values = weight_and_values(format, seed=5, dtype=dtype)
    x = random_x(6, 5, kept.shape[1], dtype)
    reference = x.double().numpy() @ values.T
    for name, kernel in kept.kernels().items():
        out = kernel(x)
        assert out.dtype == dtype and out.shape == (5, OUT_ROWS)
        budget = ROUNDED_NMSE[dtype] + (QUANTIZED_NMSE_THRESHOLDS[format] if name == "blocks_int8" else 0)
        assert nmse(out, reference) <= budget, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rebuild_kernels_multiply_a_weight_decoded_slice_by_slice(dtype):
    kept, values = weight_and_values("Q6_K", seed=15, dtype=dtype, rows=1500)  # 1.2 Mi values: two slices
    assert kept.shape[0] * kept.shape[1] > block_products.REBUILD_SLICE_ELEMENTS
    x = random_x(16, 20, kept.shape[1], dtype)
    reference = x.double().numpy() @ values.T
    rebuilds = {name: kernel for name, kernel in kept.kernels().items() if name.startswith("blocks_rebuild")}
    expected = ["blocks_rebuild"] if dtype == torch.float32 else ["blocks_rebuild", "blocks_rebuild_f32"]
    assert sorted(rebuilds) == expected
    for name, kernel in rebuilds.items():
        out = kernel(x)
        assert out.dtype == dtype and nmse(out, reference) <= ROUNDED_NMSE.get(dtype, FLOAT32_NMSE), name


@pytest.mark.parametrize("format", ["Q4_K", "Q5_0"])
@pytest.mark.parametrize("kernel", ["blocks_float", "blocks_int8"])
def test_a_rows_product_depends_neither_on_its_batch_nor_on_the_thread_count(kernel, format):
    # 301 weight rows: some multiplied beside others (AVX-512's float kernel takes them 4 or 2 at a time)
    # and some alone
    kept, _ = weight_and_values(format, seed=7, rows=301)
    x = random_x(8, 13, kept.shape[1])  # a whole tile of 8 rows, one of 4 and one row
    multiply = kept.kernels()[kernel]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([multiply(x[i : i + 1]) for i in range(13)])
        torch.set_num_threads(2)
        together = multiply(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format", sorted(NATIVE_FORMATS))
def test_rows_and_dense_give_back_the_dequantized_values(format, dtype):
    kept, values = weight_and_values(format, seed=9, dtype=dtype)
    expected = torch.from_numpy(values.astype(np.float32)).to(dtype)
    ids = torch.tensor([[3, 0], [66, 3]])
    assert torch.equal(kept.rows(ids), expected[ids])
    assert torch.equal(kept.dense(), expected)
    assert torch.equal(kept.dense(10, 20), expected[10:20])
    assert kept.dense(OUT_ROWS - 7, OUT_ROWS + 33).shape == (7, kept.shape[1])


def test_a_row_outside_the_weight_is_an_index_error():
    kept, _ = weight_and_values("Q8_0", seed=10)
    with pytest.raises(IndexError):
        kept.rows(torch.tensor([0, OUT_ROWS]))


def test_the_weight_keeps_its_blocks_as_stored():
    weight = random_quantized(np.random.default_rng(11), "Q5_0", 16, 256)
    kept = NativeBlocksWeight.from_quantized(weight, torch.bfloat16)
    assert kept.shape == (16, 256) and kept.dtype == torch.bfloat16 and kept.form == "blocks"
    assert kept.nbytes == weight.blocks.nbytes == 16 * 8 * 22
    assert np.array_equal(kept.blocks.numpy(), weight.blocks)
    assert not np.shares_memory(kept.blocks.numpy(), weight.blocks)


def test_x_of_another_dtype_or_width_is_refused_before_the_kernel_reads_it():
    kept, _ = weight_and_values("Q8_0", seed=12)
    with pytest.raises(ValueError, match="contiguous"):
        kept.kernels()["blocks_float"](random_x(1, 2, kept.shape[1], torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        kept.kernels()["blocks_int8"](random_x(1, 2, kept.shape[1] - 32))


def test_the_kernels_run_on_torchs_openmp_runtime():
    """The library brings no OpenMP runtime of its own, and the one its symbols bind to is torch's."""
    loaded = kernel_library.kernels()
    assert loaded.library is not None, loaded.detail
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf to list the library's needs")
    needs = subprocess.run([readelf, "-d", str(kernel_library.library_path(next(
        v for v in kernel_build.VARIANTS if v.name == loaded.variant)))], capture_output=True, text=True).stdout
    assert "NEEDED" in needs and not re.search(r"NEEDED.*omp", needs), needs
    assert kernel_library.library_of_symbol(None, "GOMP_parallel") == kernel_library.torch_openmp_library()


def test_this_cpu_runs_its_widest_variant():
    flags = cpu_flags()
    expected = "avx512" if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags else (
        "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable")
    assert kernel_library.kernels().variant == expected
    assert native_blocks_available()[1].startswith(
        {"avx512": "avx-512 float, avx2+fma", "avx2": "avx2+fma", "portable": "portable C"}[expected])


# The code other machines run, each built at install where this machine's compiler targets it, and run
# here where this CPU has its flags: AVX2 without AVX-512 (AMD's Zen 3), and the portable C (no AVX2, or
# not x86).
@pytest.mark.parametrize("variant", [v.name for v in kernel_build.VARIANTS])
def test_every_variant_this_cpu_runs_agrees_with_the_oracle(variant):
    if variant not in {v.name for v in kernel_library.runnable_variants()}:
        pytest.skip(f"this CPU or machine does not run the {variant} kernels")
    build = kernel_library.kernels(variant)
    assert build.library is not None and build.variant == variant, build.detail
    for format in sorted(NATIVE_FORMATS):
        kept, values = weight_and_values(format, seed=13)
        kept._matmul, kept._decode = build.library.gguf_blocks_matmul, build.library.gguf_blocks_decode
        kept._matmul_normed, kept._matmul_gated = (build.library.gguf_blocks_matmul_normed,
                                                   build.library.gguf_blocks_matmul_gated)
        x = random_x(14, 13, kept.shape[1])  # tiles of 8, 4 and 1 rows
        reference = x.double().numpy() @ values.T
        assert nmse(kept.kernels()["blocks_float"](x), reference) <= FLOAT32_NMSE, format
        assert nmse(kept.kernels()["blocks_int8"](x), reference) <= QUANTIZED_NMSE_THRESHOLDS[format], format
        assert torch.equal(kept.dense(), torch.from_numpy(values.astype(np.float32))), format
        set_kernel(kept, "blocks_float")
        residual, norm_weight = random_x(15, 13, kept.shape[1]), torch.rand(kept.shape[1]) + 0.5
        normed, _ = normed_reference(x, residual, norm_weight, 1e-6, 0.0, values, torch.float32)
        assert nmse(kept.normed_matmul(x, residual, norm_weight, 1e-6)[0], normed) <= FLOAT32_NMSE, format
        gate, up = torch.cat([x, residual], dim=-1).double().chunk(2, dim=-1)
        gated = (gate * torch.sigmoid(gate) * up).numpy() @ values.T
        assert nmse(kept.gated_matmul(torch.cat([x, residual], dim=-1)), gated) <= FLOAT32_NMSE, format


@pytest.fixture
def fresh_load(monkeypatch):
    """kernels() answering afresh, with the libraries looked for where the test says; the real ones after."""
    kernel_library.forget()
    yield
    monkeypatch.undo()
    kernel_library.forget()


def test_a_library_not_built_at_install_is_a_reason_not_an_exception(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setattr(kernel_library, "library_path", lambda variant: tmp_path / variant.library_name)
    available, reason = native_blocks_available()
    assert not available and "were not built with this install" in reason and kernel_library.REBUILD in reason
    with pytest.raises(RuntimeError, match="not built"):
        NativeBlocksWeight.from_quantized(random_quantized(np.random.default_rng(1), "Q8_0", 4, 32), torch.float32)


def test_a_library_built_from_other_sources_is_not_loaded(fresh_load, monkeypatch):
    monkeypatch.setattr(kernel_build, "sources_digest", lambda: "0" * 24)
    available, reason = native_blocks_available()
    assert not available and "built from other sources" in reason


def test_a_compile_error_is_reported_and_leaves_no_library(monkeypatch, tmp_path):
    broken = tmp_path / "csrc"
    (broken / "arch").mkdir(parents=True)
    for name in ("block_products.c", "decode_attention.c"):
        (broken / name).write_text("this is not C\n")
    (broken / "arch" / "portable.c").write_text("int fine;\n")
    monkeypatch.setattr(kernel_build, "SOURCES", broken)
    target = tmp_path / "libcandelabra_cpu_portable.so"
    error = kernel_build.build(kernel_build.VARIANTS[-1], target)
    assert error and "block_products.c" in error and "error" in error
    assert not target.exists()


def test_a_missing_compiler_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(kernel_build, "find_compiler", lambda: None)
    assert "no C compiler" in kernel_build.build(kernel_build.VARIANTS[-1], tmp_path / "lib.so")
    error = kernel_build.build(kernel_build.VARIANTS[-1], tmp_path / "lib.so", compiler=str(tmp_path / "no-such-cc"))
    assert "no-such-cc" in error and not (tmp_path / "lib.so").exists()


@pytest.mark.parametrize("dtype, rounded, kernel", [
    (torch.float32, None, "blocks_float"), (torch.bfloat16, None, "blocks_float"),
    (torch.bfloat16, "0", "blocks_float"), (torch.float32, "1", "blocks_int8"), (torch.bfloat16, "1", "blocks_int8")])
def test_matmul_runs_the_exact_kernel_until_kernels_are_measured_unless_int8_activations_are_allowed(
        dtype, rounded, kernel, monkeypatch):
    if rounded is None:
        monkeypatch.delenv(INT8_ACTIVATIONS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(INT8_ACTIVATIONS_VARIABLE, rounded)
    kept, _ = weight_and_values("Q5_0", seed=17, dtype=dtype)
    x = random_x(18, 6, kept.shape[1], dtype).reshape(2, 3, -1)
    assert kept.choice.kernel_for(1) == kernel and kept.choice.kernels[-1].startswith("blocks_rebuild")
    assert torch.equal(kept.matmul(x), kept.kernels()[kernel](x.reshape(6, -1)).reshape(2, 3, -1))


def test_blocks_of_the_wrong_size_are_refused_before_any_kernel_reads_them():
    weight = random_quantized(np.random.default_rng(19), "Q6_K", 8, 256)
    short = torch.from_numpy(weight.blocks.reshape(-1)[:-1].copy())
    with pytest.raises(ValueError, match="Q6_K blocks of a 8 x 256 weight"):
        NativeBlocksWeight("Q6_K", short, (8, 256), torch.float32)


def set_kernel(kept: NativeBlocksWeight, kernel: str) -> None:
    from candelabra.backends.torch.kernel_table import ROW_BANDS, Choice

    kept.choice = Choice(kept.form, tuple(kernel for _ in ROW_BANDS))


def normed_reference(x, residual, norm_weight, eps, offset, values, dtype):
    """float64 RMS norm of x (+ residual, rounded to `dtype` as the sum is kept) times the weight's values."""
    summed = x.double() if residual is None else (x.double() + residual.double()).to(dtype).double()
    normed = summed / torch.sqrt(summed.square().mean(-1, keepdim=True) + eps) * (norm_weight.double() + offset)
    return normed.numpy() @ values.T, summed.to(dtype)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("dtype, kernel", [(torch.float32, "blocks_float"), (torch.bfloat16, "blocks_float"),
                                           (torch.float16, "blocks_float"), (torch.bfloat16, "blocks_int8")])
def test_the_norm_done_as_x_is_prepared_gives_the_normed_product_and_the_sum(dtype, kernel, rows, with_residual):
    kept, values = weight_and_values("Q5_0", seed=rows, dtype=dtype)
    set_kernel(kept, kernel)
    x = random_x(200 + rows, rows, kept.shape[1], dtype) * 3
    residual = random_x(300 + rows, rows, kept.shape[1], dtype) if with_residual else None
    norm_weight = (torch.rand(kept.shape[1], generator=torch.Generator().manual_seed(rows)) + 0.5).to(dtype)
    expected, expected_sum = normed_reference(x, residual, norm_weight, 1e-5, 1.0, values, dtype)

    out, joined = kept.normed_matmul(x, residual, norm_weight, 1e-5, offset=1.0)

    limit = FLOAT32_NMSE if dtype == torch.float32 else (
        QUANTIZED_NMSE_THRESHOLDS["Q5_0"] if kernel == "blocks_int8" else ROUNDED_NMSE[dtype])
    assert out.dtype == dtype and nmse(out, expected) <= limit
    assert torch.equal(joined, expected_sum if with_residual else x)


def test_the_normed_product_in_float32_is_the_torch_ops_product_to_rounding():
    from candelabra.backends.torch.ops import TorchOps
    from candelabra.core.contract.ops import Ops

    ops = TorchOps(torch.device("cpu"))
    kept, _ = weight_and_values("Q4_K", seed=5)
    set_kernel(kept, "blocks_float")
    x, residual = random_x(6, 4, kept.shape[1]), random_x(7, 4, kept.shape[1])
    norm_weight = torch.rand(kept.shape[1]) + 0.5

    fused = ops.rms_norm_linear(x, residual, norm_weight, 1e-6, kept)
    in_turn = Ops.rms_norm_linear(ops, x, residual, norm_weight, 1e-6, kept)

    assert torch.equal(fused[1], in_turn[1])
    assert torch.allclose(fused[0], in_turn[0], rtol=1e-5, atol=1e-5)


def test_no_norm_is_fused_where_another_kernel_was_chosen_or_the_inputs_do_not_fit():
    kept, _ = weight_and_values("Q5_0", seed=9)
    x, weight = random_x(1, 2, kept.shape[1]), torch.ones(kept.shape[1])
    set_kernel(kept, "blocks_rebuild")
    assert kept.normed_matmul(x, None, weight, 1e-6) is None
    set_kernel(kept, "blocks_float")
    assert kept.normed_matmul(x.to(torch.bfloat16), None, weight, 1e-6) is None
    assert kept.normed_matmul(x, x[:1], weight, 1e-6) is None
    assert kept.normed_matmul(x, None, weight[:-1], 1e-6) is None
    assert kept.normed_matmul(random_x(2, 3, kept.shape[1] + 5), None, weight, 1e-6) is None
    assert kept.normed_matmul(x, None, weight, 1e-6) is not None


@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("dtype, kernel", [(torch.float32, "blocks_float"), (torch.bfloat16, "blocks_float"),
                                           (torch.float16, "blocks_float"), (torch.bfloat16, "blocks_int8")])
def test_the_gate_done_as_x_is_prepared_gives_the_gated_product(dtype, kernel, rows):
    kept, values = weight_and_values("Q4_K", seed=rows, dtype=dtype)
    set_kernel(kept, kernel)
    x = random_x(400 + rows, rows, 2 * kept.shape[1], dtype) * 4  # gates from -16 to 16: silu's both ends
    gate, up = x.double().chunk(2, dim=-1)
    expected = (gate * torch.sigmoid(gate) * up).numpy() @ values.T

    out = kept.gated_matmul(x)

    limit = FLOAT32_NMSE if dtype == torch.float32 else (
        QUANTIZED_NMSE_THRESHOLDS["Q4_K"] if kernel == "blocks_int8" else ROUNDED_NMSE[dtype])
    assert out.dtype == dtype and out.shape == (rows, kept.shape[0]) and nmse(out, expected) <= limit


def test_the_gated_product_in_float32_is_the_torch_ops_product_to_rounding_and_others_are_not_fused():
    from candelabra.backends.torch.ops import TorchOps
    from candelabra.core.contract.ops import Ops

    ops = TorchOps(torch.device("cpu"))
    kept, _ = weight_and_values("Q6_K", seed=11)
    set_kernel(kept, "blocks_float")
    x = random_x(12, 5, 2 * kept.shape[1])

    assert torch.allclose(ops.gated_linear(x, kept), Ops.gated_linear(ops, x, kept), rtol=1e-5, atol=1e-5)
    assert kept.gated_matmul(x[:, 1:]) is None and kept.gated_matmul(x.to(torch.bfloat16)) is None
    set_kernel(kept, "blocks_rebuild")
    assert kept.gated_matmul(x) is None


def test_without_its_kernels_the_torch_backend_says_why_and_multiplies_on_torchs_ops(fresh_load, monkeypatch,
                                                                                       tmp_path):
    from candelabra.backends.torch.backend import TorchBackend
    from candelabra.core.contract.weights import WeightRole

    monkeypatch.setattr(kernel_library, "library_path", lambda variant: tmp_path / variant.library_name)
    assert "no C kernels, torch's own ops serve: the" in TorchBackend.probe().detail
    weight = random_quantized(np.random.default_rng(21), "Q5_0", 64, 256)
    kept = TorchBackend().upload_weight("w", WeightRole.LINEAR, weight, "float32")
    assert not isinstance(kept, NativeBlocksWeight)
    x = random_x(22, 3, 256)
    out = TorchBackend().ops.linear(x, kept)
    assert nmse(out, x.double().numpy() @ weight.dequantize().astype(np.float64).T) <= FLOAT32_NMSE
