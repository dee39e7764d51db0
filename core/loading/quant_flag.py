"""`--quant` and `--isq`, as candle-vllm spells them: which quantization the checkpoint is served in.

`--quant gptq` and `awq` name a GPTQ or AWQ safetensors checkpoint, `marlin` either of them
(candle-vllm's Marlin kernel; here the same path: through the fastest int4 kernel the backend has),
`gguf` a .gguf file. Without the flag the checkpoint's own quantization is used; with it, a checkpoint
quantized otherwise (or not at all) is an error naming both. `--quant q4k` (any format `--isq` takes)
means `--isq q4k`: quantize a dense checkpoint's linear weights at load (in_situ.py).
"""

from __future__ import annotations

from candelabra.core.loading.in_situ import isq_format
from candelabra.core.weights import Checkpoint

# --quant's value -> the checkpoint quantizations (Checkpoint.quant_method) it accepts.
CHECKPOINT_QUANTIZATIONS: dict[str, tuple[str, ...]] = {
    "gptq": ("gptq",), "awq": ("awq",), "marlin": ("gptq", "awq"), "gguf": ("gguf",),
}


def parse_quant(quant: str | None, isq: str | None = None) -> tuple[str | None, str | None]:
    """(the checkpoint quantization `--quant` asks for, the GGML format in-situ quantization makes) from
    `--quant` and `--isq`, each None where not asked for. ValueError naming the flag for an unknown
    value, or for the two flags naming different in-situ formats."""
    isq_name, isq = isq, (isq_format(isq) if isq else None)
    if quant is None or quant.lower() in CHECKPOINT_QUANTIZATIONS:
        return (quant.lower() if quant else None), isq
    try:
        from_quant = isq_format(quant, "--quant")
    except ValueError:
        raise ValueError(f"--quant {quant} is not known; choose one of {', '.join(CHECKPOINT_QUANTIZATIONS)}, "
                         f"or a format for in-situ quantization as --isq takes (q4k, q8_0, ...)") from None
    if isq is not None and from_quant != isq:
        raise ValueError(f"--quant {quant} and --isq {isq_name} name different formats; pass one")
    return None, from_quant


def check_quant(value: str | None, checkpoint: Checkpoint) -> None:
    """ValueError naming the flag and the checkpoint when `checkpoint` is not quantized as `--quant
    value` says; nothing without a flag."""
    quant, _ = parse_quant(value)
    if quant is None:
        return
    stored = checkpoint.quant_method
    if stored not in CHECKPOINT_QUANTIZATIONS[quant]:
        held = f"{stored.upper()}-quantized" if stored else "not quantized"
        wanted = " or ".join(method.upper() for method in CHECKPOINT_QUANTIZATIONS[quant])
        raise ValueError(f"--quant {quant} serves {wanted} checkpoints, but {checkpoint.path} is {held}; "
                         "leave --quant out to serve the checkpoint as it is")
