"""A GPTQ or AWQ checkpoint's quantized linears as Hugging Face weights: the tensors `P.qweight`,
`P.qzeros`, `P.scales` (and GPTQ's `P.g_idx`) of each linear P are presented as the one weight
`P.weight` [out_features, in_features], in a grouped int4 format where it is exactly one (see
`gptq_awq`), dequantized otherwise. Every other tensor (embeddings, norms, biases, an unquantized LM
head) is the checkpoint's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from candelabra.core.contract.weights import QuantizedTensor
from candelabra.core.weights.gptq_awq import Int4Groups, plan_int4, to_weight, unpack_codes, unpack_groups
from candelabra.core.weights.int4_config import Int4Scheme

PARTS = ("qweight", "qzeros", "scales", "g_idx")


class Int4Linears:
    """The quantized linears among `names`; `shape_of` and `load_stored` read a stored tensor's
    shape and its values in the stored dtype (float32 for float types)."""

    def __init__(self, scheme: Int4Scheme, names: Iterable[str], shape_of: Callable[[str], tuple[int, ...]],
                 load_stored: Callable[[str], np.ndarray]) -> None:
        self.scheme = scheme
        names = set(names)
        self._shape_of, self._load_stored = shape_of, load_stored
        self._prefixes = {f"{name.removesuffix('.qweight')}.weight": name.removesuffix(".qweight")
                          for name in names if name.endswith(".qweight")}
        self.parts = {f"{prefix}.{part}" for prefix in self._prefixes.values() for part in PARTS} & names
        for weight, prefix in self._prefixes.items():
            missing = [f"{prefix}.{part}" for part in PARTS[1:3] if f"{prefix}.{part}" not in names]
            if missing:
                raise ValueError(f"{weight}: {scheme.method.upper()} stores it as qweight, qzeros and scales, but the "
                                 f"checkpoint has no {' or '.join(missing)}")

    def weight_names(self) -> list[str]:
        return list(self._prefixes)

    def __contains__(self, name: str) -> bool:
        return name in self._prefixes

    def shape(self, name: str) -> tuple[int, int]:
        """[out_features, in_features] of weight `name`, from qweight's shape alone."""
        packed_rows, packed_columns = self._shape_of(f"{self._prefixes[name]}.qweight")
        if self.scheme.method == "awq":
            return packed_columns * 8, packed_rows
        return packed_columns, packed_rows * 8

    def format(self, name: str) -> str | None:
        """The grouped int4 format `load(name)` returns it in, None where it is dequantized."""
        return plan_int4(self.scheme, self._groups(name)).format

    def load(self, name: str) -> QuantizedTensor | np.ndarray:
        """Weight `name` as a QuantizedTensor, or float32 where no grouped int4 format holds it exactly."""
        groups = self._groups(name)
        codes = unpack_codes(self.scheme, self._load_stored(f"{self._prefixes[name]}.qweight"))
        if codes.shape != (len(groups.group_of), groups.scales.shape[1]):
            raise ValueError(f"{name}: qweight holds {list(codes.shape[::-1])} codes, but its scales and zero points "
                             f"are those of a {[groups.scales.shape[1], len(groups.group_of)]} weight")
        return to_weight(codes, groups, plan_int4(self.scheme, groups), name)

    def _groups(self, name: str) -> Int4Groups:
        prefix = self._prefixes[name]
        g_idx = f"{prefix}.g_idx"
        stored_g_idx = self._load_stored(g_idx) if g_idx in self.parts and self.scheme.method == "gptq" else None
        return unpack_groups(self.scheme, self._load_stored(f"{prefix}.qzeros"), self._load_stored(f"{prefix}.scales"),
                             stored_g_idx, self.shape(name)[1], name)
