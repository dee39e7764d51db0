"""The cuda backend's mixture-of-experts kernels (kernels/fused_moe.py), on the GPU or through the Triton
interpreter: the picks sorted by expert into tiles on the device, and `moe_experts` against the float64
formula of the op's docstring in float32, float16 and bfloat16."""

import numpy as np
import pytest
import torch

from candelabra.backends.cuda.availability import interpreting
from candelabra.backends.cuda.kernels.fused_moe import moe_experts, row_bound, sort_picks
from candelabra.conformance import oracle
from candelabra.conformance.compare import nmse, op_threshold, round_to
from support import float64_values, kernel_device, skip_where_the_kernels_cannot_run

# silu's exp(-gate) overflows to inf for a very negative gate by design (silu takes the right limit, 0)
pytestmark = [skip_where_the_kernels_cannot_run(),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]

DEVICE = kernel_device()
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (tokens, hidden, intermediate, experts, top_k, experts no token chooses); 54 picks of 3 experts give one
# at least 18, more than a tile. Under the interpreter a
# tile is 16 rows and a GEMM block 32 x 32: hidden 80 and intermediate 48 leave ragged blocks in both GEMMs.
CASES = {
    "one token": (1, 64, 48, 8, 2, 2),
    "top-1": (9, 64, 48, 8, 1, 2),
    "every expert": (5, 64, 32, 4, 4, 0),
    "several tiles an expert": (27, 80, 48, 3, 2, 0),
}


def kernel_rounding(array: np.ndarray, dtype: str) -> np.ndarray:
    """`array` rounded to `dtype` as the kernels' casts round: to nearest, except bfloat16 under the
    interpreter, whose casts to bfloat16 truncate (Triton 3.6's _convert_float, the rounding mode unused)."""
    if dtype == "bfloat16" and interpreting():
        return (np.asarray(array, dtype=np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    return round_to(array, dtype)


def routed_layer(rng, dtype, tokens, hidden, intermediate, experts, top_k, unused):
    """The op's arguments on DEVICE, values exact in `dtype`, and the docstring's formula in float64."""
    x = round_to(rng.standard_normal((tokens, hidden)), dtype)
    gate_up = round_to(rng.standard_normal((experts, 2 * intermediate, hidden)) * hidden**-0.5, dtype)
    down = round_to(rng.standard_normal((experts, hidden, intermediate)) * intermediate**-0.5, dtype)
    available = rng.choice(experts, experts - unused, replace=False)
    expert_ids = np.stack([rng.choice(available, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    expected = oracle.moe_experts(x, weights, expert_ids, gate_up, down, lambda a: kernel_rounding(a, dtype))
    arguments = [torch.from_numpy(x).to(DEVICE, DTYPES[dtype]), torch.from_numpy(weights).to(DEVICE),
                 torch.from_numpy(expert_ids).to(DEVICE), torch.from_numpy(gate_up).to(DEVICE, DTYPES[dtype]),
                 torch.from_numpy(down).to(DEVICE, DTYPES[dtype])]
    return arguments, expected


def assert_matches(out: torch.Tensor, expected: np.ndarray, dtype: str) -> None:
    """Within the op's conformance limit of the formula rounded once to `dtype`."""
    assert out.dtype == DTYPES[dtype] and tuple(out.shape) == expected.shape
    assert nmse(float64_values(out), kernel_rounding(expected, dtype)) <= op_threshold("moe_experts", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_moe_experts_matches_the_docstrings_formula(case, dtype):
    rng = np.random.default_rng([len(case), len(dtype)])
    arguments, expected = routed_layer(rng, dtype, *CASES[case])
    before = [argument.clone() for argument in arguments]

    out = moe_experts(*arguments)

    assert_matches(out, expected, dtype)
    assert all(torch.equal(argument, kept) for argument, kept in zip(arguments, before))


def test_picks_are_sorted_by_expert_in_pick_order_into_whole_tiles():
    # 40 tokens of top-8 among 128 experts: 320 picks, two chunks of the sorting kernels; 48 experts unchosen
    rng = np.random.default_rng(3)
    expert_ids = np.stack([rng.choice(80, 8, replace=False) for _ in range(40)]).astype(np.int32).reshape(-1)
    block_m = 16

    sorted_picks = sort_picks(torch.from_numpy(expert_ids).to(DEVICE), 128, block_m)

    tiles = []  # (expert, its picks in this tile), expert by expert, in pick order
    for expert in range(128):
        picks = np.flatnonzero(expert_ids == expert).tolist()
        tiles += [(expert, picks[first:first + block_m]) for first in range(0, len(picks), block_m)]
    tile_experts = sorted_picks.tile_experts.cpu().numpy()
    tile_rows = sorted_picks.tile_rows.cpu().numpy()
    rows = sorted_picks.rows.cpu().numpy().reshape(-1, block_m)
    assert sorted_picks.tiles == -(-row_bound(320, 128, block_m) // block_m)
    assert tile_experts[:len(tiles)].tolist() == [expert for expert, _ in tiles]
    assert tile_rows[:len(tiles)].tolist() == [len(picks) for _, picks in tiles]
    assert all(rows[tile, :len(picks)].tolist() == picks for tile, (_, picks) in enumerate(tiles))
    assert (tile_experts[len(tiles):] == -1).all() and (tile_rows[len(tiles):] == 0).all()


def test_the_tiles_launched_depend_on_the_shapes_alone_and_hold_the_worst_routing():
    # eight picks of eight different experts each fill a padded tile: every tile the shapes allow
    spread = sort_picks(torch.arange(8, dtype=torch.int32, device=DEVICE), 8, 16)
    assert spread.tile_experts.tolist() == list(range(8)) and spread.tile_rows.tolist() == [1] * 8
    # the same shapes with every pick on one expert: the same launch, one tile used
    packed = sort_picks(torch.full((8,), 5, dtype=torch.int32, device=DEVICE), 8, 16)
    assert packed.tiles == spread.tiles
    assert packed.tile_experts.tolist() == [5] + [-1] * 7 and packed.tile_rows.tolist() == [8] + [0] * 7


def test_a_pick_of_an_expert_that_does_not_exist_adds_nothing():
    rng = np.random.default_rng(4)
    (x, weights, expert_ids, gate_up, down), _ = routed_layer(rng, "float32", 6, 64, 32, 8, 2, 0)
    expert_ids[1, 0], expert_ids[4, 1] = -1, 8
    kept = (expert_ids >= 0) & (expert_ids < 8)

    out = moe_experts(x, weights, expert_ids, gate_up, down)

    expected = oracle.moe_experts(float64_values(x), float64_values(weights * kept), expert_ids.clamp(0, 7).cpu(),
                                  float64_values(gate_up), float64_values(down))
    assert_matches(out, expected, "float32")


def test_a_share_of_the_experts_runs_only_the_picks_of_its_own_from_first_expert_on():
    rng = np.random.default_rng(6)
    (x, weights, expert_ids, gate_up, down), _ = routed_layer(rng, "float32", 9, 64, 32, 8, 2, 0)
    share = slice(2, 6)  # a tensor-parallel rank's experts: picks of 0, 1, 6 and 7 are another rank's

    out = moe_experts(x, weights, expert_ids, gate_up[share], down[share], first_expert=2)

    expected = oracle.moe_experts(float64_values(x), float64_values(weights), expert_ids.cpu().numpy(),
                                  float64_values(gate_up[share]), float64_values(down[share]), first_expert=2)
    assert_matches(out, expected, "float32")


def test_no_tokens_and_weights_it_cannot_read_are_answered_clearly():
    rng = np.random.default_rng(5)
    (x, weights, expert_ids, gate_up, down), _ = routed_layer(rng, "float32", 3, 64, 32, 4, 2, 0)
    assert moe_experts(x[:0], weights[:0], expert_ids[:0], gate_up, down).shape == (0, 64)
    with pytest.raises(ValueError, match="float16"):
        moe_experts(x, weights, expert_ids, gate_up.half(), down)
    with pytest.raises(ValueError, match="contiguous"):
        moe_experts(x, weights, expert_ids, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)


@pytest.mark.skipif(interpreting(), reason="CUDA graphs need a GPU; the interpreter runs on CPU tensors")
def test_a_captured_call_replays_new_routing_bit_for_bit_as_a_fresh_call():
    rng = np.random.default_rng(6)
    arguments, _ = routed_layer(rng, "bfloat16", 16, 256, 128, 16, 4, 4)
    moe_experts(*arguments)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts(*arguments)

    rerouted, expected = routed_layer(rng, "bfloat16", 16, 256, 128, 16, 4, 4)
    for static, new in zip(arguments, rerouted):
        static.copy_(new)
    graph.replay()

    assert torch.equal(captured, moe_experts(*rerouted))
    assert_matches(captured, expected, "bfloat16")
