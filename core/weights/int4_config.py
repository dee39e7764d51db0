"""Which 4-bit scheme a safetensors checkpoint's linear weights are in, from its quantization config:
config.json's `quantization_config` (as transformers writes it for GPTQ and AWQ models), or else
AutoGPTQ's quantize_config.json or AutoAWQ's quant_config.json beside it.

Only what candelabra can read is accepted: GPTQ and AWQ, 4 bits, AWQ in its GEMM layout. Anything
else is a CheckpointError naming what the checkpoint says and what is supported, never a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from candelabra.core.weights import CheckpointError

QUANTIZE_CONFIG_FILES = ("quantize_config.json", "quant_config.json")
SUPPORTED = "GPTQ (checkpoint_format gptq or gptq_v2) and AWQ (version gemm), 4 bits"

Int4Method = Literal["gptq", "awq"]


@dataclass(frozen=True)
class Int4Scheme:
    """How a GPTQ or AWQ checkpoint stores its 4-bit linear weights."""

    method: Int4Method
    group_size: int  # input features sharing a scale and zero; -1: all of a row's
    desc_act: bool  # GPTQ act-order: g_idx is a permutation of the groups, not i // group_size
    sym: bool  # symmetric: every zero point is 8
    zeros_minus_one: bool  # GPTQ v1 stores each zero point minus one (v2 and AWQ store it as is)

    def describe(self) -> str:
        group = "per row" if self.group_size == -1 else f"groups of {self.group_size}"
        kind = ("GPTQ v1" if self.zeros_minus_one else "GPTQ v2") if self.method == "gptq" else "AWQ GEMM"
        extras = [word for word, on in (("symmetric", self.sym), ("act-order", self.desc_act)) if on]
        return ", ".join([f"{kind} 4-bit", group, *extras])


def read_int4_scheme(config: dict, folder: Path) -> Int4Scheme | None:
    """The checkpoint's 4-bit scheme, None for a checkpoint without a quantization config."""
    where, settings = _quantization_settings(config, folder)
    if settings is None:
        return None
    method = str(settings.get("quant_method", "gptq" if where.name == "quantize_config.json" else "awq")).lower()
    if method not in ("gptq", "awq"):
        raise CheckpointError(where, f"says quant_method {method!r}; candelabra reads {SUPPORTED}")
    bits = settings.get("bits", settings.get("w_bit"))
    if bits != 4:
        raise CheckpointError(where, f"says {method} with {bits} bits; candelabra reads {SUPPORTED}")
    group_size = settings.get("group_size", settings.get("q_group_size", -1))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise CheckpointError(where, f"says group_size {group_size!r}; it is a positive number of input features, "
                                     "or -1 for one group a row")
    if method == "awq":
        return _awq_scheme(where, settings, group_size)
    checkpoint_format = str(settings.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2") or settings.get("is_marlin_format"):
        shown = "marlin" if settings.get("is_marlin_format") else checkpoint_format
        raise CheckpointError(where, f"says GPTQ checkpoint_format {shown!r}; candelabra reads {SUPPORTED}")
    return Int4Scheme("gptq", group_size, bool(settings.get("desc_act", False)), bool(settings.get("sym", True)),
                      zeros_minus_one=checkpoint_format == "gptq")


def _awq_scheme(where: Path, settings: dict, group_size: int) -> Int4Scheme:
    version = str(settings.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(where, f"says AWQ version {version!r}; candelabra reads {SUPPORTED}")
    if settings.get("zero_point", True) is not True:
        raise CheckpointError(where, f"says AWQ zero_point {settings['zero_point']!r}; candelabra reads AWQ with "
                                     "zero points (zero_point true), as AutoAWQ's GEMM layout stores them")
    return Int4Scheme("awq", group_size, desc_act=False, sym=False, zeros_minus_one=False)


def _quantization_settings(config: dict, folder: Path) -> tuple[Path, dict | None]:
    """(the file the settings come from, the settings), or (folder, None) where there are none."""
    settings = config.get("quantization_config")
    if settings is not None:
        where = folder / "config.json"
        if not isinstance(settings, dict):
            raise CheckpointError(where, f"quantization_config is a JSON {type(settings).__name__}, expected an "
                                         "object")
        return where, settings
    for name in QUANTIZE_CONFIG_FILES:
        path = folder / name
        if path.is_file():
            try:
                settings = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
                raise CheckpointError(path, f"cannot be read as JSON ({' '.join(str(error).split())})") from None
            if not isinstance(settings, dict):
                raise CheckpointError(path, f"holds a JSON {type(settings).__name__}, expected an object")
            return path, settings
    return folder, None
