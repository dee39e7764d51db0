"""Each quantized weight kept in the form, and multiplied by the kernels, that the kernel table names for its
format, dtype and CPU (kernel_table.py), every kernel checked against float64 before it serves.

Nothing is timed here: what runs is a property of the code, the CPU's ISA level and the machine's tuned
table, never of a start. The check is what measuring used to give for free. Per weight format and shape,
each kernel the chosen form names is run once on random x and its outputs compared with the float64
product of the form's own values. A kernel off by more than its budget is logged and its form passed over
for the next one in the row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from candelabra.backends.torch.kernel_table import (
    EXACT,
    INT8,
    INT8_ACTIVATIONS_VARIABLE,
    ROW_BANDS,
    Choice,
    KernelRow,
    int8_activations_from_environment,
    isa_level,
    rows_for,
    tuned_rows,
)

log = logging.getLogger("candelabra")

# Largest NMSE of a kernel's output against the float64 product of its form's values, per compute dtype:
# the conformance suite's general limits, far above a correct kernel's rounding (about 1e-14 in float32,
# 1e-6 in bfloat16) and far below a wrong one's.
KERNEL_NMSE_BUDGET = {"float32": 1e-9, "float16": 1e-5, "bfloat16": 1e-4}
# A kernel that rounds x to 8 bits per block of 32 first, as llama.cpp multiplies, measures about 3e-5 on
# random inputs and 1.5e-4 with a few channels 100 times the rest, within what the conformance suite allows
# llama.cpp's own rounding. Its budget, in any dtype: three times the outlying channels' case, below the
# 8.5e-4 that wrongly decoded blocks measured at the least (conformance/compare.py). At real widths (K of 896
# and more) blocks_int8 measured at most 8.1e-5; the formats with an offset (Q4_1, Q5_1) at K = 64, two
# blocks, up to 1.7e-3 on the conformance suite's tiny models, whose weights of that width then keep an
# exact kernel.
ROUNDED_ACTIVATIONS_NMSE_BUDGET = 5e-4
# Output rows checked, half at each end of the weight: a wrong kernel is wrong on thousands of them, and a
# row group's remainder sits at the end.
CHECKED_OUTPUTS = 4096
# Rows of x a kernel is checked at where it serves more than one: past the 8-row groups the block kernels
# take x in, and one over.
CHECKED_ROWS = 17

Kernel = Callable[[object], object]


@dataclass
class Candidate:
    """A form a weight can be kept in: how to build it, and its kernels once built."""

    form: str
    build: Callable[[], object]  # returns the kept weight, a weight_forms.KeptWeight
    values: Callable[[], object] | None = None  # its values, where the kept weight cannot give them back
    unavailable: str | None = None  # why it cannot be built here, if so


def nmse(output: np.ndarray, reference: np.ndarray) -> float:
    scale = float(np.sum(np.square(reference)))
    error = float(np.sum(np.square(output - reference)))
    return error / scale if scale else (0.0 if error == 0 else math.inf)


def checked_rows(rows: int) -> np.ndarray:
    """The output rows of a weight of `rows` rows whose products are checked."""
    if rows <= CHECKED_OUTPUTS:
        return np.arange(rows)
    half = CHECKED_OUTPUTS // 2
    return np.concatenate([np.arange(half), np.arange(rows - half, rows)])


def checked_values(kept, candidate: Candidate, rows: np.ndarray):
    """The float64 values [len(rows), K] of `kept`'s output rows `rows`."""
    import torch

    if candidate.values is not None:
        return candidate.values()[torch.from_numpy(rows)].double().numpy()
    if len(rows) == kept.shape[0]:
        return kept.dense().double().numpy()
    half = len(rows) // 2
    return torch.cat([kept.dense(0, half), kept.dense(kept.shape[0] - half, kept.shape[0])]).double().numpy()


def kernel_error(kernel: Kernel, x, values: np.ndarray, rows: np.ndarray) -> float:
    """NMSE of `kernel(x)`'s columns `rows` against x times `values` in float64."""
    out = kernel(x)[:, rows].double().numpy()
    return nmse(out, x.double().numpy() @ values.T)


def random_x(rows: int, columns: int, dtype: str, seed: int = 0):
    import torch

    from candelabra.backends.torch.dtypes import torch_dtype

    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((rows, columns))).to(torch_dtype(dtype))


def budget_of(kept, kernel: str, dtype: str) -> float:
    return ROUNDED_ACTIVATIONS_NMSE_BUDGET if kernel in kept.rounds_activations else KERNEL_NMSE_BUDGET[dtype]


def check_choice(kept, candidate: Candidate, choice: Choice, dtype: str) -> str | None:
    """Why `choice` cannot serve `kept` (a kernel its form lacks, one that raises, or one whose products are
    off by more than its budget), or None where every kernel it names passed."""
    kernels = kept.kernels()
    missing = [name for name in choice.kernels if name not in kernels]
    if missing:
        return f"form {choice.form} has no kernel {', '.join(dict.fromkeys(missing))}"
    rows = checked_rows(kept.shape[0])
    values = checked_values(kept, candidate, rows)
    for name in dict.fromkeys(choice.kernels):
        served = [band for band, kernel in zip(ROW_BANDS, choice.kernels) if kernel == name]
        for count in sorted({1 if band == 1 else CHECKED_ROWS for band in served}):
            try:
                error = kernel_error(kernels[name], random_x(count, kept.shape[1], dtype), values, rows)
            except Exception as exc:  # noqa: BLE001 - a kernel that fails on this CPU passes to the next form
                return f"{choice.form}/{name} failed at {count} rows: {type(exc).__name__}: {exc}"
            budget = budget_of(kept, name, dtype)
            if not error <= budget:
                return f"{choice.form}/{name} is wrong at {count} rows: NMSE {error:.2g} > {budget:g}"
    return None


@dataclass(frozen=True)
class Selection:
    """What one weight format and shape took: the form and its kernels, and the row that named them."""

    choice: Choice
    row: KernelRow
    passed_over: tuple[str, ...]  # the forms before it in the rows, and why each did not serve


class KernelSelector:
    """The selections of one process for one compute dtype, per weight format and shape."""

    def __init__(self, dtype: str, threads: int, int8_activations: bool | None = None, level: str | None = None,
                 tuned: tuple[tuple[KernelRow, ...], str] | None = None) -> None:
        self.dtype = dtype
        self.int8_activations = int8_activations_from_environment() if int8_activations is None else int8_activations
        self.level = level or isa_level()
        self.tuned, self.tuned_source = tuned if tuned is not None else tuned_rows(threads)
        self.selected: dict[tuple[str, tuple[int, int], frozenset[str]], Selection] = {}
        self._logged = False

    @property
    def activations(self) -> str:
        return INT8 if self.int8_activations else EXACT

    def keep(self, format: str, shape: tuple[int, int], candidates: Sequence[Candidate]):
        """The weight in the first form its rows name that it can be kept in and whose kernels pass the check,
        with its kernel per band set. Weights of one format and shape share a selection where their forms
        are the same (int8 rows only where a weight's values allow them)."""
        available = {c.form: c for c in candidates if not c.unavailable}
        key = (format, tuple(shape), frozenset(available))
        known = self.selected.get(key)
        if known is not None:
            kept = available[known.choice.form].build()
            kept.choice = known.choice
            return kept
        passed_over = []
        for row in rows_for(format, self.dtype, self.activations, self.level, self.tuned):
            for choice in row.choices:
                if choice.form not in available:
                    continue
                kept = available[choice.form].build()
                problem = check_choice(kept, available[choice.form], choice, self.dtype)
                if problem is None:
                    kept.choice = choice
                    self.selected[key] = Selection(choice, row, tuple(passed_over))
                    return kept
                log.warning("%s %dx%d in %s: %s; the next form serves", format, *shape, self.dtype, problem)
                passed_over.append(f"{choice.form}: {problem}")
        raise RuntimeError(f"no kernel serves {format} {shape[0]}x{shape[1]} in {self.dtype} here; "
                           f"forms {sorted(available)}, passed over: {'; '.join(passed_over) or 'none named'}")

    def report(self) -> str:
        """What the weights took: per format and shape, the form, its kernel per band and the row's CPU."""
        from candelabra.core.text_table import format_table

        lines = []
        for (format, shape, _), selection in self.selected.items():
            lines.append((f"{format} {shape[0]}x{shape[1]}", selection.choice.form, " ".join(selection.choice.kernels),
                          selection.row.isa, selection.row.measured))
            lines += [("", "passed over", reason, "", "") for reason in selection.passed_over]
        rounded = f", x rounded to int8 where a kernel does ({INT8_ACTIVATIONS_VARIABLE}=1)" \
            if self.int8_activations else ""
        return (f"kernels for {self.dtype} at ISA level {self.level}{rounded}, from the table in code"
                f"{'' if not self.tuned else f' after the tuned one ({self.tuned_source})'}:\n"
                + format_table(("weight", "form", f"kernels at {ROW_BANDS} rows", "isa", "row measured on"), lines))

    def log_once(self) -> None:
        if self.selected and not self._logged:
            log.info("%s", self.report())
            self._logged = True


_SELECTORS: dict[tuple[str, int, bool], KernelSelector] = {}


def selector_for(dtype: str, threads: int) -> KernelSelector:
    """One selector per compute dtype, thread count and activation rounding in a process, so that each weight
    format and shape is checked once."""
    key = (dtype, threads, int8_activations_from_environment())
    if key not in _SELECTORS:
        _SELECTORS[key] = KernelSelector(dtype, threads, int8_activations=key[2])
    return _SELECTORS[key]


def log_selections() -> None:
    """Each selector's table, the first time its weights are all loaded."""
    for selector in _SELECTORS.values():
        selector.log_once()
