"""Experts in host memory (`--num-experts-offload-per-rank`): the slots' bookkeeping against a random
walk, a layer's copies and counts over a scripted routing, a tiny Mixtral's float32 logits unchanged
on a torch backend standing in for a device with memory of its own (and on cuda's ops through the
Triton interpreter), the flag's refusals, the CPU backends where it changes nothing, and the flags served
through to the model and its counts to /metrics."""

import json
import logging

import numpy as np
import pytest
from fastapi.testclient import TestClient

from candelabra.backends.cpu import CpuBackend
from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core import cli
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.contract.weights import WeightRole
from candelabra.core.loading.dummy import DummyCheckpoint
from candelabra.core.loading.model import load_model
from candelabra.core.loading.open import open_model
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.models.expert_slots import ExpertSlots
from candelabra.core.models.layer_weights import Experts
from candelabra.core.models.moe import run_experts
from candelabra.core.models.offloaded_experts import ExpertOffload, OffloadedExperts, expert_cache_counts
from candelabra.core.server import launch
from candelabra.core.server.app import build_app
from candelabra.core.worker.model_runner import ModelRunner
from device_memory_backends import CudaWithDeviceMemory, TorchWithDeviceMemory

# 8 experts, 2 a token, in 3 layers; the vocabulary of the engine checkpoint's word-level tokenizer.
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 160, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "silu",
    "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2, "eos_token_id": 1,
}
BLOCK_SIZE = 16


def write_mixtral(folder, **changes):
    """A folder of the tiny Mixtral's config.json (its weights: --load-format dummy) and a tokenizer."""
    write_tiny_checkpoint(folder, seed=0)
    (folder / "model.safetensors").unlink()
    (folder / "config.json").write_text(json.dumps(MIXTRAL_CONFIG | changes))
    return folder


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return write_mixtral(tmp_path_factory.mktemp("mixtral"))


def logits_of(backend, folder, offload: ExpertOffload | None, prompt_tokens: int = 21, decode_steps: int = 4):
    """The float32 logits of a prompt's every position and of greedy decode steps after it, and the model."""
    model = load_model(DummyCheckpoint(folder), backend, "float32", expert_offload=offload)
    runner = ModelRunner(model, num_blocks=4, block_size=BLOCK_SIZE)
    blocks = [3, 0, 2, 1]
    prompt = np.random.default_rng(1).integers(2, 160, prompt_tokens)
    prefill = StepMetadata.build([prompt_tokens], [prompt_tokens], [blocks], BLOCK_SIZE,
                                 logits_rows=np.arange(prompt_tokens))
    logits = [backend.to_host(runner.logits(prompt, prefill))]
    for length in range(prompt_tokens + 1, prompt_tokens + 1 + decode_steps):
        token = np.array([int(np.argmax(logits[-1][-1]))])
        logits.append(backend.to_host(runner.logits(token, StepMetadata.build([1], [length], [blocks], BLOCK_SIZE))))
    return logits, model


# ---------------------------------------------------------------------------------------------
# The slots


def test_a_full_layer_copies_a_missing_expert_over_its_least_recently_used_one():
    slots = ExpertSlots(2)
    assert [turn.copies for turn in slots.turns([10])] == [((10, 0),)]
    assert [turn.copies for turn in slots.turns([11, 11])] == [((11, 1),)]
    hit = slots.turns([10])
    assert hit[0].copies == () and hit[0].hits == 1 and list(slots.held) == [11, 10]
    assert [turn.copies for turn in slots.turns([12])] == [((12, 1),)]  # 11 was used least recently
    assert slots.held == {10: 0, 12: 1} and list(slots.held) == [10, 12]
    assert slots.turns([]) == []


def test_more_experts_than_slots_run_in_turns_the_hits_first():
    slots = ExpertSlots(2)
    slots.turns([10, 11])
    turns = slots.turns([12, 11, 13, 14, 10])
    assert [turn.slots for turn in turns] == [{11: 1, 10: 0}, {12: 1, 13: 0}, {14: 1}]
    assert [turn.copies for turn in turns] == [(), ((12, 1), (13, 0)), ((14, 1),)]
    assert [turn.hits for turn in turns] == [2, 0, 0]


def test_random_routing_finds_every_picked_expert_in_its_slot_and_evicts_only_the_least_recently_used():
    rng = np.random.default_rng(7)
    for num_slots in (1, 3, 5):
        slots, content, last_used, clock = ExpertSlots(num_slots), [None] * num_slots, {}, 0
        for _ in range(300):
            picked = rng.integers(0, 12, rng.integers(1, 9)).tolist()
            held_before = set(slots.held)
            turns = slots.turns(picked)
            assert sorted(e for turn in turns for e in turn.slots) == sorted(set(picked))
            assert turns[0].hits == len(held_before & set(picked)) and all(t.hits == 0 for t in turns[1:])
            for turn in turns:
                assert len(turn.slots) <= num_slots
                for expert, slot in turn.copies:
                    evicted = content[slot]
                    assert (evicted is None) == (None in content)  # a free slot is filled before any eviction
                    if evicted is not None:
                        others = [e for e in content if e is not None and e not in turn.slots]
                        assert last_used[evicted] == min(last_used[e] for e in others)
                    content[slot] = expert
                for expert, slot in turn.slots.items():
                    assert content[slot] == expert
                    clock += 1
                    last_used[expert] = clock
            assert slots.held == {e: s for s, e in enumerate(content) if e is not None}
            assert list(slots.held) == sorted(slots.held, key=last_used.get)


# ---------------------------------------------------------------------------------------------
# One layer's copies and counts


def test_a_scripted_routing_counts_hits_misses_and_bytes_and_every_step_matches_the_experts_kept_whole():
    backend = TorchWithDeviceMemory()
    rng = np.random.default_rng(3)
    gate_up = rng.standard_normal((6, 8, 16)).astype(np.float32)  # experts 0-2 stay, 3-5 live in host memory
    down = rng.standard_normal((6, 16, 4)).astype(np.float32)
    layer = OffloadedExperts.place(backend, ExpertOffload(3, cache_slots=2), "MixtralForCausalLM",
                                   ("gate_up", "down"), gate_up, down, "float32",
                                   lambda name, weight: backend.upload_weight(name, WeightRole.EXPERTS, weight,
                                                                              "float32"))
    assert tuple(layer.gate_up.shape) == (5, 8, 16) and tuple(layer.down.shape) == (5, 16, 4)
    experts = Experts(router=None, gate_up=layer.gate_up, down=layer.down, offloaded=layer)
    whole = backend.to_device(gate_up), backend.to_device(down)
    # step: the picks, and the (hits, misses) it adds
    script = [([[0, 3]], (0, 1)),                 # 3 copied into slot 0
              ([[3, 4]], (1, 1)),                 # 3 there, 4 into slot 1
              ([[5, 1], [4, 0]], (1, 1)),         # 4 there, 5 over 3, the least recently used
              ([[3, 4], [5, 2], [0, 4]], (2, 1))]  # 4 and 5 run first, then 3 over 4: in three turns
    for step, (picks, (hits, misses)) in enumerate(script):
        before = layer.counts.hits, layer.counts.misses
        ids = backend.to_device(np.array(picks, np.int32))
        h = backend.to_device(rng.standard_normal((len(picks), 16)).astype(np.float32))
        weights = backend.to_device(rng.uniform(0.1, 1.0, (len(picks), 2)).astype(np.float32))
        expected = backend.to_host(backend.ops.moe_experts(h, weights, ids, *whole))
        np.testing.assert_array_equal(backend.to_host(run_experts(backend.ops, experts, h, weights, ids)), expected)
        assert (layer.counts.hits - before[0], layer.counts.misses - before[1]) == (hits, misses), f"step {step}"
    assert list(layer.slots.held) == [5, 3] and layer.slots.held == {5: 0, 3: 1}
    assert layer.counts.bytes_copied == 4 * (8 * 16 + 16 * 4) * 4
    np.testing.assert_array_equal(backend.to_host(layer.gate_up)[3:], gate_up[[5, 3]])
    np.testing.assert_array_equal(backend.to_host(layer.down)[:3], down[:3])


def test_a_tensor_parallel_ranks_share_gives_its_experts_output_with_some_in_host_memory():
    """Rank 1 of 2 holds the layer's experts 4 to 7, the last 2 in host memory with one slot: random
    routing over all 8 runs its own picks in turns and leaves out the others, as the share kept whole does."""
    backend = TorchWithDeviceMemory()
    rng = np.random.default_rng(5)
    gate_up = rng.standard_normal((4, 8, 16)).astype(np.float32)
    down = rng.standard_normal((4, 16, 4)).astype(np.float32)
    layer = OffloadedExperts.place(backend, ExpertOffload(2, cache_slots=1), "MixtralForCausalLM",
                                   ("gate_up", "down"), gate_up, down, "float32",
                                   lambda name, weight: backend.upload_weight(name, WeightRole.EXPERTS, weight,
                                                                              "float32"),
                                   first_expert=4, layer_experts=8)
    experts = Experts(router=None, gate_up=layer.gate_up, down=layer.down, offloaded=layer, first=4)
    whole = backend.to_device(gate_up), backend.to_device(down)
    for step in range(6):
        picks = np.stack([rng.choice(8, 2, replace=False) for _ in range(5)]).astype(np.int32)
        ids = backend.to_device(picks)
        h = backend.to_device(rng.standard_normal((5, 16)).astype(np.float32))
        weights = backend.to_device(rng.uniform(0.1, 1.0, (5, 2)).astype(np.float32))
        expected = backend.to_host(backend.ops.moe_experts(h, weights, ids, *whole, first_expert=4))
        np.testing.assert_array_equal(backend.to_host(run_experts(backend.ops, experts, h, weights, ids)), expected,
                                      err_msg=f"step {step}")
    assert layer.counts.misses > 1 and set(layer.slots.held) <= {2, 3}  # the share's last two, by its own index


# ---------------------------------------------------------------------------------------------
# A whole model


def test_a_tiny_mixtral_gives_the_same_float32_logits_with_half_its_experts_in_host_memory(mixtral):
    backend = TorchWithDeviceMemory()
    assert not backend.shares_host_memory()
    expected, _ = logits_of(backend, mixtral, None)
    got, model = logits_of(backend, mixtral, ExpertOffload(4, cache_slots=2))
    assert [tuple(layer.experts.gate_up.shape) for layer in model.layers] == [(6, 192, 64)] * 3
    counts = expert_cache_counts(model.layers)
    assert counts.hits > 0 and counts.misses > 0
    for step, (ours, whole) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(ours, whole, err_msg=f"step {step}")


def test_the_cuda_backends_ops_give_the_same_logits_with_experts_in_host_memory(tmp_path):
    if not CudaWithDeviceMemory.probe().available:
        pytest.skip(CudaWithDeviceMemory.probe().reason)
    folder = write_mixtral(tmp_path, num_hidden_layers=1)  # the interpreter takes seconds a layer
    backend = CudaWithDeviceMemory()
    expected, _ = logits_of(backend, folder, None, prompt_tokens=5, decode_steps=0)
    got, model = logits_of(backend, folder, ExpertOffload(4, cache_slots=1), prompt_tokens=5, decode_steps=0)
    assert expert_cache_counts(model.layers).misses >= 2  # so in turns, one slot for several experts
    np.testing.assert_array_equal(got[0], expected[0])


# ---------------------------------------------------------------------------------------------
# The flag's refusals


def test_a_dense_model_or_as_many_experts_offloaded_as_a_layer_has_is_refused():
    dense = MIXTRAL_CONFIG | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_local_experts": 0}
    with pytest.raises(ConfigError, match="a LlamaForCausalLM is a dense model, with no experts to keep in host"):
        ExpertOffload(2).check_model(ModelConfig.from_hf(dense))
    with pytest.raises(ConfigError) as too_many:
        ExpertOffload(8).check_model(ModelConfig.from_hf(MIXTRAL_CONFIG))
    assert str(too_many.value) == ("--num-experts-offload-per-rank 8: a MixtralForCausalLM layer holds 8 experts on "
                                   "this rank, so at most 7 can live in host memory (one at least stays on the "
                                   "device)")
    ExpertOffload(7).check_model(ModelConfig.from_hf(MIXTRAL_CONFIG))


@pytest.mark.parametrize("offloaded, slots, problem", [
    (0, None, "--num-experts-offload-per-rank must be at least 1 to keep experts in host memory, not 0"),
    (4, 0, "--expert-cache-slots must be between 1 and --num-experts-offload-per-rank (4), not 0"),
    (4, 5, "--expert-cache-slots must be between 1 and --num-experts-offload-per-rank (4), not 5"),
])
def test_slots_outside_one_to_the_experts_offloaded_are_refused(offloaded, slots, problem):
    with pytest.raises(ValueError) as refused:
        ExpertOffload(offloaded, slots)
    assert str(refused.value) == problem


def test_the_slots_default_to_a_quarter_of_the_experts_offloaded_rounded_up():
    assert [ExpertOffload(n).slots for n in (1, 4, 5, 64)] == [1, 1, 2, 16]
    assert ExpertOffload(64, cache_slots=8).slots == 8


def test_serve_refuses_the_flag_for_a_dense_model_before_loading(tmp_path, capsys):
    write_tiny_checkpoint(tmp_path, seed=0)  # a Qwen2
    assert cli.main(["serve", "--weight-path", str(tmp_path), "--backend", "cpu", "--port", "0",
                     "--num-experts-offload-per-rank", "2"]) == 1
    assert capsys.readouterr().err == ("error: --num-experts-offload-per-rank 2: a Qwen2ForCausalLM is a dense model, "
                                       "with no experts to keep in host memory\n")


class CpuWithDeviceMemory(CpuBackend):
    """The numpy backend as one whose memory would be its own, without the methods that copy experts in."""

    name = "cpu-device-memory"

    def shares_host_memory(self) -> bool:
        return False


def test_a_backend_with_memory_of_its_own_that_cannot_copy_experts_in_is_refused_naming_the_methods(mixtral):
    with pytest.raises(NotImplementedError) as refused:
        load_model(DummyCheckpoint(mixtral), CpuWithDeviceMemory(), "float32", expert_offload=ExpertOffload(2))
    message = str(refused.value)
    assert message.startswith("backend 'cpu-device-memory' cannot keep experts in host memory")
    assert "Backend.host_experts and Backend.write_expert" in message and "docs/backend-contract.md" in message


def test_on_a_backend_whose_tensors_are_in_host_memory_the_flag_changes_nothing_and_says_so(mixtral, caplog):
    with caplog.at_level(logging.INFO, logger="candelabra"):
        model = load_model(DummyCheckpoint(mixtral), CpuBackend(), "float32", expert_offload=ExpertOffload(4))
    assert "--num-experts-offload-per-rank 4 changes nothing on backend 'cpu'" in caplog.text
    assert all(layer.experts.offloaded is None and layer.experts.gate_up.shape[0] == 8 for layer in model.layers)


# ---------------------------------------------------------------------------------------------
# Served, with /metrics


def test_serve_passes_the_flags_to_the_model_and_metrics_count_its_hits_misses_and_bytes_copied(mixtral):
    args = cli._parser(chosen="serve").parse_args([
        "serve", "--weight-path", str(mixtral), "--load-format", "dummy", "--kvcache-mem-gpu", "1",
        "--kvcache-mem-cpu", "0", "--num-experts-offload-per-rank", "4", "--expert-cache-slots", "2"])
    served = launch._load(args, TorchWithDeviceMemory, open_model(str(mixtral), load_format="dummy"))
    try:
        assert launch._experts_line(served.llm.model) == [
            "experts   4 of 8 per MoE layer in host memory, 2 device slots a layer for them"]
        with TestClient(build_app(served)) as client:
            completion = client.post("/v1/completions", json={"prompt": [5, 17, 42, 8], "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True})
            assert completion.status_code == 200, completion.text
            scraped = client.get("/metrics").text
    finally:
        served.engine.shutdown()
        served.llm.close()
    counts = expert_cache_counts(served.llm.model.layers)
    assert counts.misses > 0
    for name, value in (("cache_hits", counts.hits), ("cache_misses", counts.misses),
                        ("bytes_copied", counts.bytes_copied)):
        assert f'candelabra_expert_{name}_total{{model_name="{mixtral.name}"}} {float(value)}' in scraped
