"""Random weights in every quantized format, for dummy checkpoints and the conformance cases.

Every byte of every GGUF block is random, so each bit a decoder reads matters; only the float16
scales (and minimums) are set, to finite values of either sign. A grouped int4 weight has random
codes and zero points (whole numbers 0 to 15) and scales of either sign. Each value is linear in them, so
scaling them all alike gives the weight the size asked for: by default a root mean square of
in_features**-0.5, which keeps outputs near 1, the size of the conformance cases' biases.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from candelabra.core.contract.weights import INT4_GROUP_FORMATS, QuantizedTensor, pack_int4_groups

# Byte offsets of the float16 fields (scales and minimums) in one block of each format, as
# ggml-common.h lays the blocks out.
FLOAT16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip

# Rows are independent and alike, so this many measure the root mean square well; measuring all of
# an LM-head-sized weight would decode hundreds of megabytes for one number.
ROWS_MEASURED = 256


def random_quantized(rng: np.random.Generator, format: str, rows: int, columns: int,
                     rms: float | None = None) -> QuantizedTensor:
    """A fresh random `rows` x `columns` weight in `format` whose values have root mean square
    `rms` (default columns**-0.5); `columns` must fill whole blocks."""
    if format in INT4_GROUP_FORMATS:
        return _random_int4_groups(rng, INT4_GROUP_FORMATS[format], rows, columns, rms)
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[format]]
    blocks = rng.integers(0, 256, size=(rows * columns // values, size), dtype=np.uint8)
    fields = {offset: rng.uniform(1.0, 10.0, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks))
              for offset in FLOAT16_FIELDS[format]}
    _set_float16_fields(blocks, fields)
    measured = min(rows, ROWS_MEASURED)
    sample = QuantizedTensor(format, blocks.reshape(rows, -1)[:measured], (measured, columns)).dequantize()
    target = columns**-0.5 if rms is None else rms
    factor = target / np.sqrt(np.mean(np.square(sample, dtype=np.float64)))
    _set_float16_fields(blocks, {offset: field * factor for offset, field in fields.items()})
    return QuantizedTensor(format, blocks.reshape(rows, -1), (rows, columns))


def _set_float16_fields(blocks: np.ndarray, fields: dict[int, np.ndarray]) -> None:
    for offset, field in fields.items():
        blocks[:, offset : offset + 2] = field.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _random_int4_groups(rng: np.random.Generator, group: int, rows: int, columns: int,
                        rms: float | None) -> QuantizedTensor:
    if columns % group:
        raise ValueError(f"groups of {group} values: {columns} columns are not whole groups")
    codes = rng.integers(0, 16, size=(rows, columns))
    zeros = rng.integers(0, 16, size=(rows, columns // group))
    scales = rng.uniform(1.0, 10.0, zeros.shape) * rng.choice([-1.0, 1.0], zeros.shape)
    measured = min(rows, ROWS_MEASURED)
    sample = pack_int4_groups(codes[:measured], scales[:measured], zeros[:measured]).dequantize()
    target = columns**-0.5 if rms is None else rms
    return pack_int4_groups(codes, scales * target / np.sqrt(np.mean(np.square(sample, dtype=np.float64))), zeros)
