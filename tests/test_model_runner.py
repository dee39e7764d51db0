"""The model runner batches sequences: each gets the logits it would get alone."""

import tempfile

import numpy as np
import pytest

from candelabra.conformance.compare import nmse
from candelabra.conformance.model_cases import MODEL_CASES, make_reference
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.loading.model import load_model
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from candelabra.core.worker.model_runner import ModelRunner
from candelabra.plugins import installed_plugins
from support import available_backends

BLOCK = 16


@pytest.fixture(scope="module")
def checkpoint():
    reference = make_reference(next(c for c in MODEL_CASES if c.name == "gemma2"), seed=3)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        yield SafetensorsCheckpoint(folder)


@pytest.mark.parametrize("backend_name", available_backends())
def test_mixed_batch_matches_each_sequence_alone(checkpoint, backend_name):
    backend = installed_plugins().backends.get(backend_name)()
    model = load_model(checkpoint, backend, "float32")
    rng = np.random.default_rng(5)
    first, second = rng.integers(3, 200, 30).tolist(), rng.integers(3, 200, 25).tolist()

    def alone(tokens, blocks):
        runner = ModelRunner(model, num_blocks=8, block_size=BLOCK)
        meta = StepMetadata.build([len(tokens)], [len(tokens)], [blocks], BLOCK)
        return backend.to_host(runner.logits(np.array(tokens), meta))[0]

    # In one runner: the first sequence's prompt (all but its last token) and the second's first
    # 10 tokens; then one step with the first's last token (a decode) and the rest of the second
    # (a chunk of prefill), side by side.
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK)
    tables = [[5, 2], [7, 0]]
    warmup = StepMetadata.build([29, 10], [29, 10], tables, BLOCK)
    runner.logits(np.array(first[:29] + second[:10]), warmup)
    step = StepMetadata.build([1, 15], [30, 25], tables, BLOCK)
    batched = backend.to_host(runner.logits(np.array(first[29:] + second[10:]), step))

    assert nmse(batched[0], alone(first, [1, 3])) < 1e-9
    assert nmse(batched[1], alone(second, [4, 6])) < 1e-9
