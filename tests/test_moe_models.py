"""Mixtral and Qwen3-MoE: which layers are sparse and how they route, read from config.json; the experts
stacked alike from the Hub's one-tensor-per-expert layout and transformers 5's fused one; a tensor-parallel
rank's share of the experts, whose outputs add up to the whole layer's; MoE models refused on a backend
without the MoE ops, naming why; and a tiny Mixtral served through `LLM`, greedy as transformers. (Logits
at every position against transformers are the models level's "mixtral" and "qwen3-moe" cases, and at
TP=2 against TP=1 the parallel level's.)"""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from candelabra.backends.cpu import CpuBackend
from candelabra.backends.cpu.ops import NumpyOps
from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.conformance.harness import NOT_SUPPORTED
from candelabra.conformance.model_cases import MODEL_CASES, config_json, make_reference, run_model_case
from candelabra.core.contract.ops import OpNotSupported, Ops
from candelabra.core.contract.weights import WeightRole
from candelabra.core.llm import LLM
from candelabra.core.loading.decoder_weights import load_decoder_weights
from candelabra.core.loading.dummy import DummyCheckpoint
from candelabra.core.loading.model import load_model
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.models.mixtral import Mixtral
from candelabra.core.models.qwen import Qwen3Moe
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from quantized_backends import RecordingCpuBackend
from support import LoadOnlyCommunicator

MIXTRAL, QWEN3_MOE = (next(case for case in MODEL_CASES if case.name == name) for name in ("mixtral", "qwen3-moe"))


class _OpsWithoutExperts(NumpyOps):
    route_experts = Ops.route_experts
    moe_experts = Ops.moe_experts


class CpuWithoutExperts(CpuBackend):
    """The numpy backend as one written before the MoE ops were: it leaves both to the base class."""

    name = "cpu-without-experts"

    def __init__(self):
        super().__init__()
        self.ops = _OpsWithoutExperts()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each MoE case's folder as transformers 5 saves it, and its model."""
    folders = {}
    for case in (MIXTRAL, QWEN3_MOE):
        folder, model = tmp_path_factory.mktemp(case.name), make_reference(case, seed=5)
        model.save_pretrained(folder)
        folders[case.name] = folder, model
    return folders


# ---------------------------------------------------------------------------------------------
# config.json


def test_a_qwen3_moe_layer_is_dense_when_mlp_only_layers_or_the_sparse_step_says_so():
    config = config_json(QWEN3_MOE) | {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    moe = ModelConfig.from_hf(config).moe
    assert [moe.is_sparse(layer) for layer in range(6)] == [False, True, False, False, False, True]
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (8, 2, 48)


def test_experts_are_counted_under_either_name_and_qwen3_moe_renormalizes_only_when_asked():
    written = config_json(QWEN3_MOE)  # transformers 5 writes num_local_experts; the Hub's configs num_experts
    hub = {key: value for key, value in written.items() if key != "num_local_experts"} | {"num_experts": 16}
    assert written["num_local_experts"] == 8 and ModelConfig.from_hf(hub).moe.num_experts == 16
    assert ModelConfig.from_hf(hub | {"norm_topk_prob": True}).moe.renormalize
    assert not ModelConfig.from_hf({k: v for k, v in hub.items() if k != "norm_topk_prob"}).moe.renormalize
    mixtral = config_json(MIXTRAL)
    assert ModelConfig.from_hf(mixtral | {"norm_topk_prob": False}).moe.renormalize  # Mixtral always does
    assert ModelConfig.from_hf(mixtral).moe.expert_intermediate_size == mixtral["intermediate_size"]
    assert ModelConfig.from_hf(config_json(next(c for c in MODEL_CASES if c.name == "qwen3"))).moe is None


def test_mixtral_slides_its_attention_when_config_json_gives_a_window_and_not_when_it_is_null():
    config = config_json(MIXTRAL)
    assert ModelConfig.from_hf(config).window_of(0) == 7
    assert ModelConfig.from_hf(config | {"sliding_window": None}).window_of(0) is None


def test_more_experts_a_token_than_there_are_is_refused():
    with pytest.raises(ConfigError, match="num_experts_per_tok is 9"):
        ModelConfig.from_hf(config_json(MIXTRAL) | {"num_experts_per_tok": 9})


# ---------------------------------------------------------------------------------------------
# Loading


def _experts_uploaded(folder, family, communicator=None) -> tuple[RecordingCpuBackend, dict]:
    """What the loader uploaded for `folder`'s checkpoint, and the model's layers' weights (a shard's
    with a `communicator`)."""
    backend = RecordingCpuBackend()
    with SafetensorsCheckpoint(folder) as checkpoint:
        config = ModelConfig.from_hf(checkpoint.config)
        weights = load_decoder_weights(family, config, backend, checkpoint, "float32", communicator)
    return backend, weights


def _fused_copy(model, folder):
    """`model`'s tensors as transformers 5 holds them in memory (experts fused in 3-D) written to `folder`."""
    tensors = {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in tensors)  # the layout under test
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(model.config.to_json_string())
    return folder


@pytest.mark.parametrize("case, family, parts", [(MIXTRAL, Mixtral, ("block_sparse_moe", "w1", "w3", "w2")),
                                                 (QWEN3_MOE, Qwen3Moe, ("mlp", "gate_proj", "up_proj", "down_proj"))],
                         ids=["mixtral", "qwen3-moe"])
def test_experts_stack_gate_rows_then_up_rows_from_either_layout(saved, tmp_path, case, family, parts):
    folder, model = saved[case.name]
    block, gate, up, down = parts
    hub_backend, hub = _experts_uploaded(folder, family)
    fused_backend, fused = _experts_uploaded(_fused_copy(model, tmp_path), family)
    with SafetensorsCheckpoint(folder) as checkpoint:
        for index, (hub_layer, fused_layer) in enumerate(zip(hub.layers, fused.layers)):
            if index == 1 and case is QWEN3_MOE:  # in mlp_only_layers: a dense MLP
                assert hub_layer.experts is None and fused_layer.experts is None and hub_layer.mlp_in is not None
                continue
            prefix = f"model.layers.{index}.{block}.experts"
            expected_gate_up = np.stack([np.concatenate([checkpoint.load(f"{prefix}.{e}.{gate}.weight"),
                                                         checkpoint.load(f"{prefix}.{e}.{up}.weight")])
                                         for e in range(8)])
            expected_down = np.stack([checkpoint.load(f"{prefix}.{e}.{down}.weight") for e in range(8)])
            for layer in (hub_layer, fused_layer):
                np.testing.assert_array_equal(layer.experts.gate_up, expected_gate_up)
                np.testing.assert_array_equal(layer.experts.down, expected_down)
                np.testing.assert_array_equal(layer.experts.router,
                                              checkpoint.load(f"model.layers.{index}.{block}.gate.weight"))
    for backend in (hub_backend, fused_backend):
        roles = {name: role for name, role in backend.uploads if name.endswith(("gate_up_proj", "down_proj"))
                 and ".experts." in name}
        assert roles and set(roles.values()) == {WeightRole.EXPERTS}


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: each rank a share of the experts, whole


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_each_rank_loads_the_whole_router_and_its_half_of_the_experts_from_either_layout(saved, tmp_path, layout):
    folder, model = saved[MIXTRAL.name]
    if layout == "fused":
        folder = _fused_copy(model, tmp_path)
    _, whole = _experts_uploaded(folder, Mixtral)
    shards = [_experts_uploaded(folder, Mixtral, LoadOnlyCommunicator(rank, 2))[1] for rank in (0, 1)]
    for index, layer in enumerate(whole.layers):
        for rank, shard in enumerate(shards):
            experts, kept = shard.layers[index].experts, slice(4 * rank, 4 * rank + 4)
            assert experts.first == 4 * rank
            np.testing.assert_array_equal(experts.gate_up, layer.experts.gate_up[kept])
            np.testing.assert_array_equal(experts.down, layer.experts.down[kept])
            np.testing.assert_array_equal(experts.router, layer.experts.router)


def test_ranks_holding_two_and_three_of_five_experts_add_up_to_the_whole_layer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_json(MIXTRAL) | {"num_local_experts": 5}))
    checkpoint, backend = DummyCheckpoint(tmp_path, seed=2), CpuBackend()
    whole = load_model(checkpoint, backend, "float32")
    ranks = [load_model(checkpoint, backend, "float32", communicator=LoadOnlyCommunicator(rank, 2)) for rank in (0, 1)]
    assert [(r.layers[0].experts.first, len(r.layers[0].experts.gate_up)) for r in ranks] == [(0, 2), (2, 3)]
    h = np.random.default_rng(4).standard_normal((16, whole.config.hidden_size)).astype(np.float32)
    for index, layer in enumerate(whole.layers):
        partial = [rank.mlp(rank.layers[index], h) for rank in ranks]
        assert all(np.abs(p).max() > 0 for p in partial)  # each rank's experts were picked
        np.testing.assert_allclose(partial[0] + partial[1], whole.mlp(layer, h), rtol=1e-5, atol=1e-6)


def test_more_ranks_than_a_moe_layer_has_experts_are_refused_before_loading_a_weight(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_json(MIXTRAL) | {"num_local_experts": 3}))
    backend = RecordingCpuBackend()
    with pytest.raises(ValueError, match="each MoE layer's 3 experts, fewer than the ranks: use at most 3 ranks"):
        load_model(DummyCheckpoint(tmp_path), backend, "float32", communicator=LoadOnlyCommunicator(0, 4))
    assert backend.uploads == {}


# ---------------------------------------------------------------------------------------------
# A backend without the MoE ops


def test_a_backend_without_the_moe_ops_is_refused_naming_the_op_before_loading(saved):
    folder, _ = saved[QWEN3_MOE.name]
    with pytest.raises(OpNotSupported) as refused:
        LLM(folder, backend=CpuWithoutExperts, kvcache_mem_gpu=1, kvcache_mem_cpu=0)
    assert "route_experts" in str(refused.value) and "cpu-without-experts" in str(refused.value)


def test_the_models_level_reports_moe_cases_not_supported_on_a_backend_without_the_ops():
    result = run_model_case(CpuWithoutExperts(), MIXTRAL, seed=3)
    assert result.status == NOT_SUPPORTED and "route_experts" in result.message


# ---------------------------------------------------------------------------------------------
# Serving


def test_llm_serves_a_tiny_mixtral_greedily_as_transformers_generates(saved, tmp_path):
    import torch

    _, model = saved[MIXTRAL.name]
    write_tiny_checkpoint(tmp_path, seed=0)  # for its word-level tokenizer; the model is replaced below
    model.save_pretrained(tmp_path)
    prompt = [5, 17, 42, 8, 99, 23]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    llm = LLM(tmp_path, backend="cpu", kvcache_mem_gpu=1, kvcache_mem_cpu=0)
    try:
        output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), progress=False)
    finally:
        llm.close()
    assert list(output[0].outputs[0].token_ids) == tokens[len(prompt):]
