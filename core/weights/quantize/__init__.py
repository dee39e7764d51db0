"""Dense weights quantized into GGML's block formats on the host, for in-situ quantization
(`--isq`): our own numpy versions of llama.cpp's reference quantizers, the legacy formats in
`legacy` and the k-quants in `k_quants`, which give the same bytes from the same float32 input.

`quantize` cuts a weight into chunks of blocks and quantizes them on a thread each core: numpy
releases the GIL in its loops.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from candelabra.core.contract.weights import QuantizedTensor
from candelabra.core.weights.quantize import k_quants, legacy

# Each takes float32 blocks [count, values per block] and returns their bytes [count, bytes per block].
BLOCK_QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": legacy.q4_0, "Q4_1": legacy.q4_1, "Q5_0": legacy.q5_0, "Q5_1": legacy.q5_1, "Q8_0": legacy.q8_0,
    "Q2_K": k_quants.q2_k, "Q3_K": k_quants.q3_k, "Q4_K": k_quants.q4_k, "Q5_K": k_quants.q5_k,
    "Q6_K": k_quants.q6_k,
}  # fmt: skip

# Values quantized together by one call: large enough that numpy's cost per call is small beside the
# work, small enough that the temporaries stay near a core's cache. Q4_K on one core of an AMD EPYC
# (2026-11): 3.3 M values per CPU second in chunks of 2**15, 5.6 in 2**18, 4.4 in 2**20.
CHUNK_VALUES = 1 << 18


def values_per_block(format: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[format]][0]


def quantize(weight: np.ndarray, format: str, threads: int | None = None) -> QuantizedTensor:
    """The 2-D `weight` [rows, columns] in `format` (a GGML type name, "Q4_K"), its rows of blocks
    as a GGUF file stores them; `columns` must be whole blocks. On `threads` threads (default: one
    a core)."""
    if format not in BLOCK_QUANTIZERS:
        raise ValueError(f"cannot quantize to {format}; the formats are {', '.join(BLOCK_QUANTIZERS)}")
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[format]]
    if weight.ndim != 2 or weight.shape[1] % values:
        raise ValueError(f"{format} quantizes 2-D weights whose rows are whole blocks of {values} values, "
                         f"not shape {list(weight.shape)}")
    rows, columns = weight.shape
    blocks = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, values)
    quantized = np.empty((len(blocks), size), np.uint8)
    chunk = max(1, CHUNK_VALUES // values)
    quantizer = BLOCK_QUANTIZERS[format]

    def quantize_chunk(start: int) -> None:
        quantized[start : start + chunk] = quantizer(blocks[start : start + chunk])

    starts = range(0, len(blocks), chunk)
    workers = min(len(starts), threads or os.cpu_count() or 1)
    if workers <= 1:
        for start in starts:
            quantize_chunk(start)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(quantize_chunk, starts))
    return QuantizedTensor(format, quantized.reshape(rows, -1), (rows, columns))
