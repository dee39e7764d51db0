"""The cuda backend's int4 weights and their dequantizing GEMM, on the GPU or through the Triton interpreter,
against the float64 product with the GGUF weight's own dequantized values."""


import numpy as np
import pytest
import torch

from candelabra.backends.cuda.availability import assume_gpu, assume_multiprocessors
from candelabra.backends.cuda.kernels import int4_matmul as kernel
from candelabra.backends.cuda.kernels.int4_matmul import TileConfig, int4_matmul, pack_nibbles
from candelabra.backends.cuda.kernels.norms import RowNorm
from candelabra.backends.cuda.kernels.split_k import MAX_SPLIT_K, MIN_STEPS_PER_SPLIT, arrival_counts, splittable
from candelabra.backends.cuda.quantized import Int4CudaWeight
from candelabra.conformance.compare import NMSE_THRESHOLDS, nmse, round_to
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.contract.weights import INT4_GROUP_FORMATS, QuantizedTensor
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

pytestmark = skip_where_the_kernels_cannot_run()

DEVICE = kernel_device()
FORMATS = ("Q4_0", "Q4_1", "Q4_K")
DTYPES = {"float32": torch.float32, "float16": torch.float16}
# float32: the general threshold; the kernel measures about 1.5e-14. float16: the scales and zeros are kept
# in float16 (quantized.py), which a dense float16 weight never needs (hence above linear's 1e-8 op
# threshold): 5e-8 to 1.1e-7 measured. Still far below QUANTIZED_NMSE_THRESHOLDS (3e-4, room for rounding x to
# 8 bits, which this kernel does not do) and below what scales rounded to bfloat16 cost (about 5e-6).
THRESHOLDS = {"float32": NMSE_THRESHOLDS["float32"], "float16": 1e-6}
# (M, N, K): decode rows and prefill-like tiles, widths inside one column tile, whole tiles and ragged ones
SHAPES = [(1, 1000, 512), (3, 40, 768), (17, 384, 768), (64, 40, 512)]


def _case(rng, format, dtype, rows, columns, width):
    weight = random_quantized(rng, format, columns, width)
    x = round_to(rng.standard_normal((rows, width)), dtype)
    expected = x.astype(np.float64) @ weight.dequantize().astype(np.float64).T
    return weight, torch.from_numpy(x).to(DEVICE, DTYPES[dtype]), expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_matmul_matches_the_dequantized_product(format, dtype, shape):
    rng = np.random.default_rng([sum(map(ord, format)), len(dtype), *shape])
    weight, x, expected = _case(rng, format, dtype, *shape)
    kept = Int4CudaWeight.from_quantized(weight, DTYPES[dtype], DEVICE)
    out = kept.matmul(x)
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert nmse(out.float().cpu().numpy(), expected) <= THRESHOLDS[dtype]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("format", INT4_GROUP_FORMATS)
def test_a_grouped_int4_weight_in_act_order_multiplies_x_in_its_own_column_order(format, rows):
    """GPTQ's and AWQ's groups of 32 to 256, each with one scale and zero as the checkpoint keeps them,
    and the stored columns a permutation of the weight's."""
    rng = np.random.default_rng([sum(map(ord, format)), rows])
    plain, x, _ = _case(rng, format, "float16", rows, 40, 512)
    weight = QuantizedTensor(format, plain.blocks, plain.shape, rng.permutation(512))
    kept = Int4CudaWeight.from_quantized(weight, torch.float16, DEVICE)
    assert kept.scales.shape == (40, 512 // INT4_GROUP_FORMATS[format])
    expected = float64_values(x) @ weight.dequantize().astype(np.float64).T
    assert nmse(kept.matmul(x).float().cpu().numpy(), expected) <= THRESHOLDS["float16"]


@pytest.mark.parametrize("scale_after_dot", [True, False], ids=["scale-after-dot", "dequantize-first"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_and_grouped_row_tiles(dtype, scale_after_dot):
    # K = 768 in 12 steps of 64 split three ways; four row tiles walk the column tiles in groups of two
    rng = np.random.default_rng(7)
    weight, x, expected = _case(rng, "Q4_K", dtype, 64, 100, 768)
    kept = Int4CudaWeight.from_quantized(weight, DTYPES[dtype], DEVICE)
    config = TileConfig(block_m=16, block_n=32, block_k=64, split_k=3, group_m=2, scale_after_dot=scale_after_dot)
    out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, config)
    assert out.dtype == x.dtype
    assert nmse(out.float().cpu().numpy(), expected) <= THRESHOLDS[dtype]
    # the last split of each tile added the partial sums and reset its arrival count for the next launch
    assert not arrival_counts(DEVICE, 1).any()
    again = int4_matmul(x, kept.packed, kept.scales, kept.zeros, config)
    assert torch.equal(again, out)


@pytest.mark.parametrize("stages", [1, 2], ids=["in-turn", "next-step-ahead"])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("dtype", [*DTYPES, "bfloat16"])
def test_the_gemv_kernel_matches_the_dequantized_product(dtype, split_k, stages):
    # ragged columns, K = 1024 in 8 steps of 128 (2 a split in four); three rows, a program column each
    rng = np.random.default_rng(11)
    torch_dtype = {**DTYPES, "bfloat16": torch.bfloat16}[dtype]
    weight, x, expected = _case(rng, "Q4_1", "float32", 3, 200, 1024)
    kept = Int4CudaWeight.from_quantized(weight, torch_dtype, DEVICE)
    x = x.to(torch_dtype)
    expected = float64_values(x) @ weight.dequantize().astype(np.float64).T
    config = TileConfig(block_m=1, block_n=64, block_k=128, split_k=split_k, num_stages=stages)
    out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, config)
    assert out.dtype == x.dtype
    # bfloat16: its scales, zeros and output rounded to 8 bits
    assert nmse(out.float().cpu().numpy(), expected) <= THRESHOLDS.get(dtype, 5e-5)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("residual", [True, False], ids=["plus-residual", "alone"])
def test_the_gemv_normalises_x_as_it_loads_it_and_stores_the_row_the_next_layer_adds_to(residual, split_k):
    # K = 768 in 6 steps of 128 (2 a split in three), groups of 128 (GPTQ's), Gemma's weight offset of one
    rng = np.random.default_rng([13, split_k, residual])
    weight, x, _ = _case(rng, "INT4_G128", "float16", 1, 72, 768)
    kept = Int4CudaWeight.from_quantized(weight, torch.float16, DEVICE)
    added = round_to(4 * rng.standard_normal((1, 768)), "float16")
    norm_weight = round_to(0.2 * rng.standard_normal(768), "float16")
    joined = float64_values(x) + (added if residual else 0.0)
    joined = round_to(joined, "float16").astype(np.float64)
    normed = joined / np.sqrt(np.mean(joined**2) + 1e-5) * (1.0 + norm_weight.astype(np.float64))
    bias = round_to(rng.standard_normal(72), "float16")
    expected = normed @ weight.dequantize().astype(np.float64).T + bias
    norm = RowNorm(torch.from_numpy(norm_weight).to(DEVICE, torch.float16), 1e-5, 1.0,
                   torch.from_numpy(added).to(DEVICE, torch.float16) if residual else None)
    config = TileConfig(block_m=1, block_n=32, block_k=128, split_k=split_k)
    out, row = kernel.normed_int4_gemv(x, norm, kept.packed, kept.scales, kept.zeros, config,
                                       torch.from_numpy(bias).to(DEVICE, torch.float16))
    assert out.shape == (1, 72) and nmse(float64_values(out), expected) <= THRESHOLDS["float16"]
    assert np.array_equal(float64_values(row), joined) and (row is x) == (not residual)
    assert not arrival_counts(DEVICE, 1).any()
    # the backend's weight takes it for one row in the weight's own column order, and leaves it otherwise
    assert torch.equal(kept.normed_matmul(x, norm, torch.from_numpy(bias).to(DEVICE, torch.float16))[1], row)
    assert kept.normed_matmul(torch.cat([x, x]), norm._replace(residual=None)) is None
    shuffled = QuantizedTensor(weight.format, weight.blocks, weight.shape, rng.permutation(768))
    assert Int4CudaWeight.from_quantized(shuffled, torch.float16, DEVICE).normed_matmul(x, norm) is None
    with pytest.raises(ValueError, match="2 rows .* take the tensor-core GEMM"):
        kernel.normed_int4_gemv(torch.cat([x, x]), norm._replace(residual=None), kept.packed, kept.scales,
                                kept.zeros)



@pytest.mark.parametrize(("activation", "split_k"), [("silu", 1), ("silu", 3), ("gelu_tanh", 2)])
def test_the_gemv_gives_a_gated_mlps_gated_values_from_its_gate_and_up_rows(activation, split_k):
    import math

    rng = np.random.default_rng([17, split_k, len(activation)])
    weight, x, _ = _case(rng, "Q4_K", "float16", 1, 2 * 40, 768)  # 40 pairs: ragged in tiles of 16
    kept = Int4CudaWeight.from_quantized(weight, torch.float16, DEVICE)
    added = round_to(4 * rng.standard_normal((1, 768)), "float16")
    norm_weight = round_to(0.2 * rng.standard_normal(768) + 1.0, "float16")
    joined = round_to(float64_values(x) + added, "float16").astype(np.float64)
    normed = joined / np.sqrt(np.mean(joined**2) + 1e-5) * norm_weight.astype(np.float64)
    projected = normed @ weight.dequantize().astype(np.float64).T
    gate, up = projected[:, :40], projected[:, 40:]
    if activation == "silu":
        expected = gate / (1 + np.exp(-gate)) * up
    else:
        expected = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up
    norm = RowNorm(torch.from_numpy(norm_weight).to(DEVICE, torch.float16), 1e-5, 0.0,
                   torch.from_numpy(added).to(DEVICE, torch.float16))
    config = TileConfig(block_m=1, block_n=32, block_k=128, split_k=split_k)
    out, row = kernel.normed_int4_gemv(x, norm, kept.packed, kept.scales, kept.zeros, config, gate_output=activation)
    assert out.shape == (1, 40) and nmse(float64_values(out), expected) <= THRESHOLDS["float16"]
    assert np.array_equal(float64_values(row), joined)
    assert not arrival_counts(DEVICE, 1).any()
    by_weight, _ = kept.normed_matmul(x, norm, gate_output=activation)
    assert by_weight.shape == (1, 40) and nmse(float64_values(by_weight), expected) <= THRESHOLDS["float16"]
    with pytest.raises(ValueError, match="gated output .* even number of rows"):
        kernel.normed_int4_gemv(x, norm, kept.packed[:79], kept.scales[:79], kept.zeros[:79], config,
                                gate_output=activation)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("format", FORMATS)
def test_larger_tiles_dequantize_before_the_dot_and_match_the_dequantized_product(format, dtype):
    rng = np.random.default_rng([sum(map(ord, format)), len(dtype), 5])
    weight, x, expected = _case(rng, format, dtype, 70, 96, 512)
    kept = Int4CudaWeight.from_quantized(weight, DTYPES[dtype], DEVICE)
    config = TileConfig(block_m=32, block_n=64, block_k=128, scale_after_dot=False)
    out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, config)
    assert nmse(out.float().cpu().numpy(), expected) <= THRESHOLDS[dtype]


# Each of the kernels' paths, explicitly tiled: the GEMV in turn and with the next step ahead, split K;
# tiles dotting the raw q - 8 per run (float32's) and dequantizing first (16-bit's).
GROUP_PATHS = {
    "gemv": (TileConfig(block_m=1, block_n=64, block_k=256, split_k=2, num_stages=1), "float32", 1),
    "gemv-ahead": (TileConfig(block_m=1, block_n=64, block_k=256, split_k=2, num_stages=2), "float16", 1),
    "scale-after-dot": (TileConfig(block_m=16, block_n=32, block_k=256, split_k=2), "float32", 5),
    "dequantize-first": (TileConfig(block_m=16, block_n=32, block_k=256, scale_after_dot=False), "float16", 18),
}


@pytest.mark.parametrize("path", GROUP_PATHS)
@pytest.mark.parametrize("format", ["INT4_G64", "INT4_G128", "INT4_G256"])
def test_a_scale_covering_several_runs_of_32_multiplies_on_every_path(format, path):
    """A group of 64 to 256 keeps one scale and zero (4.25 bits a weight at 128, where repeating them
    for each run of 32 took 5): each run finds its group's, across steps and splits of K."""
    config, dtype, rows = GROUP_PATHS[path]
    rng = np.random.default_rng([sum(map(ord, format)), len(path)])
    weight, x, expected = _case(rng, format, dtype, rows, 72, 1024)
    kept = Int4CudaWeight.from_quantized(weight, DTYPES[dtype], DEVICE)
    assert kept.scales.shape == (72, 1024 // INT4_GROUP_FORMATS[format])

    out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, config)

    assert nmse(out.float().cpu().numpy(), expected) <= THRESHOLDS[dtype]


def test_a_tile_step_may_end_inside_a_scale_group_but_a_gemv_step_may_not():
    rng = np.random.default_rng(13)
    weight, x, expected = _case(rng, "INT4_G256", "float16", 2, 40, 512)
    kept = Int4CudaWeight.from_quantized(weight, torch.float16, DEVICE)
    for form in (True, False):  # steps of 64: four to a scale group
        out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, TileConfig(16, 32, 64, scale_after_dot=form))
        assert nmse(out.float().cpu().numpy(), expected) <= THRESHOLDS["float16"]
    with pytest.raises(ValueError, match="the GEMV's block_k 128 must be a multiple of the scales' group of 256"):
        int4_matmul(x[:1], kept.packed, kept.scales, kept.zeros, TileConfig(1, 32, 128))
    assert kernel.choose_config(1, 8, 512, DEVICE, torch.float16, 256).block_k % 256 == 0


def test_scales_of_a_group_the_kernels_do_not_take_are_refused():
    rng = np.random.default_rng(14)
    kept = Int4CudaWeight.from_quantized(random_quantized(rng, "INT4_G128", 8, 512), torch.float16, DEVICE)
    x = torch.ones(2, 512, dtype=torch.float16, device=DEVICE)
    sixteens = kept.scales.repeat_interleave(8, dim=1)  # a scale per 16 values
    with pytest.raises(ValueError, match="a scale covers one of 32, 64, 128, 256 values along K"):
        int4_matmul(x, kept.packed, sixteens, sixteens.clone())


# A bias added where each path writes its output: whole, by the last split to arrive, and by the GEMV.
BIAS_PATHS = {
    "gemv": TileConfig(block_m=1, block_n=64, block_k=128, split_k=1),
    "gemv-split": TileConfig(block_m=1, block_n=64, block_k=128, split_k=4),
    "tiles-split": TileConfig(block_m=16, block_n=32, block_k=64, split_k=2, scale_after_dot=False),
}


@pytest.mark.parametrize("path", BIAS_PATHS)
def test_the_bias_is_added_as_the_output_is_written(path):
    rng = np.random.default_rng([15, len(path)])
    rows = 1 if BIAS_PATHS[path].block_m == 1 else 5
    weight, x, expected = _case(rng, "Q4_K", "float16", rows, 100, 512)
    kept = Int4CudaWeight.from_quantized(weight, torch.float16, DEVICE)
    bias = round_to(rng.standard_normal(100) * 4, "float16")
    out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, BIAS_PATHS[path],
                      bias=torch.from_numpy(bias).to(DEVICE, torch.float16))
    assert nmse(out.float().cpu().numpy(), expected + bias) <= THRESHOLDS["float16"]
    through_the_weight = kept.matmul(x, torch.from_numpy(bias).to(DEVICE, torch.float32))  # cast to float16
    assert nmse(through_the_weight.float().cpu().numpy(), expected + bias) <= THRESHOLDS["float16"]
    with pytest.raises(ValueError, match=r"the bias must be a contiguous \[100\], not \[99\]"):
        int4_matmul(x, kept.packed, kept.scales, kept.zeros, bias=torch.zeros(99, dtype=torch.float16, device=DEVICE))


def test_a_split_k_that_would_leave_a_split_without_a_step_falls_back_to_fewer():
    rng = np.random.default_rng(8)
    weight, x, expected = _case(rng, "Q4_1", "float32", 2, 48, 160)  # 5 steps of 32: 4 splits become 3 (2, 2, 1)
    kept = Int4CudaWeight.from_quantized(weight, torch.float32, DEVICE)
    out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, TileConfig(16, 32, 32, split_k=4))
    assert nmse(out.cpu().numpy(), expected) <= THRESHOLDS["float32"]


@pytest.mark.parametrize("block_m", [1, 16], ids=["gemv", "tiles"])
def test_splits_whose_last_takes_fewer_steps_add_up_to_the_product(block_m):
    # K = 832 in 13 steps of 64, split five ways: 3, 3, 3, 3 and 1
    rng = np.random.default_rng(12)
    weight, x, expected = _case(rng, "Q4_1", "float16", 1 if block_m == 1 else 5, 72, 832)
    kept = Int4CudaWeight.from_quantized(weight, torch.float16, DEVICE)
    config = TileConfig(block_m, 32, 64, split_k=5, num_stages=2 if block_m == 1 else 3)
    out = int4_matmul(x, kept.packed, kept.scales, kept.zeros, config)
    assert nmse(out.float().cpu().numpy(), expected) <= THRESHOLDS["float16"]
    assert not arrival_counts(DEVICE, 1).any()


def test_leading_dims_strided_rows_and_no_rows():
    rng = np.random.default_rng(9)
    weight, _, _ = _case(rng, "Q4_0", "float32", 1, 24, 96)
    kept = Int4CudaWeight.from_quantized(weight, torch.float32, DEVICE)
    dense = weight.dequantize().astype(np.float64)
    wide = torch.from_numpy(rng.standard_normal((2, 3, 160)).astype(np.float32)).to(DEVICE)
    x = wide[..., 32:128]  # rows 160 apart, unit stride along K
    out = kept.matmul(x)
    assert out.shape == (2, 3, 24)
    assert nmse(out.cpu().numpy(), float64_values(x) @ dense.T) <= THRESHOLDS["float32"]
    assert kept.matmul(torch.empty(0, 96, device=DEVICE)).shape == (0, 24)


def test_packed_layout_holds_each_group_value_h_and_h_plus_16_in_one_byte():
    rng = np.random.default_rng(10)
    nibbles = rng.integers(0, 16, size=(5, 64), dtype=np.uint8)
    packed = pack_nibbles(nibbles)
    assert packed.shape == (5, 32) and packed.dtype == np.uint8
    for n in range(5):
        for group in range(2):
            for h in range(16):
                byte = packed[n, group * 16 + h]
                assert byte & 0x0F == nibbles[n, group * 32 + h]
                assert byte >> 4 == nibbles[n, group * 32 + 16 + h]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_nbytes_is_half_a_byte_a_weight_plus_scales_and_zeros(dtype):
    rng = np.random.default_rng(11)
    kept = Int4CudaWeight.from_quantized(random_quantized(rng, "Q4_K", 48, 512), dtype, DEVICE)
    item = torch.tensor([], dtype=dtype).element_size()
    assert kept.shape == (48, 512) and kept.dtype == dtype
    assert kept.packed.dtype == torch.uint8 and kept.packed.numel() == 48 * 512 // 2
    assert kept.nbytes == 48 * 512 // 2 + 2 * (48 * 512 // 32) * item
    grouped = Int4CudaWeight.from_quantized(random_quantized(rng, "INT4_G128", 48, 512), dtype, DEVICE)
    assert grouped.nbytes == 48 * 512 // 2 + 2 * (48 * 512 // 128) * item


def test_formats_and_inputs_it_does_not_take_are_refused_clearly():
    rng = np.random.default_rng(12)
    with pytest.raises(ValueError, match="takes INT4_G128, .*Q4_K weights, not Q8_0"):
        Int4CudaWeight.from_quantized(random_quantized(rng, "Q8_0", 8, 64), torch.float16, DEVICE)
    with pytest.raises(ValueError, match="computes in"):
        Int4CudaWeight.from_quantized(random_quantized(rng, "Q4_0", 8, 64), torch.float64, DEVICE)
    kept = Int4CudaWeight.from_quantized(random_quantized(rng, "Q4_0", 8, 64), torch.float16, DEVICE)
    with pytest.raises(ValueError, match="computes in torch.float16"):
        kept.matmul(torch.ones(1, 64, dtype=torch.float32, device=DEVICE))
    with pytest.raises(ValueError, match="has 32 features; the weight is 8 x 64"):
        kept.matmul(torch.ones(1, 32, dtype=torch.float16, device=DEVICE))
    shifted = torch.zeros(kept.packed.numel() + 2, dtype=torch.uint8, device=DEVICE)[2:].view(kept.packed.shape)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        int4_matmul(torch.ones(1, 64, dtype=torch.float16, device=DEVICE), shifted, kept.scales, kept.zeros)


@pytest.mark.parametrize("shape", [(1, 4096, 4096), (1, 151936, 896), (8, 14336, 4864), (64, 896, 4864),
                                   (200, 4096, 4096), (4096, 4096, 14336), (3, 40, 96), (1, 3584, 18944)])
def test_hopper_tiling_divides_k_and_splits_only_decodes(monkeypatch, shape):
    monkeypatch.setattr(kernel, "interpreting", lambda: False)
    rows, columns, width = shape
    with assume_multiprocessors(132), assume_gpu(None):
        config = kernel.choose_config(rows, columns, width, torch.device("cuda"))
    steps = width // config.block_k
    assert width % config.block_k == 0 and config.block_k % 32 == 0
    if rows <= kernel.DECODE_ROWS:
        assert rows <= config.block_m <= kernel.DECODE_ROWS
    assert splittable(steps, config.split_k) and config.split_k <= MAX_SPLIT_K
    assert config.split_k == 1 or steps // config.split_k >= MIN_STEPS_PER_SPLIT
    tiles = -(-rows // config.block_m) * -(-columns // config.block_n)
    if rows == 1 and columns in (4096, 3584):  # 64 (112) column tiles alone would leave SMs idle
        assert tiles * config.split_k >= 132
    if width == 18944:  # Qwen2.5-7B's down projection: 37 steps of 512, split unevenly rather than not at all
        assert steps == 37 and config.split_k > 1 and steps % config.split_k
    if rows > kernel.DECODE_ROWS and tiles >= 132:
        assert config.split_k == 1


def test_interpreter_uses_one_fixed_tiling_for_a_row_and_one_for_more(monkeypatch):
    monkeypatch.setattr(kernel, "interpreting", lambda: True)
    assert kernel.choose_config(1, 4096, 4096, torch.device("cpu")) == kernel.INTERPRETER_GEMV_CONFIG
    assert kernel.choose_config(2, 4096, 4096, torch.device("cpu")) == kernel.INTERPRETER_CONFIG
    assert kernel.choose_config(3000, 40, 96, torch.device("cpu")).block_k == 32


def test_the_backends_rms_norm_linear_takes_the_normalising_gemv_for_one_row_and_two_ops_for_more(monkeypatch):
    from candelabra.backends.cuda import quantized
    from candelabra.backends.cuda.kernels import norms
    from candelabra.backends.cuda.ops import CudaOps

    rng = np.random.default_rng(14)
    weight, x, _ = _case(rng, "Q4_K", "float16", 2, 48, 512)
    kept = Int4CudaWeight.from_quantized(weight, torch.float16, DEVICE)
    residual = torch.from_numpy(round_to(3 * rng.standard_normal((2, 512)), "float16")).to(DEVICE, torch.float16)
    norm_weight = torch.from_numpy(round_to(rng.standard_normal(512), "float16")).to(DEVICE, torch.float16)
    launched = []
    real = quantized.normed_int4_gemv
    monkeypatch.setattr(quantized, "normed_int4_gemv", lambda *args, **kwargs: (
        launched.append(args[0].shape) or real(*args, **kwargs)))
    ops = CudaOps(DEVICE)
    two_ops = kept.matmul(norms.add_rms_norm(x, residual, norm_weight, 1e-6)[0])
    out, joined = ops.rms_norm_linear(x[:1], residual[:1], norm_weight, 1e-6, kept)
    assert launched == [(1, 512)] and torch.equal(joined, x[:1] + residual[:1])
    assert nmse(float64_values(out), float64_values(two_ops[:1])) <= THRESHOLDS["float16"]
    both, _ = ops.rms_norm_linear(x, residual, norm_weight, 1e-6, kept)
    assert launched == [(1, 512)] and torch.equal(both, two_ops)


def test_the_backends_gated_mlp_of_int4_weights_writes_the_gated_values_from_the_first_gemv(monkeypatch):
    from candelabra.backends.cuda import quantized
    from candelabra.backends.cuda.kernels import activations, norms
    from candelabra.backends.cuda.ops import CudaOps

    rng = np.random.default_rng(15)
    gate_up, x, _ = _case(rng, "Q4_K", "float16", 2, 2 * 64, 512)
    down, _, _ = _case(rng, "Q4_0", "float16", 1, 48, 64)
    kept_gate_up, kept_down = (Int4CudaWeight.from_quantized(w, torch.float16, DEVICE) for w in (gate_up, down))
    residual = torch.from_numpy(round_to(3 * rng.standard_normal((2, 512)), "float16")).to(DEVICE, torch.float16)
    norm_weight = torch.from_numpy(round_to(rng.standard_normal(512), "float16")).to(DEVICE, torch.float16)
    launched, activated = [], []
    real_normed, real_gated = quantized.normed_int4_gemv, activations._gated
    monkeypatch.setattr(quantized, "normed_int4_gemv", lambda *args, **kwargs: (
        launched.append(kwargs["gate_output"]) or real_normed(*args, **kwargs)))
    monkeypatch.setattr(activations, "_gated", lambda *args: activated.append(args[1]) or real_gated(*args))
    ops = CudaOps(DEVICE)
    joined = float64_values(norms.add_rms_norm(x, residual, norm_weight, 1e-6)[1])
    normed = joined / np.sqrt(np.mean(joined**2, axis=1, keepdims=True) + 1e-6) * float64_values(norm_weight)
    projected = normed @ gate_up.dequantize().astype(np.float64).T
    gated = projected[:, :64] / (1 + np.exp(-projected[:, :64])) * projected[:, 64:]
    expected = gated @ down.dequantize().astype(np.float64).T
    out, joined = ops.rms_norm_gated_mlp(x[:1], residual[:1], norm_weight, 1e-6, kept_gate_up, kept_down)
    assert launched == ["silu"] and activated == [] and torch.equal(joined, x[:1] + residual[:1])
    assert out.shape == (1, 48) and nmse(float64_values(out), expected[:1]) <= THRESHOLDS["float16"]
    both, _ = ops.rms_norm_gated_mlp(x, residual, norm_weight, 1e-6, kept_gate_up, kept_down)
    assert launched == ["silu"] and activated == [activations.SILU.value]  # two rows: the ops in turn
    assert nmse(float64_values(both), expected) <= THRESHOLDS["float16"]
