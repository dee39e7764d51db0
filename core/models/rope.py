"""Rotary embedding tables: the cos/sin rows that `Ops.rotary` reads, with every scaling folded in.

Scaling only changes the per-pair frequencies f_i and, for yarn and longrope, multiplies cos and
sin by an attention factor, so backends never see it: they rotate with whatever table they are
handed.

Two scalings change with the sequence's length: longrope switches to its long factors once a
sequence outgrows the pre-training context, and dynamic NTK raises the base past the configured
context. For them a model uses two tables, stacked: rows [0, P) for sequences within the context
and rows [P, 2P) for longer ones (`RotaryTable.row_offset`). Dynamic NTK's long table uses the
base for the longest context the factor allows, where Hugging Face recomputes it for every length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A Hugging Face `rope_scaling` entry; `kind` is one of KINDS.

    original_max_position is the pre-training context (original_max_position_embeddings),
    max_position the model's configured context (max_position_embeddings).
    """

    kind: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None  # yarn as DeepSeek writes it: cos and sin scaled by
    mscale_all_dim: float | None = None  # mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, entry: dict | None, max_position: int) -> RopeScaling:
        """Read a config.json `rope_scaling` (or transformers 5 `rope_parameters`) dict; None or
        an entry without a type means no scaling."""
        if not entry:
            return cls(max_position=max_position)
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind == "su":  # Phi-3's early name for longrope
            kind = "longrope"
        if kind not in KINDS:
            raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(KINDS)}")
        original = entry.get("original_max_position_embeddings") or max_position
        factor = entry.get("factor")
        if factor is None:
            factor = max_position / original if kind in ("longrope", "yarn") else 1.0
        return cls(
            kind=kind,
            factor=float(factor),
            original_max_position=int(original),
            max_position=max_position,
            low_freq_factor=float(entry.get("low_freq_factor", 1.0)),
            high_freq_factor=float(entry.get("high_freq_factor", 4.0)),
            beta_fast=float(entry.get("beta_fast") or 32.0),
            beta_slow=float(entry.get("beta_slow") or 1.0),
            attention_factor=entry.get("attention_factor"),
            mscale=entry.get("mscale"),
            mscale_all_dim=entry.get("mscale_all_dim"),
            short_factor=tuple(entry["short_factor"]) if entry.get("short_factor") else None,
            long_factor=tuple(entry["long_factor"]) if entry.get("long_factor") else None,
        )

    @property
    def softmax_mscale(self) -> float:
        """What DeepSeek's attention multiplies its softmax scale by twice: yarn's mscale at
        mscale_all_dim (1 without it)."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim)

    @property
    def switches_with_length(self) -> bool:
        return self.kind in ("longrope", "dynamic")

    @property
    def switch_length(self) -> int:
        """Sequences longer than this use the long table."""
        return self.original_max_position if self.kind == "longrope" else self.max_position


def rope_frequencies(
    rotary_dim: int, base: float, scaling: RopeScaling = RopeScaling(), long: bool = False
) -> np.ndarray:
    """The rotary_dim / 2 angular frequencies f_i (float64) for one head; `long` picks the
    variant for sequences past `scaling.switch_length` (longrope and dynamic only)."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    if scaling.kind == "dynamic" and long:
        longest = scaling.factor * scaling.max_position
        stretch = scaling.factor * longest / scaling.max_position - (scaling.factor - 1)
        base = base * stretch ** (rotary_dim / (rotary_dim - 2))
    freqs = 1.0 / base**exponents
    if scaling.kind in ("default", "dynamic"):
        return freqs
    if scaling.kind == "linear":
        return freqs / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_frequencies(freqs, scaling)
    if scaling.kind == "yarn":
        return _yarn_frequencies(freqs, rotary_dim, base, scaling)
    if scaling.kind == "longrope":
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, dtype=np.float64)
        if factors.shape != freqs.shape:
            raise ValueError(f"longrope needs {freqs.size} factors per list, got {factors.size}")
        return freqs / factors
    raise ValueError(f"unsupported rope scaling {scaling.kind!r}")


def _llama3_frequencies(freqs: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended.
    wavelengths = 2 * math.pi / freqs
    context = float(s.original_max_position)
    low_freq_wavelength = context / s.low_freq_factor
    high_freq_wavelength = context / s.high_freq_factor
    blend = (context / wavelengths - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * freqs / s.factor + blend * freqs
    return np.where(
        wavelengths > low_freq_wavelength,
        freqs / s.factor,
        np.where(wavelengths < high_freq_wavelength, freqs, blended),
    )


def _yarn_frequencies(freqs: np.ndarray, rotary_dim: int, base: float, s: RopeScaling) -> np.ndarray:
    def dim_for_rotations(rotations: float) -> float:
        return rotary_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for_rotations(s.beta_fast)), 0)
    high = min(math.ceil(dim_for_rotations(s.beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep_original = 1 - ramp
    return freqs / s.factor * (1 - keep_original) + freqs * keep_original


def attention_factor(s: RopeScaling) -> float:
    """The factor yarn and longrope multiply cos and sin by (1 for every other scaling)."""
    if s.kind not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.factor <= 1:
        return 1.0
    if s.kind == "yarn":
        if s.mscale and s.mscale_all_dim:
            return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
        return _yarn_mscale(s.factor, 1.0)
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def cos_sin_table(
    rotary_dim: int, max_positions: int, base: float, scaling: RopeScaling = RopeScaling(), long: bool = False
) -> np.ndarray:
    """[max_positions, rotary_dim] float32: cos(p * f_i) then sin(p * f_i), times the scaling's
    attention factor."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), rope_frequencies(rotary_dim, base, scaling, long))
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * attention_factor(scaling)).astype(np.float32)


@dataclass(frozen=True, eq=False)
class RotaryTable:
    """A model's rotary table as `Ops.rotary` reads it, and how to index it for a sequence."""

    table: np.ndarray  # [P, R], or [2P, R] for scalings that switch with length
    max_positions: int
    switch_length: int | None = None

    @classmethod
    def build(cls, rotary_dim: int, max_positions: int, base: float, scaling: RopeScaling) -> RotaryTable:
        short = cos_sin_table(rotary_dim, max_positions, base, scaling)
        if not scaling.switches_with_length:
            return cls(short, max_positions)
        long = cos_sin_table(rotary_dim, max_positions, base, scaling, long=True)
        return cls(np.concatenate([short, long]), max_positions, scaling.switch_length)

    def row_offset(self, seq_lens: np.ndarray) -> np.ndarray:
        """Per sequence, what to add to its positions to reach its rows of the table."""
        if self.switch_length is None:
            return np.zeros_like(seq_lens)
        return np.where(seq_lens > self.switch_length, self.max_positions, 0)
