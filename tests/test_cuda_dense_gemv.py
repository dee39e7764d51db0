"""The 16-bit GEMV of the cuda backend, on the GPU or through the Triton interpreter, against the float64
product; and where the backend's linear takes it instead of cuBLAS: the GPU's dense table decides."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.availability import assume_gpu
from candelabra.backends.cuda.kernels import dense_gemv as kernel
from candelabra.backends.cuda.kernels import gemv_tilings, norms
from candelabra.backends.cuda.kernels.gemv_tilings import GemvTiling, table_file, write_table
from candelabra.backends.cuda.kernels.split_k import arrival_counts
from candelabra.conformance.compare import nmse, round_to
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

DEVICE = kernel_device()
GPU = "NVIDIA TEST-GPU"
# The interpreter gets bfloat16 arithmetic wrong (backend.py): float16 there, both on a GPU.
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# float16 x and weight, float32 sums, the output rounded to float16: about 1e-7 measured.
THRESHOLD = {torch.float16: 1e-6, torch.bfloat16: 3e-5}


def case(rng, rows: int, columns: int, width: int, dtype=torch.float16):
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    x = round_to(rng.standard_normal((rows, width)), name)
    weight = round_to(rng.standard_normal((columns, width)) / np.sqrt(width), name)
    expected = x.astype(np.float64) @ weight.astype(np.float64).T
    return (torch.from_numpy(x).to(DEVICE, dtype), torch.from_numpy(weight).to(DEVICE, dtype), expected)


def tiling(block_n=16, block_k=128, split_k=1, num_warps=2, num_stages=1) -> GemvTiling:
    return GemvTiling(block_n, block_k, split_k, num_warps, num_stages)


@skip_where_the_kernels_cannot_run()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stages", [1, 2], ids=["in-turn", "next-step-ahead"])
@pytest.mark.parametrize("split_k", [1, 4, 3])
def test_the_gemv_matches_the_float64_product(split_k, stages, dtype):
    # ragged columns (100 in tiles of 16), K = 1024 in 8 steps of 128 (2 a split in four; 3, 3 and 2 in three);
    # two rows
    rng = np.random.default_rng([split_k, stages])
    x, weight, expected = case(rng, 2, 100, 1024, dtype)
    out = kernel.dense_gemv(x, weight, tiling(split_k=split_k, num_stages=stages))
    assert out.dtype == dtype and out.shape == (2, 100)
    assert nmse(float64_values(out), expected) <= THRESHOLD[dtype]
    assert not arrival_counts(DEVICE, 1).any()  # the last split of each tile reset its count
    assert torch.equal(kernel.dense_gemv(x, weight, tiling(split_k=split_k, num_stages=stages)), out)


@skip_where_the_kernels_cannot_run()
@pytest.mark.parametrize("split_k", [1, 2])
def test_the_bias_is_added_as_the_output_is_written(split_k):
    rng = np.random.default_rng(3 + split_k)
    x, weight, expected = case(rng, 1, 40, 512)
    bias = round_to(rng.standard_normal(40), "float16")
    out = kernel.dense_gemv(x, weight, tiling(block_n=32, block_k=256, split_k=split_k),
                            torch.from_numpy(bias).to(DEVICE))
    assert nmse(float64_values(out), expected + bias) <= THRESHOLD[torch.float16]


@skip_where_the_kernels_cannot_run()
def test_a_weight_with_rows_apart_and_x_with_rows_apart():
    rng = np.random.default_rng(5)
    x, weight, _ = case(rng, 1, 24, 768)
    wide = torch.cat([weight, weight[:, :128]], dim=1)[:, :768]  # rows 896 apart, unit stride along K
    strided_x = torch.cat([x, x], dim=1)[:, 64:832]
    expected = float64_values(strided_x) @ float64_values(wide).T
    out = kernel.dense_gemv(strided_x, wide, tiling(block_n=8, block_k=256, split_k=3))
    assert nmse(float64_values(out), expected) <= THRESHOLD[torch.float16]


GATED = {"silu": lambda g: g / (1 + np.exp(-g)),
         "gelu": lambda g: 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2))),
         "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))}


@skip_where_the_kernels_cannot_run()
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("activation", list(GATED))
def test_a_gated_x_gives_the_product_of_its_gated_values_as_the_activation_kernel_rounds_them(activation, split_k):
    from candelabra.backends.cuda.kernels.activations import gelu_and_mul, silu_and_mul

    rng = np.random.default_rng([7, split_k, len(activation)])
    gate_up = round_to(2 * rng.standard_normal((1, 1024)), "float16")
    _, weight, _ = case(rng, 1, 72, 512)
    bias = (torch.from_numpy(round_to(rng.standard_normal(72), "float16")).to(DEVICE, torch.float16) if split_k == 2
            else None)
    gated = GATED[activation](gate_up[:, :512].astype(np.float64)) * gate_up[:, 512:]
    expected = round_to(gated, "float16").astype(np.float64) @ float64_values(weight).T
    if bias is not None:
        expected += float64_values(bias)
    x = torch.from_numpy(gate_up).to(DEVICE, torch.float16)
    layout = tiling(block_n=16, block_k=128, split_k=split_k)
    out = kernel.dense_gemv(x, weight, layout, bias, gated=activation)
    assert out.shape == (1, 72) and nmse(float64_values(out), expected) <= THRESHOLD[torch.float16]
    # the very values the activation's kernel stores, so the very product the GEMV gives of them
    activated = silu_and_mul(x) if activation == "silu" else gelu_and_mul(x, "tanh" if "tanh" in activation else "none")
    assert torch.equal(out, kernel.dense_gemv(activated, weight, layout, bias))


@skip_where_the_kernels_cannot_run()
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("residual", [True, False], ids=["plus-residual", "alone"])
def test_a_normed_x_gives_the_product_of_its_normalised_values_and_the_row_the_next_layer_adds_to(residual, split_k):
    rng = np.random.default_rng([11, split_k, residual])
    width, offset = 768, 1.0 if split_k == 3 else 0.0
    x = round_to(rng.standard_normal((1, width)), "float16")
    added = round_to(4 * rng.standard_normal((1, width)), "float16")
    norm_weight = round_to(0.2 * rng.standard_normal(width) + 1.0 - offset, "float16")
    _, weight, _ = case(rng, 1, 40, width)
    bias = torch.from_numpy(round_to(rng.standard_normal(40), "float16")).to(DEVICE, torch.float16)
    joined = round_to(x.astype(np.float64) + added, "float16").astype(np.float64) if residual else x.astype(np.float64)
    normed = joined / np.sqrt(np.mean(joined**2) + 1e-5) * (offset + norm_weight.astype(np.float64))
    expected = normed @ float64_values(weight).T + float64_values(bias)
    on_device = [torch.from_numpy(a).to(DEVICE, torch.float16) for a in (x, added, norm_weight)]
    norm = norms.RowNorm(on_device[2], 1e-5, offset, on_device[1] if residual else None)
    layout = tiling(block_n=16, block_k=128, split_k=split_k)  # 6 steps: 2 a split in three
    out, row = kernel.normed_dense_gemv(on_device[0], norm, weight, layout, bias)
    assert out.shape == (1, 40) and nmse(float64_values(out), expected) <= THRESHOLD[torch.float16]
    assert np.array_equal(float64_values(row), joined)  # rounded as add_rms_norm's sum, every element written
    assert (row is on_device[0]) == (not residual)  # no residual: the row is x itself
    assert not arrival_counts(DEVICE, 1).any()


def test_what_the_gemv_does_not_take_is_refused():
    x = torch.ones(1, 512, dtype=torch.float16)
    weight = torch.ones(8, 512, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 or bfloat16 x and weight of one dtype"):
        kernel.dense_gemv(x.float(), weight.float(), tiling())
    with pytest.raises(ValueError, match="does not match a weight"):
        kernel.dense_gemv(x, torch.ones(8, 256, dtype=torch.float16), tiling())
    with pytest.raises(ValueError, match="unit stride along K"):
        kernel.dense_gemv(x, torch.ones(512, 8, dtype=torch.float16).T, tiling())
    with pytest.raises(ValueError, match="must divide K = 512 into steps"):
        kernel.dense_gemv(x, weight, tiling(block_k=384))
    with pytest.raises(ValueError, match="split_k 4 split them with a step for each split"):
        kernel.dense_gemv(x, weight, tiling(block_k=256, split_k=4))  # two steps
    with pytest.raises(ValueError, match=r"the bias must be a contiguous \[8\]"):
        kernel.dense_gemv(x, weight, tiling(), torch.ones(9, dtype=torch.float16))
    # rows further apart than 32-bit offsets reach (on the meta device: nothing that large is allocated)
    far = torch.empty_strided((8, 512), (2**28, 1), dtype=torch.float16, device="meta")
    assert not kernel.fits(far) and kernel.fits(weight)
    with pytest.raises(ValueError, match="spans more than the GEMV's 32-bit offsets reach"):
        kernel.dense_gemv(x, far, tiling())
    with pytest.raises(ValueError, match="unknown gated activation 'relu'"):
        kernel.dense_gemv(x, torch.ones(8, 256, dtype=torch.float16), tiling(), gated="relu")
    with pytest.raises(ValueError, match=r"a gated x \[1, 512\] needs a weight \[N, 256\]"):
        kernel.dense_gemv(x, weight, tiling(), gated="silu")
    norm_weight = torch.ones(512, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"the residual \[1, 256\] torch.float16 does not match x \[1, 512\]"):
        kernel.normed_dense_gemv(x, norms.RowNorm(norm_weight, 1e-6, 0.0, torch.ones(1, 256, dtype=torch.float16)),
                                 weight, tiling())
    with pytest.raises(ValueError, match=r"the norm's weight \[256\] does not match x's width 512"):
        kernel.normed_dense_gemv(x, norms.RowNorm(norm_weight[:256], 1e-6), weight, tiling())


def test_the_gpus_dense_table_chooses_the_gemv_or_cublas_for_one_row(user_tables, monkeypatch):
    mine = tiling(block_n=32, block_k=256, split_k=2)
    write_table(table_file(user_tables, GPU, "dense"), GPU, {(64, 512): mine, (32, 512): None}, "by hand", "dense")
    one = torch.ones(1, 512, dtype=torch.float16)
    weight = torch.ones(64, 512, dtype=torch.float16)
    with assume_gpu(GPU):
        assert kernel.chosen_tiling(one, weight) == mine
        assert kernel.chosen_tiling(one.reshape(1, 1, 512), weight) == mine  # leading dims of one row
        assert kernel.chosen_tiling(torch.ones(2, 512, dtype=torch.float16), weight) is None
        assert kernel.chosen_tiling(one, torch.ones(32, 512, dtype=torch.float16)) is None  # cuBLAS was faster
        assert kernel.chosen_tiling(one, torch.ones(48, 512, dtype=torch.float16)) is None  # not measured
        assert kernel.chosen_tiling(one.float(), weight.float()) is None
        assert kernel.chosen_tiling(one, torch.ones(512, 64, dtype=torch.float16).T) is None
        far = torch.empty_strided((64, 512), (2**26, 1), dtype=torch.float16, device="meta")
        assert kernel.chosen_tiling(one, far) is None  # past the kernel's 32-bit offsets
        # a gated MLP's [gate | up] row: its gated half's width is the weight's
        assert kernel.chosen_tiling(torch.ones(1, 1024, dtype=torch.float16), weight, gated=True) == mine
        assert kernel.chosen_tiling(one, weight, gated=True) is None
        monkeypatch.setenv(kernel.SWITCH, "0")
        assert kernel.chosen_tiling(one, weight) is None
    assert kernel.chosen_tiling(one, weight) is None  # CPU tensors name no GPU


def test_a_dense_table_reads_back_with_cublas_entries_and_refuses_a_tiling_too_shallow(user_tables):
    path = table_file(user_tables, GPU, "dense")
    assert path.name == "nvidia-test-gpu.dense.json"
    write_table(path, GPU, {(64, 512): tiling(block_k=8), (32, 512): None}, "by hand", "dense")
    assert gemv_tilings.read_table(path, "dense") == {(64, 512): tiling(block_k=8), (32, 512): None}
    assert gemv_tilings.measured_tilings(GPU, "int4") == {}  # the int4 table is another file
    with pytest.raises(ValueError, match="names a tiling for every shape"):
        write_table(table_file(user_tables, GPU), GPU, {(32, 512): None}, "by hand")
    with pytest.raises(ValueError, match=r"block_k \(at least 32\)"):
        write_table(table_file(user_tables, GPU), GPU, {(64, 512): tiling(block_k=8)}, "by hand")
    with pytest.raises(ValueError, match="is not a table of int4 GEMV tilings"):
        gemv_tilings.read_table(path, "int4")


@skip_where_the_kernels_cannot_run()
def test_the_backends_linear_takes_the_gemv_where_the_table_says_and_cublas_elsewhere(user_tables, monkeypatch):
    from candelabra.backends.cuda.ops import CudaOps

    rng = np.random.default_rng(9)
    x, weight, expected = case(rng, 1, 64, 512)
    bias = torch.from_numpy(round_to(rng.standard_normal(64), "float16")).to(DEVICE, torch.float16)
    write_table(table_file(user_tables, GPU, "dense"), GPU, {(64, 512): tiling(block_k=256, split_k=2)}, "", "dense")
    launched = []
    real = kernel.dense_gemv
    monkeypatch.setattr(kernel, "dense_gemv", lambda *args, **kwargs: launched.append(args[2]) or real(*args, **kwargs))
    ops = CudaOps(DEVICE)
    with assume_gpu(GPU):
        out = ops.linear(x.reshape(1, 1, 512), weight, bias)
        assert out.shape == (1, 1, 64) and launched == [tiling(block_k=256, split_k=2)]
        assert nmse(float64_values(out).reshape(1, 64), expected + float64_values(bias)) <= THRESHOLD[torch.float16]
        two_rows = ops.linear(torch.cat([x, x]), weight)
    assert len(launched) == 1 and two_rows.shape == (2, 64)
    assert nmse(float64_values(two_rows), np.concatenate([expected, expected])) <= THRESHOLD[torch.float16]


@skip_where_the_kernels_cannot_run()
def test_the_backends_gated_linear_is_one_gemv_where_the_table_says_and_two_ops_elsewhere(user_tables, monkeypatch):
    from candelabra.backends.cuda.kernels import activations
    from candelabra.backends.cuda.ops import CudaOps

    rng = np.random.default_rng(10)
    gate_up = torch.from_numpy(round_to(2 * rng.standard_normal((1, 1024)), "float16")).to(DEVICE, torch.float16)
    _, weight, _ = case(rng, 1, 64, 512)
    write_table(table_file(user_tables, GPU, "dense"), GPU, {(64, 512): tiling(block_k=256)}, "", "dense")
    launched, activated = [], []
    real_gemv, real_gated = kernel.dense_gemv, activations._gated
    monkeypatch.setattr(kernel, "dense_gemv", lambda *args, **kwargs: (
        launched.append(kwargs.get("gated")) or real_gemv(*args, **kwargs)))
    monkeypatch.setattr(activations, "_gated", lambda *args: activated.append(args[1]) or real_gated(*args))
    ops = CudaOps(DEVICE)
    expected = ops.linear(activations.gelu_and_mul(torch.cat([gate_up, gate_up]), "tanh"), weight)
    activated.clear()
    with assume_gpu(GPU):
        out = ops.gated_linear(gate_up.reshape(1, 1, 1024), weight, activation="gelu_tanh")
        assert out.shape == (1, 1, 64) and launched == ["gelu_tanh"] and activated == []
        assert torch.equal(out.reshape(1, 64), expected[:1])
        two_rows = ops.gated_linear(torch.cat([gate_up, gate_up]), weight, activation="gelu_tanh")
    assert launched == ["gelu_tanh"] and activated == [activations.GELU_TANH.value]  # the activation, then cuBLAS
    assert torch.equal(two_rows, expected)


@skip_where_the_kernels_cannot_run()
def test_the_backends_rms_norm_linear_is_one_gemv_where_the_table_says_and_two_ops_elsewhere(user_tables, monkeypatch):
    from candelabra.backends.cuda.ops import CudaOps

    rng = np.random.default_rng(12)
    x, weight, _ = case(rng, 1, 64, 512)
    residual = torch.from_numpy(round_to(3 * rng.standard_normal((1, 512)), "float16")).to(DEVICE, torch.float16)
    norm_weight = torch.from_numpy(round_to(rng.standard_normal(512), "float16")).to(DEVICE, torch.float16)
    write_table(table_file(user_tables, GPU, "dense"), GPU, {(64, 512): tiling(block_k=256)}, "", "dense")
    launched, normalised = [], []
    real_gemv, real_launch = kernel.normed_dense_gemv, norms._launch
    monkeypatch.setattr(kernel, "normed_dense_gemv", lambda *args: launched.append(args[3]) or real_gemv(*args))
    monkeypatch.setattr(norms, "_launch", lambda *args: normalised.append(args[1] is not None) or real_launch(*args))
    ops = CudaOps(DEVICE)
    two_rows = torch.cat([x, 2 * x]), torch.cat([residual, residual])
    expected = ops.linear(norms.add_rms_norm(*two_rows, norm_weight, 1e-6, 1.0)[0], weight)
    normalised.clear()
    with assume_gpu(GPU):
        out, joined = ops.rms_norm_linear(x.reshape(1, 1, 512), residual.reshape(1, 1, 512), norm_weight, 1e-6,
                                          weight, weight_offset=1.0)
        assert out.shape == (1, 1, 64) and joined.shape == (1, 1, 512)
        assert launched == [tiling(block_k=256)] and normalised == []
        assert nmse(float64_values(out).reshape(1, 64), float64_values(expected[:1])) <= THRESHOLD[torch.float16]
        assert torch.equal(joined.reshape(1, 512), x + residual)
        alone, same = ops.rms_norm_linear(x, None, norm_weight, 1e-6, weight)
        assert same is x and len(launched) == 2
        reference = ops.linear(norms.rms_norm(x, norm_weight, 1e-6), weight)
        assert nmse(float64_values(alone), float64_values(reference)) <= THRESHOLD[torch.float16]
        normalised.clear()
        out, joined = ops.rms_norm_linear(*two_rows, norm_weight, 1e-6, weight, weight_offset=1.0)
    assert len(launched) == 2 and normalised == [True]  # the norm's kernel, then cuBLAS
    assert torch.equal(out, expected) and torch.equal(joined, two_rows[0] + two_rows[1])


@skip_where_the_kernels_cannot_run()
def test_the_backends_gated_mlp_is_two_gemvs_where_the_table_serves_gate_and_up_and_its_parts_elsewhere(
        user_tables, monkeypatch):
    from candelabra.backends.cuda.kernels import activations
    from candelabra.backends.cuda.ops import CudaOps

    rng = np.random.default_rng(14)
    x, gate_up, _ = case(rng, 1, 2 * 96, 512)
    _, down, _ = case(rng, 1, 64, 96)
    residual = torch.from_numpy(round_to(3 * rng.standard_normal((1, 512)), "float16")).to(DEVICE, torch.float16)
    norm_weight = torch.from_numpy(round_to(rng.standard_normal(512), "float16")).to(DEVICE, torch.float16)
    layouts = {(192, 512): tiling(block_k=256), (64, 96): tiling(block_n=8, block_k=32, split_k=3)}
    launched, activated = [], []
    real_plain, real_normed, real_gated = kernel.dense_gemv, kernel.normed_dense_gemv, activations._gated
    monkeypatch.setattr(kernel, "dense_gemv", lambda *args, **kwargs: (
        launched.append(("plain", args[2], kwargs.get("gated"))) or real_plain(*args, **kwargs)))
    monkeypatch.setattr(kernel, "normed_dense_gemv", lambda *args: (
        launched.append(("normed", *args[3:4], *args[5:])) or real_normed(*args)))
    monkeypatch.setattr(activations, "_gated", lambda *args: activated.append(args[1]) or real_gated(*args))
    ops = CudaOps(DEVICE)
    projected = ops.linear(norms.add_rms_norm(x, residual, norm_weight, 1e-6)[0], gate_up).double()
    expected = ops.linear(torch.nn.functional.silu(projected[:, :96]) * projected[:, 96:], down.double())
    launched.clear(), activated.clear()
    with assume_gpu(GPU):
        write_table(table_file(user_tables, GPU, "dense"), GPU, layouts, "", "dense")
        out, joined = ops.rms_norm_gated_mlp(x.reshape(1, 1, 512), residual.reshape(1, 1, 512), norm_weight, 1e-6,
                                             gate_up, down)
        assert out.shape == (1, 1, 64) and torch.equal(joined.reshape(1, 512), x + residual)
        assert launched == [("normed", tiling(block_k=256), "silu"), ("plain", layouts[64, 96], None)]
        assert activated == []  # the gated values came out of the first GEMV
        assert nmse(float64_values(out).reshape(1, 64), float64_values(expected)) <= THRESHOLD[torch.float16]
        # gate and up on cuBLAS: the norm's kernel, cuBLAS, then down's GEMV computing the activation
        write_table(table_file(user_tables, GPU, "dense"), GPU, {**layouts, (192, 512): None}, "", "dense")
        launched.clear()
        by_parts, _ = ops.rms_norm_gated_mlp(x, residual, norm_weight, 1e-6, gate_up, down)
        assert launched == [("plain", layouts[64, 96], "silu")] and activated == []
        assert nmse(float64_values(by_parts), float64_values(expected)) <= THRESHOLD[torch.float16]
        two_rows, _ = ops.rms_norm_gated_mlp(torch.cat([x, x]), torch.cat([residual, residual]), norm_weight, 1e-6,
                                             gate_up, down, activation="gelu")
        assert len(launched) == 1 and activated == [activations.GELU_ERF.value]
        with pytest.raises(ValueError, match="unknown gated activation 'relu'"):
            ops.rms_norm_gated_mlp(x, residual, norm_weight, 1e-6, gate_up, down, activation="relu")
    assert two_rows.shape == (2, 64)

def test_a_tile_is_made_shallower_and_wider_until_its_depth_divides_k():
    assert kernel.fitted_tile(8, 1024, 4096) == (8, 1024)
    assert kernel.fitted_tile(8, 1024, 3584) == (16, 512)  # Qwen2.5-7B's hidden size, 7 x 512
    assert kernel.fitted_tile(16, 512, 64) == (128, 64)
    assert kernel.fitted_tile(4, 512, 40) == (256, 8)
    assert kernel.fitted_tile(4, 512, 36) is None


@skip_where_the_kernels_cannot_run()
def test_every_package_dense_table_reads_is_built_by_a_compile_target_and_its_tilings_compute_the_product():
    from candelabra.backends.cuda.compile_check import TARGETS

    claimed = {gpu for target in TARGETS.values() for gpu in target.gpus}
    tables = {path: gemv_tilings.read_table(path, "dense")
              for path in sorted(gemv_tilings.PACKAGE_TABLES.glob("*.dense.json"))}
    assert tables
    rng = np.random.default_rng(41)
    for path, table in tables.items():
        assert any(table_file(gemv_tilings.PACKAGE_TABLES, gpu, "dense") == path for gpu in claimed), path
        for chosen in sorted({tiling for tiling in table.values() if tiling is not None}, key=repr):
            # a weight as many steps deep as the split needs, two each, ragged columns
            width = 2 * chosen.split_k * chosen.block_k
            x, weight, expected = case(rng, 1, 3 * chosen.block_n + 5, width)
            out = kernel.dense_gemv(x, weight, chosen)
            assert nmse(float64_values(out), expected) <= THRESHOLD[torch.float16], (path.name, chosen)


@skip_where_the_kernels_cannot_run()
def test_a_decode_through_the_gemvs_the_table_chose_for_every_shape_generates_what_cublas_does(
        tiny_llm, user_tables, monkeypatch):
    """The tiny Qwen2 model's one-row steps with every projection on the GEMV: the first layer's qkv normalised
    without a residual, the others' after one, the attention output plain, gate/up normalised and writing the
    gated values, down plain, the LM head after the final norm; the tokens cuBLAS gives, and logprobs as near
    float32's as its."""
    from candelabra.backends.cuda.backend import CudaBackend
    from candelabra.core.requests.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    prompt = [[5, 9, 23, 42, 7, 11]]
    reference = tiny_llm(seed=21, backend=CudaBackend, dtype="float16").generate(prompt, params, progress=False)
    llm = tiny_llm(seed=21, backend=CudaBackend, dtype="float16")
    model = llm.model
    shapes = {tuple(w.shape) for layer in model.layers for w in (layer.qkv, layer.out, layer.mlp_in, layer.mlp_out)}
    layout = tiling(block_n=8, block_k=32, split_k=2)
    write_table(table_file(user_tables, GPU, "dense"), GPU, dict.fromkeys(shapes | {tuple(model.lm_head.shape)},
                                                                         layout), "", "dense")
    launched = []
    plain, normed = kernel.dense_gemv, kernel.normed_dense_gemv
    monkeypatch.setattr(kernel, "dense_gemv", lambda x, w, *args, gated=None: (
        launched.append(("gated" if gated else "plain", tuple(w.shape))) or plain(x, w, *args, gated=gated)))
    monkeypatch.setattr(kernel, "normed_dense_gemv", lambda x, norm, w, tiling, bias, gate_output=None: (
        launched.append(("normed" if norm.residual is None else "added", tuple(w.shape), gate_output))
        or normed(x, norm, w, tiling, bias, gate_output)))
    with assume_gpu(GPU):
        ours = llm.generate(prompt, params, progress=False)

    layer = model.layers[0]
    def layer_launches(qkv_norm):
        return [(qkv_norm, tuple(layer.qkv.shape), None), ("plain", tuple(layer.out.shape)),
                ("added", tuple(layer.mlp_in.shape), "silu"), ("plain", tuple(layer.mlp_out.shape))]

    decode = (layer_launches("normed") + layer_launches("added") * (len(model.layers) - 1)
              + [("normed", tuple(model.lm_head.shape), None)])
    # the prefill's rows go to cuBLAS but for the one its logits are taken from
    assert launched == [("normed", tuple(model.lm_head.shape), None)] + decode * (params.max_tokens - 1)
    assert ours[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    # float16's own noise: both within 0.015 of float32's logprobs (cuBLAS's 0.0095 off at the last token, the
    # GEMVs' 0.002, the normalised values not rounded before their products)
    exact = tiny_llm(seed=21, backend=CudaBackend, dtype="float32").generate(prompt, params, progress=False)
    for outputs in (ours, reference):
        np.testing.assert_allclose([e.logprob for e in outputs[0].outputs[0].logprobs],
                                   [e.logprob for e in exact[0].outputs[0].logprobs], atol=0.015)


@skip_where_the_kernels_cannot_run()
@pytest.mark.parametrize(("activation", "split_k", "residual"),
                         [("silu", 1, True), ("silu", 3, False), ("gelu", 2, True), ("gelu_tanh", 1, False)])
def test_a_gated_output_is_each_gate_and_up_pairs_activated_product_from_the_float32_sums(activation, split_k,
                                                                                         residual):
    rng = np.random.default_rng([13, split_k, len(activation), residual])
    width, inner = 768, 44  # ragged: 44 pairs in tiles of 8
    x = round_to(rng.standard_normal((1, width)), "float16")
    added = round_to(4 * rng.standard_normal((1, width)), "float16")
    norm_weight = round_to(0.2 * rng.standard_normal(width) + 1.0, "float16")
    _, weight, _ = case(rng, 1, 2 * inner, width)
    bias = round_to(rng.standard_normal(2 * inner), "float16")
    joined = round_to(x.astype(np.float64) + added, "float16").astype(np.float64) if residual else x.astype(np.float64)
    normed = joined / np.sqrt(np.mean(joined**2) + 1e-5) * norm_weight.astype(np.float64)
    projected = normed @ float64_values(weight).T + bias
    expected = GATED[activation](projected[:, :inner]) * projected[:, inner:]
    on_device = [torch.from_numpy(a).to(DEVICE, torch.float16) for a in (x, added, norm_weight, bias)]
    norm = norms.RowNorm(on_device[2], 1e-5, 0.0, on_device[1] if residual else None)
    layout = tiling(block_n=16, block_k=128, split_k=split_k)
    out, row = kernel.normed_dense_gemv(on_device[0], norm, weight, layout, on_device[3], gate_output=activation)
    assert out.shape == (1, inner) and nmse(float64_values(out), expected) <= THRESHOLD[torch.float16]
    assert np.array_equal(float64_values(row), joined)
    assert not arrival_counts(DEVICE, 1).any()
    ungated, _ = kernel.normed_dense_gemv(on_device[0], norm, weight, layout, on_device[3])
    assert nmse(float64_values(ungated), projected) <= THRESHOLD[torch.float16]
