"""`--quant`, as candle-vllm spells it: which quantization the checkpoint is served in.

`gptq` and `awq` name a GPTQ or AWQ safetensors checkpoint, `marlin` either of them (candle-vllm's
Marlin kernel; here the same path: through the fastest int4 kernel the backend has), `gguf` a .gguf
file. Without the flag the checkpoint's own quantization is used; with it, a checkpoint quantized
otherwise (or not at all) is an error naming both.
"""

from __future__ import annotations

from candelabra.core.weights import Checkpoint

# --quant's value -> the checkpoint quantizations (Checkpoint.quant_method) it accepts.
CHECKPOINT_QUANTIZATIONS: dict[str, tuple[str, ...]] = {
    "gptq": ("gptq",), "awq": ("awq",), "marlin": ("gptq", "awq"), "gguf": ("gguf",),
}


def parse_quant(value: str | None) -> str | None:
    """`--quant`'s value in lower case, None without one; ValueError naming the accepted values."""
    if value is None:
        return None
    quant = value.lower()
    if quant not in CHECKPOINT_QUANTIZATIONS:
        raise ValueError(f"--quant {value} is not known; choose one of {', '.join(CHECKPOINT_QUANTIZATIONS)}")
    return quant


def check_quant(value: str | None, checkpoint: Checkpoint) -> None:
    """ValueError naming the flag and the checkpoint when `checkpoint` is not quantized as `--quant
    value` says; nothing without a flag."""
    quant = parse_quant(value)
    if quant is None:
        return
    stored = checkpoint.quant_method
    if stored not in CHECKPOINT_QUANTIZATIONS[quant]:
        held = f"{stored.upper()}-quantized" if stored else "not quantized"
        wanted = " or ".join(method.upper() for method in CHECKPOINT_QUANTIZATIONS[quant])
        raise ValueError(f"--quant {quant} serves {wanted} checkpoints, but {checkpoint.path} is {held}; "
                         "leave --quant out to serve the checkpoint as it is")
