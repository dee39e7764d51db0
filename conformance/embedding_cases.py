"""Conformance of pooled embeddings: candelabra's vectors against transformers', per architecture.

For a case of `model_cases.MODEL_CASES` the same tiny random checkpoint is made (`make_reference`)
and loaded on the backend; three prompts (5 tokens, the case's prompt length, 13) are embedded by
`core.engine.pooling.embed` (one batched forward, through the paged cache, as the server runs it)
with mean and with last-token pooling, L2-normalized. The reference is transformers' final hidden
states, `output_hidden_states=True`'s last entry, pooled and normalized the same way in float64.
That last entry is taken only after checking, for each model, that it equals the base model's
`last_hidden_state` (the output after the final norm), so that both sides pool normed states.
Each pooling passes when the NMSE over all vectors is within the float32 model threshold.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import numpy as np

from candelabra.conformance.compare import MODEL_NMSE_THRESHOLDS, nmse
from candelabra.conformance.model_cases import BLOCK_SIZE, VOCAB, ModelCase, make_reference, quiet_reference
from candelabra.core.contract.backend import Backend
from candelabra.core.engine.pooling import POOLINGS, embed
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.worker.model_runner import ModelRunner

SHORT_PROMPTS = (5, 13)  # beside the case's own prompt length: inputs shorter and longer than a block


@dataclass
class EmbeddingResult:
    case: str
    architecture: str
    status: str
    nmse: dict[str, float]  # per pooling
    seed: int
    message: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def reference_embeddings(model, prompts: list[np.ndarray], pooling: str) -> np.ndarray:
    """transformers' final hidden states of each prompt, pooled ("mean" or "last") and L2-normalized,
    in float64. Raises AssertionError when the last hidden state is not the final-normed output."""
    import torch

    vectors = []
    with quiet_reference():
        for prompt in prompts:
            output = model(torch.tensor(prompt, dtype=torch.long)[None], output_hidden_states=True)
            states = output.hidden_states[-1][0].double()
            normed = model.base_model(torch.tensor(prompt, dtype=torch.long)[None]).last_hidden_state[0].double()
            if not torch.allclose(states, normed, rtol=1e-5, atol=1e-5):
                raise AssertionError(f"{type(model).__name__}: hidden_states[-1] is not the final-normed output")
            vector = states.mean(dim=0) if pooling == "mean" else states[-1]
            vectors.append((vector / vector.norm()).numpy())
    return np.stack(vectors)


def run_embedding_case(backend: Backend, case: ModelCase, seed: int) -> EmbeddingResult:
    """Candelabra's mean- and last-pooled embeddings of `case`'s model on `backend`, in float32,
    against transformers'."""
    from candelabra.core.loading.model import load_model
    from candelabra.core.weights.safetensors import SafetensorsCheckpoint

    reference = make_reference(case, seed)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        with SafetensorsCheckpoint(folder) as checkpoint:
            model = load_model(checkpoint, backend, "float32")
    rng = np.random.default_rng(seed)
    lengths = (SHORT_PROMPTS[0], case.prompt_tokens, SHORT_PROMPTS[1])
    prompts = [rng.integers(3, VOCAB, length) for length in lengths]
    num_blocks = sum(-(-length // BLOCK_SIZE) for length in lengths) + 2
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    blocks = BlockManager(num_blocks, BLOCK_SIZE)
    errors, problems = {}, []
    threshold = MODEL_NMSE_THRESHOLDS["float32"]
    for pooling in POOLINGS:
        ours = embed(runner, blocks, [p.tolist() for p in prompts], pooling, normalize=True)
        errors[pooling] = nmse(ours, reference_embeddings(reference, prompts, pooling))
        if not errors[pooling] <= threshold:
            problems.append(f"{pooling} pooling NMSE {errors[pooling]:.3g} > {threshold:.0e}")
        if blocks.num_free_blocks != num_blocks:
            problems.append(f"{pooling} pooling left {num_blocks - blocks.num_free_blocks} blocks allocated")
    return EmbeddingResult(case.name, type(reference).__name__, "failed" if problems else "passed", errors, seed,
                           "; ".join(problems))
