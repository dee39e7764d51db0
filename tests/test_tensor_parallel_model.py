"""Tensor parallelism of the model: the sharding rules, loading a shard, the torch backend's
communicator over Gloo, and every model case of the models level at TP=2 against TP=1.

The multi-process tests start two real processes per run (rank 0 and 1 on 127.0.0.1, one core
each), and each run takes every case (the MoE ones with their experts split whole): three runs for
the model cases (both LM-head layouts in float32, the MoE cases in the default one only, and the GGUF
cases in bfloat16, through the torch backend's quantized kernels) and one for the collectives.
"""

import json

import numpy as np
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.backends.torch.backend import TorchBackend
from candelabra.conformance.model_cases import GGUF_MODEL_CASES, MODEL_CASES, VOCAB, make_reference
from candelabra.conformance.parallel_cases import greedy_decode, run_communicator_checks, run_parallel_cases
from candelabra.core.contract.weights import GGUF_QUANTIZED_FORMATS, QuantizedTensor
from candelabra.core.loading.dummy import DummyCheckpoint
from candelabra.core.loading.model import load_model
from candelabra.core.models.sharding import (
    LM_HEAD_LAYOUTS,
    REPLICATED,
    VOCAB_PARALLEL,
    expert_share,
    intermediate_columns,
    pad_rows,
    quantization_block,
    shard_heads,
    take_columns,
    take_experts,
    take_rows,
    vocab_rows,
)
from candelabra.core.weights.random_quantized import random_quantized
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from support import LoadOnlyCommunicator

ALL_CASES = [case for case in MODEL_CASES if case.tensor_parallel] + GGUF_MODEL_CASES
# In bfloat16: every dense GGUF case, and of the MoE families' the quantized ones in one type each (their
# experts' blocks slice whole by expert, which the float32 run above already checks in every type).
BFLOAT16_CASES = [case for case in GGUF_MODEL_CASES if not case.routes_experts or case.ggml_type == "Q8_0"]
# The LM head's layout and how the MLP splits are independent: the MoE cases run in the default layout only.
CASES_BY_LAYOUT = {VOCAB_PARALLEL: ALL_CASES,
                   REPLICATED: [case for case in ALL_CASES if not getattr(case, "routes_experts", False)]}


# ---------------------------------------------------------------------------------------------
# Sharding rules


def test_query_and_kv_heads_split_evenly_over_the_ranks():
    shards = [shard_heads(8, 4, rank, 2) for rank in range(2)]
    assert [(s.query_heads, s.kv_heads) for s in shards] == [(range(0, 4), range(0, 2)), (range(4, 8), range(2, 4))]


def test_fewer_kv_heads_than_ranks_gives_each_rank_the_kv_head_its_queries_read():
    shards = [shard_heads(8, 2, rank, 4) for rank in range(4)]
    assert [s.query_heads for s in shards] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [s.kv_heads for s in shards] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [shard_heads(4, 1, rank, 2).kv_heads for rank in range(2)] == [range(0, 1)] * 2
    for shard in shards:  # query head h reads KV head h // (8 / 2)
        assert {h // 4 for h in shard.query_heads} == set(shard.kv_heads)


@pytest.mark.parametrize("heads, kv_heads, world_size, named", [
    (6, 2, 4, ("6", "4")),  # query heads
    (12, 6, 4, ("6", "4")),  # KV heads, more of them than ranks
    (6, 2, 3, ("2", "3")),  # a rank's query heads would read two KV heads
])
def test_a_world_size_that_does_not_split_the_heads_is_refused(heads, kv_heads, world_size, named):
    with pytest.raises(ValueError) as refused:
        shard_heads(heads, kv_heads, 0, world_size)
    assert all(number in str(refused.value) for number in named) and "world size" in str(refused.value)


def test_fused_qkv_rows_are_each_ranks_q_then_k_then_v_heads():
    head_dim, heads, kv_heads = 2, 4, 2
    fused = np.arange((heads + 2 * kv_heads) * head_dim, dtype=np.float32)[:, None]  # row i holds i
    kept = take_rows(fused, shard_heads(heads, kv_heads, 1, 2).qkv_rows(heads, kv_heads, head_dim))
    q, k, v = [4, 5, 6, 7], [10, 11], [14, 15]  # query heads 2-3, KV head 1 of k (rows 8-11) and v (12-15)
    assert kept[:, 0].tolist() == q + k + v


def test_intermediate_features_split_on_the_quantization_blocks_of_the_down_projection():
    assert [intermediate_columns(96, rank, 2) for rank in range(2)] == [range(0, 48), range(48, 96)]
    # The default model: 4864 = 19 blocks of 256 (Q4_K, Q6_K), split 9 and 10 blocks.
    assert [intermediate_columns(4864, rank, 2, 256) for rank in range(2)] == [range(0, 2304), range(2304, 4864)]
    # Fewer whole blocks than ranks: single features.
    assert [intermediate_columns(256, rank, 2, 256) for rank in range(2)] == [range(0, 128), range(128, 256)]
    assert [intermediate_columns(97, rank, 2) for rank in range(2)] == [range(0, 48), range(48, 97)]


def test_experts_split_whole_and_in_order_over_the_ranks_shares_differing_by_at_most_one():
    assert [expert_share(8, rank, 2) for rank in range(2)] == [range(0, 4), range(4, 8)]
    assert [expert_share(5, rank, 2) for rank in range(2)] == [range(0, 2), range(2, 5)]
    assert [expert_share(3, rank, 3) for rank in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    for experts, world_size in ((128, 3), (60, 8), (7, 4)):
        shares = [expert_share(experts, rank, world_size) for rank in range(world_size)]
        assert [e for share in shares for e in share] == list(range(experts))
        assert {len(share) for share in shares} == {experts // world_size, -(-experts // world_size)}


def test_more_ranks_than_a_moe_layer_has_experts_is_refused_naming_both():
    with pytest.raises(ValueError, match="over 4 ranks splits each MoE layer's 3 experts, fewer than the ranks: "
                                         "use at most 3 ranks"):
        expert_share(3, 0, 4)


def test_a_ranks_experts_of_a_quantized_stack_stay_in_their_blocks():
    stack = QuantizedTensor.stack([random_quantized(np.random.default_rng(e), "Q4_K", 4, 256) for e in range(5)])
    taken = take_experts(stack, range(2, 5))
    assert isinstance(taken, QuantizedTensor) and taken.shape == (3, 4, 256)
    np.testing.assert_array_equal(taken.dequantize(), stack.dequantize()[2:5])


def test_a_vocabulary_that_does_not_divide_is_padded_to_equal_shards():
    shards = [vocab_rows(211, rank, 2) for rank in range(2)]
    assert shards == [(range(0, 106), 106), (range(106, 211), 106)]
    padded = pad_rows(take_rows(np.ones((211, 3), np.float32), [shards[1][0]]), 106)
    assert padded.shape == (106, 3) and not padded[-1].any() and padded[:-1].all()


@pytest.mark.parametrize("format", GGUF_QUANTIZED_FORMATS)
def test_quantized_row_and_column_slices_equal_slicing_the_dequantized_weight(format):
    weight = random_quantized(np.random.default_rng(7), format, 6, 3 * _block(format))
    dense, block = weight.dequantize(), _block(format)

    rows = take_rows(weight, [range(1, 3), range(4, 6)])
    assert isinstance(rows, QuantizedTensor)
    np.testing.assert_array_equal(rows.dequantize(), dense[[1, 2, 4, 5]])

    aligned = take_columns(weight, range(block, 3 * block))
    assert isinstance(aligned, QuantizedTensor) and aligned.shape == (6, 2 * block)
    np.testing.assert_array_equal(aligned.dequantize(), dense[:, block:])

    unaligned = take_columns(weight, range(5, block + 7))  # across a block boundary: dequantized, exactly
    assert isinstance(unaligned, np.ndarray) and unaligned.dtype == np.float32
    np.testing.assert_array_equal(unaligned, dense[:, 5 : block + 7])


@pytest.mark.parametrize("format", GGUF_QUANTIZED_FORMATS)
def test_quantized_padding_rows_are_zeros(format):
    padded = pad_rows(random_quantized(np.random.default_rng(3), format, 2, _block(format)), 5)
    assert padded.shape == (5, _block(format))
    assert not padded.dequantize()[2:].any()


def _block(format: str) -> int:
    return quantization_block(format)


# ---------------------------------------------------------------------------------------------
# Loading a shard (in this process: loading makes no collective call)


@pytest.fixture(scope="module")
def k_quant_checkpoint(tmp_path_factory):
    """A Qwen2 checkpoint of random Q4_K weights: 4 heads of 64 (o_proj's shards of 128 columns are half
    a block), 2 KV heads, 3 blocks of intermediate features (shards of 1 and 2 blocks)."""
    folder = tmp_path_factory.mktemp("k-quant")
    config = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 301, "hidden_size": 256, "intermediate_size": 768,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return DummyCheckpoint(folder, seed=5, quantization="Q4_K")


def uploads_of(backend) -> list[tuple]:
    """Records (name, role, the host weight) of every upload_weight call on `backend` from now on."""
    seen, upload = [], backend.upload_weight

    def recording(name, role, weight, dtype):
        seen.append((name, role, weight))
        return upload(name, role, weight, dtype)

    backend.upload_weight = recording
    return seen


@pytest.mark.parametrize("rank", [0, 1])
def test_a_shard_loads_its_rows_and_columns_keeping_block_aligned_ones_quantized(k_quant_checkpoint, rank):
    backend = TorchBackend()
    uploads = uploads_of(backend)
    model = load_model(k_quant_checkpoint, backend, "bfloat16", communicator=LoadOnlyCommunicator(rank, 2),
                       lm_head_layout=VOCAB_PARALLEL)
    weights = {name: weight for name, _, weight in uploads}
    layer = "model.layers.0"

    assert (model.num_local_heads, model.num_local_kv_heads) == (2, 1)
    assert model.config.num_heads == 4 and model.config.num_kv_heads == 2  # the whole model's config
    qkv = weights[f"{layer}.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((2 + 1 + 1) * 64, 256)
    out = weights[f"{layer}.self_attn.o_proj.weight"]  # 128 of 256 columns: half a Q4_K block, dequantized
    assert isinstance(out, np.ndarray)
    whole_out = k_quant_checkpoint.load(f"{layer}.self_attn.o_proj.weight")
    np.testing.assert_array_equal(out, whole_out[:, rank * 128 : (rank + 1) * 128])
    down = weights[f"{layer}.mlp.down_proj.weight"]  # whole blocks: still Q4_K
    assert isinstance(down, QuantizedTensor) and down.shape == (256, [256, 512][rank])
    assert weights[f"{layer}.mlp.gate_up_proj.weight"].shape == (2 * [256, 512][rank], 256)
    assert weights["lm_head.weight"].shape == (151, 256)  # 301 tokens in shards of 151, padded
    assert model.vocab_size == 301


def test_row_parallel_biases_load_on_rank_0_only(tmp_path):
    make_reference(next(c for c in MODEL_CASES if c.name == "phi2"), seed=1).save_pretrained(tmp_path)  # biases
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        first, second = (load_model(checkpoint, TorchBackend(), "float32", communicator=LoadOnlyCommunicator(rank, 2))
                         for rank in (0, 1))
    assert first.layers[0].out_bias is not None and first.layers[0].mlp_out_bias is not None
    assert second.layers[0].out_bias is None and second.layers[0].mlp_out_bias is None
    assert second.layers[0].qkv_bias is not None and second.layers[0].mlp_in_bias is not None


def test_loading_refuses_a_world_size_that_does_not_divide_the_heads(k_quant_checkpoint):
    with pytest.raises(ValueError, match=r"3 does not divide 4"):
        load_model(k_quant_checkpoint, TorchBackend(), "float32", communicator=LoadOnlyCommunicator(0, 3))


def test_an_unknown_lm_head_layout_is_refused(k_quant_checkpoint):
    with pytest.raises(ValueError, match="replicated, vocab_parallel"):
        load_model(k_quant_checkpoint, TorchBackend(), "float32", communicator=LoadOnlyCommunicator(0, 2),
                   lm_head_layout="diagonal")


def test_a_group_of_one_is_the_unsharded_model(tmp_path):
    case = next(c for c in MODEL_CASES if c.name == "qwen2")
    make_reference(case, seed=4).save_pretrained(tmp_path)
    prompt, blocks = np.arange(3, 20), list(range(4))
    backend = TorchBackend()
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        alone = load_model(checkpoint, backend, "float32")
        in_group_of_one = load_model(checkpoint, backend, "float32", communicator=LoadOnlyCommunicator(0, 1))
    assert in_group_of_one.communicator is None
    assert (in_group_of_one.num_local_heads, in_group_of_one.num_local_kv_heads) == (4, 2)
    first, second = (greedy_decode(backend, model, prompt, blocks) for model in (alone, in_group_of_one))
    np.testing.assert_array_equal(first.prompt_logits, second.prompt_logits)
    assert first.tokens == second.tokens


def test_a_backend_without_a_communicator_says_tensor_parallelism_needs_one():
    with pytest.raises(NotImplementedError, match=r"backend 'cpu' offers no communicator, which tensor parallelism"):
        CpuBackend().communicator("127.0.0.1", 29500)


# ---------------------------------------------------------------------------------------------
# Two real processes


def test_the_torch_communicator_over_gloo():
    results = {r.check: r for r in run_communicator_checks("torch", 2, seed=5)}
    assert all(r.status == "passed" for r in results.values()), results
    assert set(results) == {"all_reduce float32", "all_reduce bfloat16", "all_reduce float16", "all_gather dim=0",
                            "all_gather dim=-1", "broadcast_object from rank 1", "barrier"}
    for dtype in ("float32", "bfloat16", "float16"):  # Gloo sums low precision exactly, then rounds once
        assert "each element the exact sum rounded once" in results[f"all_reduce {dtype}"].detail


@pytest.fixture(scope="module")
def tensor_parallel_results():
    """The cases at TP=2 against TP=1 in float32, in both LM-head layouts: {(layout, case): result}."""
    results = {}
    for layout in LM_HEAD_LAYOUTS:
        for result in run_parallel_cases("torch", 2, CASES_BY_LAYOUT[layout], seed=11, dtype="float32",
                                         lm_head_layout=layout):
            results[layout, result.case] = result
    return results


@pytest.mark.parametrize("layout, case", [(layout, case.name) for layout, cases in CASES_BY_LAYOUT.items()
                                          for case in cases])
def test_every_case_at_tp2_matches_tp1(tensor_parallel_results, layout, case):
    """Logits within the float32 model threshold, and the same 16 greedy tokens. The safetensors
    cases' vocabulary does not divide over 2 ranks, so the vocabulary-parallel head pads its shards."""
    result = tensor_parallel_results[layout, case]
    assert result.status == "passed" and result.greedy == "16/16", result
    assert VOCAB % 2 == 1


@pytest.fixture(scope="module")
def bfloat16_results():
    return {r.case: r for r in run_parallel_cases("torch", 2, BFLOAT16_CASES, seed=11, dtype="bfloat16")}


@pytest.mark.parametrize("case", [case.name for case in BFLOAT16_CASES])
def test_quantized_cases_at_tp2_match_tp1_in_bfloat16(bfloat16_results, case):
    """Through the torch backend's int4 and int8 kernels on sliced GGUF blocks: logits within the bfloat16
    model threshold, greedy tokens the same up to a tie."""
    result = bfloat16_results[case]
    assert result.status == "passed", result


def test_quantized_cases_at_tp2_match_tp1_where_activations_may_be_rounded(monkeypatch):
    """With CANDELABRA_INT8_ACTIVATIONS=1 (inherited by both ranks) each shard and the whole model take their
    kernels apart, one rounding x where another's check passed it over: the limit that admits the rounding
    applies."""
    from candelabra.conformance.model_cases import GGUFModelCase

    monkeypatch.setenv("CANDELABRA_INT8_ACTIVATIONS", "1")
    cases = [GGUFModelCase("qwen2", "Q5_0"), GGUFModelCase("llama", "Q4_1")]
    results = run_parallel_cases("torch", 2, cases, seed=13, dtype="float32")
    assert [r.status for r in results] == ["passed", "passed"], results
