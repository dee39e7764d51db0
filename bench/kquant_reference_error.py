"""llama.cpp's reference quantizers against ours: the error of each GGML format on the inputs of
`conformance.quantizer_inputs`, and whether the blocks are the same bytes.

    python bench/kquant_reference_error.py LIBGGML_BASE

LIBGGML_BASE is llama.cpp's built libggml-base.so (it exports quantize_row_q4_K_ref and the others),
e.g. vendor/llama.cpp/build/bin/libggml-base.so in a llama-cpp-python source tree. Prints a table
(relative RMS error, llama.cpp's and ours, the share of blocks that differ, the seconds ours took)
and the constants tests/test_weight_quantizers.py holds our quantizers to.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import time

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from candelabra.conformance.quantizer_inputs import random_normal_weights, real_weights, relative_rms_error
from candelabra.core.text_table import format_table
from candelabra.core.weights.quantize import BLOCK_QUANTIZERS, quantize


def reference_blocks(library: ctypes.CDLL, weights: np.ndarray, format: str) -> np.ndarray:
    """llama.cpp's quantize_row_<format>_ref on all of `weights` as one stream of blocks."""
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[format]]
    weights = np.ascontiguousarray(weights, np.float32)
    blocks = np.zeros((weights.size // values, size), np.uint8)
    name = format[:-1].lower() + "K" if format.endswith("_K") else format.lower()
    function = getattr(library, f"quantize_row_{name}_ref")
    function(weights.ctypes.data_as(ctypes.c_void_p), blocks.ctypes.data_as(ctypes.c_void_p),
             ctypes.c_int64(weights.size))
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", help="llama.cpp's libggml-base.so")
    args = parser.parse_args()
    library = ctypes.CDLL(args.library)
    inputs = {"random": random_normal_weights(), "real": real_weights()}
    rows, errors, digests = [], {}, {}
    for format in BLOCK_QUANTIZERS:
        for input_name, weights in inputs.items():
            reference = reference_blocks(library, weights, format)
            start = time.perf_counter()
            ours = quantize(weights, format).blocks.reshape(reference.shape)
            seconds = time.perf_counter() - start
            kind = GGMLQuantizationType[format]
            reference_error = relative_rms_error(weights, dequantize(reference, kind))
            our_error = relative_rms_error(weights, dequantize(ours, kind))
            differing = float(np.mean(np.any(ours != reference, axis=1)))
            rows.append((format, input_name, f"{reference_error:.6f}", f"{our_error:.6f}", f"{differing:.2%}",
                         f"{seconds:.3f}"))
            errors[(format, input_name)] = reference_error
            digests[(format, input_name)] = hashlib.sha256(reference.tobytes()).hexdigest()[:16]
    print(format_table(("format", "input", "llama.cpp error", "our error", "blocks differing", "our s"), rows))
    print("\nLLAMA_CPP_ERROR = {")
    for (format, input_name), error in errors.items():
        print(f'    ("{format}", "{input_name}"): {error:.6f},')
    print("}\nLLAMA_CPP_SHA256 = {")
    for (format, input_name), digest in digests.items():
        print(f'    ("{format}", "{input_name}"): "{digest}",')
    print("}")


if __name__ == "__main__":
    main()
