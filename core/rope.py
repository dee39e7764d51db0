"""Rotary embedding tables: the cos/sin rows that `Ops.rotary` reads, with every scaling folded in.

Scaling only changes the per-pair frequencies f_i and, for yarn, multiplies cos and sin by an
attention factor, so backends never see it: they rotate with whatever table they are handed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """A Hugging Face `rope_scaling` entry. kind: "default", "linear", "llama3" or "yarn".

    original_max_position is the pre-training context (llama3's
    original_max_position_embeddings, yarn's likewise).
    """

    kind: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    @classmethod
    def from_hf(cls, entry: dict | None, max_position: int) -> RopeScaling:
        """Read a config.json `rope_scaling` dict (None means default)."""
        if not entry:
            return cls()
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"unsupported rope scaling {kind!r}")
        return cls(
            kind=kind,
            factor=float(entry.get("factor", 1.0)),
            original_max_position=entry.get("original_max_position_embeddings", max_position),
            low_freq_factor=float(entry.get("low_freq_factor", 1.0)),
            high_freq_factor=float(entry.get("high_freq_factor", 4.0)),
            beta_fast=float(entry.get("beta_fast", 32.0)),
            beta_slow=float(entry.get("beta_slow", 1.0)),
            attention_factor=entry.get("attention_factor"),
        )


def rope_frequencies(rotary_dim: int, base: float, scaling: RopeScaling = RopeScaling()) -> np.ndarray:
    """The rotary_dim / 2 angular frequencies f_i (float64) for one head."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    freqs = 1.0 / base**exponents
    if scaling.kind == "default":
        return freqs
    if scaling.kind == "linear":
        return freqs / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_frequencies(freqs, scaling)
    if scaling.kind == "yarn":
        return _yarn_frequencies(freqs, rotary_dim, base, scaling)
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


def yarn_attention_factor(s: RopeScaling) -> float:
    """The factor yarn multiplies cos and sin by (1 for every other scaling)."""
    if s.kind != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    return 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0


def cos_sin_table(
    rotary_dim: int, max_positions: int, base: float, scaling: RopeScaling = RopeScaling()
) -> np.ndarray:
    """[max_positions, rotary_dim] float32: cos(p * f_i) then sin(p * f_i), times yarn's factor."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), rope_frequencies(rotary_dim, base, scaling))
    factor = yarn_attention_factor(scaling)
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * factor).astype(np.float32)
