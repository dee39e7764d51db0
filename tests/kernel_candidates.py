"""Forms for the kernel table, selection and tuning tests: real int8 and dense weights, with a kernel made
wrong, failing or rounding x where a test asks."""

from __future__ import annotations

import numpy as np
import torch

from candelabra.backends.torch.kernel_selection import Candidate
from candelabra.backends.torch.weight_forms import DenseWeight, Int8Weight

SHAPE = (48, 256)


def int8_and_dense_candidates(rng=None, broken: str | None = None, failing: str | None = None,
                              shape=SHAPE) -> list[Candidate]:
    """An int8 form and a dense one of the same random weight; the int8 form's kernel `broken` answers ones,
    and its kernel `failing` raises."""
    rng = rng or np.random.default_rng(1)
    values = rng.integers(-127, 128, shape, dtype=np.int8)
    scales = rng.uniform(0.001, 0.01, shape[0]).astype(np.float32)

    def int8() -> Int8Weight:
        kept = Int8Weight.from_rows(values, scales, torch.bfloat16)
        real = kept.kernels()
        if broken:
            real[broken] = lambda x: torch.zeros(x.shape[0], shape[0], dtype=torch.bfloat16) + 1
        if failing:
            real[failing] = lambda x: (_ for _ in ()).throw(RuntimeError("no AVX-512"))
        kept.kernels = lambda: real
        return kept

    dense = lambda: DenseWeight(int8().dense())  # noqa: E731
    return [Candidate("int8", int8), Candidate("dense", dense)]


def rounding_candidates(bits: int = 8) -> list[Candidate]:
    """The int8 form with one more kernel, `int8_rounded`, that rounds each row of x to `bits` bits per block
    of 32 before the product, as the GGUF blocks' int8 kernel does with 8."""
    candidates = int8_and_dense_candidates()
    build = candidates[0].build
    largest = 2 ** (bits - 1) - 1

    def rounding() -> Int8Weight:
        kept = build()
        real = kept.kernels()

        def rounded(x):
            blocks = x.float().reshape(x.shape[0], -1, 32)
            scale = blocks.abs().amax(-1, keepdim=True) / largest
            return real["int8_mm"]((torch.round(blocks / scale) * scale).reshape(x.shape).to(x.dtype))
        kept.kernels = lambda: {**real, "int8_rounded": rounded}
        kept.rounds_activations = frozenset({"int8_rounded"})
        return kept
    candidates[0].build = rounding
    return candidates
