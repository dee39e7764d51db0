"""Tiny GPTQ and AWQ checkpoints, packed by hand in each layout, for the models level and the loader's
tests. No 4-bit model is on PyPI here, so a tiny transformers model's linear weights are replaced by
random 4-bit codes, zero points and float16 scales, packed as AutoGPTQ (v1 and v2 zero points,
act-order with a shuffled g_idx, one group a row) or AutoAWQ (GEMM, its nibble order) write them.
The model keeps the dequantized weights, w = (q - z) * s, as the reference.

The packing here is written from the formats' definitions, apart from the loader's unpacking, so a
mistake in either shows up as a mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

# AWQ's GEMM layout: nibble p of a packed word holds output feature AWQ_ORDER[p] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linears that read the same input share an act-order permutation, as in a real checkpoint (the
# permutation follows the input's Hessian).
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
# A MoE layer's experts as transformers 5 fuses them: [E, 2I, H] gate rows first, and [E, H, I].
FUSED_EXPERTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Int4Layout:
    """How a checkpoint packs its 4-bit linears."""

    method: Literal["gptq", "awq"]
    group_size: int  # -1: one group a row
    sym: bool = False  # every zero point 8
    desc_act: bool = False  # GPTQ act-order: a shuffled g_idx
    v1: bool = False  # GPTQ v1: zero points stored minus one
    config_file: bool = False  # the settings in quantize_config.json rather than config.json

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm"}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": "gptq" if self.v1 else "gptq_v2"}


@dataclass
class Int4Weight:
    """One linear's random quantization, input features first: codes [K, N], zeros and scales
    [groups, N], `g_idx` [K] the group of each input feature."""

    codes: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray

    def dequantized(self) -> np.ndarray:
        """float32 [N, K]."""
        values = (self.codes - self.zeros[self.g_idx].astype(np.float32)) * self.scales[self.g_idx].astype(np.float32)
        return np.ascontiguousarray(values.T, dtype=np.float32)


def random_int4_weight(rng: np.random.Generator, layout: Int4Layout, rows: int, columns: int,
                       g_idx: np.ndarray | None = None) -> Int4Weight:
    """Random codes, zeros and scales for a weight of `rows` outputs and `columns` inputs; `g_idx`
    the groups of the inputs (default: in order)."""
    group = columns if layout.group_size == -1 else layout.group_size
    if columns % group:
        raise ValueError(f"groups of {group} do not divide a weight's {columns} input features")
    groups = columns // group
    if g_idx is None:
        g_idx = random_g_idx(rng, layout, columns)
    codes = rng.integers(0, 16, (columns, rows))
    if layout.sym:
        zeros = np.full((groups, rows), 8)
    else:  # a v1 checkpoint stores z - 1 in four bits, so its zero points are 1 to 15 in practice
        zeros = rng.integers(1 if layout.v1 else 0, 16, (groups, rows))
    scales = rng.uniform(0.02, 0.04, (groups, rows)).astype(np.float16)
    return Int4Weight(codes, zeros, scales, g_idx)


def random_g_idx(rng: np.random.Generator, layout: Int4Layout, columns: int) -> np.ndarray:
    """Each input feature's group: in order, or under act-order the order of a random permutation."""
    group = columns if layout.group_size == -1 else layout.group_size
    if not layout.desc_act:
        return np.arange(columns) // group
    position = np.argsort(rng.permutation(columns))  # where each feature comes in the quantizer's order
    return position // group


def packed_tensors(layout: Int4Layout, weight: Int4Weight, prefix: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors for one linear `prefix`, packed as `layout` says."""
    stored_zeros = weight.zeros - 1 if layout.v1 else weight.zeros
    if layout.method == "awq":
        return {f"{prefix}.qweight": pack_columns(weight.codes, AWQ_ORDER),
                f"{prefix}.qzeros": pack_columns(stored_zeros, AWQ_ORDER),
                f"{prefix}.scales": weight.scales}
    return {f"{prefix}.qweight": pack_rows(weight.codes), f"{prefix}.qzeros": pack_columns(stored_zeros),
            f"{prefix}.scales": weight.scales, f"{prefix}.g_idx": weight.g_idx.astype(np.int32)}


def pack_rows(values: np.ndarray) -> np.ndarray:
    """[R, C] 4-bit values as int32 [R / 8, C]: row 8r + j in bits 4j of word r."""
    words = np.zeros((values.shape[0] // 8, values.shape[1]), dtype=np.uint32)
    for j in range(8):
        words |= values[j::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def pack_columns(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """[R, C] 4-bit values as int32 [R, C / 8]: column 8c + order[p] in bits 4p of word c."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for position, column in enumerate(order):
        words |= (values[:, column::8].astype(np.uint32) & 0xF) << np.uint32(4 * position)
    return words.view(np.int32)


def quantize_linears(tensors: dict[str, np.ndarray], layout: Int4Layout, seed: int,
                     expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(`tensors` with each linear layer's weight (not the LM head's) replaced by random 4-bit codes
    packed as `layout` says, the same tensors holding those weights dequantized instead). Experts
    fused in 3-D as transformers 5 keeps them (`experts.gate_up_proj`, `experts.down_proj`) are packed
    one expert at a time, as the Hub's checkpoints store them, under `expert_names` (gate, up, down):
    each expert's gate and up share one g_idx and its down has another, so under act-order every
    expert's column order differs."""
    rng = np.random.default_rng(seed)
    packed, dense = dict(tensors), dict(tensors)
    shared: dict[tuple[str, str], np.ndarray] = {}

    def quantized(prefix: str, value: np.ndarray, reads: str) -> np.ndarray:
        """`value` [N, K] replaced by the linear `prefix`, whose g_idx it shares with the linears that read `reads`."""
        rows, columns = value.shape
        g_idx = shared.setdefault((prefix.rsplit(".", 1)[0], reads), random_g_idx(rng, layout, columns))
        weight = random_int4_weight(rng, layout, rows, columns, g_idx)
        packed.update(packed_tensors(layout, weight, prefix))
        return weight.dequantized()

    gate, up, down = expert_names
    for name, value in tensors.items():
        module, _, kind = name.removesuffix(".weight").rpartition(".")
        if name.endswith(".weight") and kind in LINEARS:
            dense[name] = quantized(name.removesuffix(".weight"), value, SHARED_INPUT.get(kind, kind))
        elif module.endswith(".experts") and kind in FUSED_EXPERTS and value.ndim == 3:
            parts = (gate, up) if kind == "gate_up_proj" else (down,)
            dense[name] = np.stack([np.concatenate([quantized(f"{module}.{e}.{part}", rows, kind)
                                                    for part, rows in zip(parts, np.split(expert, len(parts)))])
                                    for e, expert in enumerate(value)])
        else:
            continue
        del packed[name]
    return packed, dense


def write_int4_checkpoint(model, layout: Int4Layout, folder: str | Path, seed: int) -> Path:
    """Quantize `model`'s linear layers (not its LM head) to random 4-bit weights packed as `layout`
    says, write the checkpoint to `folder`, and leave the dequantized weights in `model`."""
    import torch

    from candelabra.plugins import installed_plugins

    tensors = {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}
    names = installed_plugins().model_architectures.get(type(model).__name__).expert_names
    packed, dense = quantize_linears(tensors, layout, seed, (names.gate, names.up, names.down))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.from_numpy(dense[name]))
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    return _write(Path(folder), packed, config, layout)


def write_int4_copy(folder: str | Path, target: str | Path, layout: Int4Layout, seed: int) -> Path:
    """The safetensors checkpoint in `folder` (one model.safetensors) written to `target` with its linear
    layers quantized as `write_int4_checkpoint` does, its other files copied; `folder`'s own linears
    then hold the dequantized weights, so that the two are one model."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, target = Path(folder), Path(target)
    shutil.copytree(folder, target)
    packed, dense = quantize_linears(load_file(str(folder / "model.safetensors")), layout, seed)
    save_file(dense, str(folder / "model.safetensors"))
    return _write(target, packed, json.loads((folder / "config.json").read_text()), layout)


def _write(folder: Path, tensors: dict[str, np.ndarray], config: dict, layout: Int4Layout) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    if layout.config_file:
        (folder / "quantize_config.json").write_text(json.dumps(
            {key: value for key, value in layout.quantization_config().items() if key != "quant_method"}))
    else:
        config = {**config, "quantization_config": layout.quantization_config()}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
