"""A family's graph is the block it names, and the loader, not the model, reads the checkpoint: every
family's block norms are tensors its checkpoints hold, StableLM's config.json picks its block, and a
model computes from the weights it is handed."""

import json

import numpy as np
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.conformance.model_cases import MODEL_CASES, config_json
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.loading.decoder_weights import load_decoder_weights
from candelabra.core.loading.dummy import DummyCheckpoint
from candelabra.core.loading.model import load_model
from candelabra.core.loading.model_tensors import model_tensors
from candelabra.core.models.blocks import ParallelBlock, SandwichBlock, SequentialBlock
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.models.stablelm import StableLm
from candelabra.core.worker.model_runner import ModelRunner
from candelabra.plugins import installed_plugins


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda case: case.name)
def test_every_family_runs_one_block_whose_norms_its_checkpoints_hold(case):
    config = ModelConfig.from_hf(config_json(case))
    family = installed_plugins().model_architectures.get(config.architecture)
    block = family.block_for(config)
    assert isinstance(block, SequentialBlock | SandwichBlock | ParallelBlock)
    tensors = model_tensors(config, family)
    for layer in range(config.num_layers):
        assert {f"model.layers.{layer}.{name}.weight" for name in block.norm_names} <= tensors.keys()


def test_stablelm_takes_its_block_from_config_json_and_refuses_qk_layer_norms():
    base = config_json(next(case for case in MODEL_CASES if case.name == "stablelm"))
    assert StableLm.block_for(ModelConfig.from_hf(base | {"use_parallel_residual": False})) == SequentialBlock()
    assert StableLm.block_for(ModelConfig.from_hf(base | {"use_parallel_residual": True})) == ParallelBlock()
    with pytest.raises(ConfigError, match="qk_layernorm"):
        StableLm.block_for(ModelConfig.from_hf(base | {"qk_layernorm": True}))


def _logits(model, prompt: np.ndarray) -> np.ndarray:
    block_size = 16
    blocks = list(range(-(-len(prompt) // block_size)))
    runner = ModelRunner(model, num_blocks=len(blocks), block_size=block_size)
    step = StepMetadata.build([len(prompt)], [len(prompt)], [blocks], block_size, logits_rows=np.arange(len(prompt)))
    return model.backend.to_host(runner.logits(prompt, step))


def test_a_model_computes_from_the_weights_it_is_handed(tmp_path):
    case = next(case for case in MODEL_CASES if case.name == "gemma2")
    (tmp_path / "config.json").write_text(json.dumps(config_json(case)))
    checkpoint, backend = DummyCheckpoint(tmp_path, seed=3), CpuBackend()
    config = ModelConfig.from_hf(checkpoint.config)
    family = installed_plugins().model_architectures.get(config.architecture)
    weights = load_decoder_weights(family, config, backend, checkpoint, "float32")
    prompt = np.random.default_rng(4).integers(0, config.vocab_size, 21)

    first, second = family(config, backend, weights), family(config, backend, weights)
    assert first.layers is second.layers is weights.layers
    expected = _logits(load_model(checkpoint, backend, "float32"), prompt)
    np.testing.assert_array_equal(_logits(first, prompt), expected)
    np.testing.assert_array_equal(_logits(second, prompt), expected)
    assert np.isfinite(expected).all() and expected.std() > 0
