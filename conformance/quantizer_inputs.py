"""The weights our GGML quantizers are measured on against llama.cpp's reference quantizers: the
inputs of bench/kquant_reference_error.py, which measured llama.cpp's error on them, and of the tests
that hold our quantizers to those numbers.

Each input is float32 [super-blocks, 256], a whole number of blocks of every format (a weight's rows
one after another: GGML's quantizers take a row as a stream of blocks).
"""

from __future__ import annotations

import numpy as np

from candelabra.core.weights.default_model import default_model_path

RANDOM_SEED = 0
RANDOM_SUPER_BLOCKS = 512

# Tensors of the default model's GGUF, dequantized, and how many of their first rows: a Q6_K
# projection, a Q5_0 one and a Q8_0 one, so no format meets only values already on its own grid.
REAL_TENSORS = {
    "model.layers.0.mlp.down_proj.weight": 64,
    "model.layers.12.self_attn.q_proj.weight": 256,
    "model.layers.0.self_attn.v_proj.weight": 128,
}


def random_normal_weights() -> np.ndarray:
    """Standard normal values, seeded."""
    rng = np.random.default_rng(RANDOM_SEED)
    return rng.standard_normal((RANDOM_SUPER_BLOCKS, 256), dtype=np.float32)


def real_weights() -> np.ndarray:
    """The first rows of REAL_TENSORS from the default model, as gguf dequantizes them."""
    from candelabra.core.weights.gguf import GGUFCheckpoint

    with GGUFCheckpoint(default_model_path()) as checkpoint:
        rows = [checkpoint.load(name)[:count].reshape(-1) for name, count in REAL_TENSORS.items()]
    return np.concatenate(rows).reshape(-1, 256)


def relative_rms_error(weights: np.ndarray, decoded: np.ndarray) -> float:
    """The root mean square of the difference over that of the weights, in float64."""
    weights, decoded = weights.astype(np.float64), decoded.astype(np.float64).reshape(weights.shape)
    return float(np.sqrt(np.mean((decoded - weights) ** 2) / np.mean(weights**2)))
