"""What the torch backend keeps of each GGUF quantized format on a CPU, how far it is from the weight
gguf decodes, and how fast it multiplies.

    python bench/quantized_weight_error.py [--repeats N] [--threads T] [--skip-timing]
    python bench/quantized_weight_error.py --model [PATH] [--tensors-per-format 3]

Without --model: random weights (conformance's `random_quantized`, every byte random) of the shapes
of Qwen2.5-0.5B's MLP, rows x columns 896 x 4864 and 4864 x 896; the K formats take only the first,
since their 256-value super-blocks do not divide 896 columns. With --model: a few layer tensors of
each quantized format in a GGUF file (default: the default model), error columns only.

Columns, all NMSE (sum of squared differences over the sum of squares of the reference) against
`QuantizedTensor.dequantize()` in float64:
  kept        what `keep_quantized(weight, bfloat16)` keeps: int4 groupwise-32, int8 per-row, or a
              dense bfloat16 copy (None)
  kept NMSE   the weight as kept (scales and zeros rounded to bfloat16, as the kernels read them)
  int8 NMSE   the weight as per-row int8 would keep it, for every format: the INT8_FORMATS decision
  bf16 NMSE   the weight rounded to bfloat16, for comparison
  B/weight    bytes of the kept form per weight
  out NMSE    a bfloat16 matmul with the kept form, x random bfloat16 [4, K], against x @ W.T in float64
  ms M=m      milliseconds per matmul of m rows, kept form / dense bfloat16 weight: the best of
              --repeats calls, each on a weight that is not in the cache (the fastest call is the one
              other processes disturbed least)
"""

from __future__ import annotations

import argparse
import copy
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from candelabra.backends.torch.quantized import int4_groupwise, int8_rowwise, keep_quantized
from candelabra.backends.torch.weight_forms import INT4_GROUP_SIZE, DenseWeight, Int4Weight, Int8Weight
from candelabra.conformance.quantized_weights import random_quantized
from candelabra.core.contract.weights import GGUF_QUANTIZED_FORMATS, QuantizedTensor
from candelabra.core.text_table import format_table

DTYPE = torch.bfloat16
SHAPES = ((896, 4864), (4864, 896))
ERROR_HEADERS = ("format", "weight", "kept", "kept NMSE", "int8 NMSE", "bf16 NMSE", "B/weight", "out NMSE")
POOL_BYTES = 256 << 20  # several times a CPU's last-level cache
TIMING_HEADERS = ("ms M=1 kept/bf16", "ms M=16 kept/bf16")


def nmse(values: np.ndarray, reference: np.ndarray) -> float:
    return float(np.sum(np.square(values - reference)) / np.sum(np.square(reference)))


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """`values` rounded to bfloat16, back as float64."""
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).to(DTYPE).double().numpy()


def kept_values(weight: QuantizedTensor, kept: Int4Weight | Int8Weight | None) -> np.ndarray:
    """The weight's values as `kept` holds them, float64: rebuilt from the host arrays with the scales
    (and zeros) rounded to the compute dtype, as the kernels see them."""
    if isinstance(kept, Int4Weight):
        nibbles, scales, zeros = int4_groupwise(weight)
        per_value = lambda groups: np.repeat(to_bfloat16(groups), INT4_GROUP_SIZE, axis=1)
        return (nibbles.astype(np.float64) - 8) * per_value(scales) + per_value(zeros)
    if isinstance(kept, Int8Weight):
        return int8_values(weight.dequantize())
    return to_bfloat16(weight.dequantize())


def int8_values(values: np.ndarray) -> np.ndarray:
    quantized, scales = int8_rowwise(values)
    return quantized.astype(np.float64) * to_bfloat16(scales)[:, None]


def kept_form(kept: Int4Weight | Int8Weight | None) -> str:
    return {Int4Weight: "int4 g32", Int8Weight: "int8 row"}.get(type(kept), "bf16")


Form = Int4Weight | Int8Weight | DenseWeight


def error_row(label: str, weight: QuantizedTensor, rng: np.random.Generator) -> tuple[list[str], Form, DenseWeight]:
    """The error columns of one weight, and the forms to time: as kept, and as a dense bfloat16 copy."""
    kept = keep_quantized(weight, DTYPE)
    reference = weight.dequantize().astype(np.float64)
    dense = DenseWeight(torch.from_numpy(weight.dequantize()).to(DTYPE))
    form = kept if kept is not None else dense
    x = torch.from_numpy(rng.standard_normal((4, weight.shape[1]))).to(DTYPE)
    with torch.inference_mode():
        out = form.matmul(x).double().numpy()
    oracle = x.double().numpy() @ reference.T
    row = [weight.format, label, kept_form(kept), f"{nmse(kept_values(weight, kept), reference):.1e}",
           f"{nmse(int8_values(reference), reference):.1e}", f"{nmse(to_bfloat16(reference), reference):.1e}",
           f"{form.nbytes / reference.size:.3f}", f"{nmse(out, oracle):.1e}"]
    return row, form, dense


def best_ms(form: Form, x: torch.Tensor, repeats: int) -> float:
    """Each call multiplies by the next of enough copies of `form` to fill POOL_BYTES, so that its weight
    comes from memory, as in a model's forward pass, not from a cache still warm from the last call."""
    copies = [copy.deepcopy(form) for _ in range(-(-POOL_BYTES // form.nbytes))]
    samples = []
    with torch.inference_mode():
        copies[-1].matmul(x)
        for call in range(repeats):
            start = time.perf_counter()
            copies[call % len(copies)].matmul(x)
            samples.append(time.perf_counter() - start)
    return min(samples) * 1e3


def timing_cells(kept: Form, dense: DenseWeight, columns: int, repeats: int) -> list[str]:
    cells = []
    for rows in (1, 16):
        x = torch.randn(rows, columns, dtype=DTYPE)
        cells.append(f"{best_ms(kept, x, repeats):.2f} / {best_ms(dense, x, repeats):.2f}")
    return cells


def random_weights(rng: np.random.Generator) -> Iterator[tuple[str, QuantizedTensor]]:
    for format in GGUF_QUANTIZED_FORMATS:
        for rows, columns in SHAPES:
            weight = _random_or_none(rng, format, rows, columns)
            if weight is not None:
                yield f"{rows}x{columns}", weight


def _random_or_none(rng: np.random.Generator, format: str, rows: int, columns: int) -> QuantizedTensor | None:
    try:
        return random_quantized(rng, format, rows, columns)
    except ValueError:  # columns are not whole blocks of this format
        return None


def model_weights(path: Path, per_format: int) -> Iterator[tuple[str, QuantizedTensor]]:
    """The first `per_format` layer tensors of each quantized format in the file, by layer number."""
    from gguf import GGUFReader

    taken: dict[str, int] = {}
    for tensor in sorted(GGUFReader(path).tensors, key=lambda t: _layer_order(t.name)):
        format = tensor.tensor_type.name
        if format not in GGUF_QUANTIZED_FORMATS or not tensor.name.startswith("blk."):
            continue
        if taken.get(format, 0) < per_format:
            taken[format] = taken.get(format, 0) + 1
            columns, rows = (int(size) for size in tensor.shape)
            yield tensor.name, QuantizedTensor(format, np.asarray(tensor.data), (rows, columns))


def _layer_order(name: str) -> tuple[int, str]:
    match = re.match(r"blk\.(\d+)\.", name)
    return (int(match.group(1)) if match else -1, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="?", const="default", help="a GGUF file (no value: the default model)")
    parser.add_argument("--tensors-per-format", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = args.model is None and not args.skip_timing

    if args.model is None:
        weights = random_weights(rng)
        print(f"random GGUF weights (seed {args.seed}), every byte random; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, compute dtype bfloat16")
    else:
        path = Path(args.model) if args.model != "default" else _default_model_path()
        weights = model_weights(path, args.tensors_per_format)
        print(f"{path.name}: the first {args.tensors_per_format} layer tensors of each quantized format")

    rows = []
    for label, weight in weights:
        row, kept, dense = error_row(label, weight, rng)
        rows.append(row + (timing_cells(kept, dense, weight.shape[1], args.repeats) if timing else []))
    print(format_table(ERROR_HEADERS + (TIMING_HEADERS if timing else ()), rows))


def _default_model_path() -> Path:
    from candelabra.core.weights.default_model import default_model_path

    return default_model_path()


if __name__ == "__main__":
    main()
