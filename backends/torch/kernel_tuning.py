"""`candelabra tune --backend torch`: every form and kernel of each weight format timed on this machine, and
the ranking written as a table that serve reads before the one in code (kernel_table.py).

The same instruction set runs one library's kernel a thousand times slower than another's: one row
through a 4864 x 896 int8 weight took 189 ms in oneDNN's packed kernel and 0.14 ms in torch's int8
weight-only kernel on AMD Zen 4, while on an Intel CPU with AMX the packed kernel was the faster.
So for every format, each form a weight can be kept in and each kernel that multiplies that form is
timed at every band of rows a step multiplies (`ROW_BANDS`), on random weights of a few shapes
(`TUNE_SHAPES`), and its output is checked against a float64 product of the form's own values. A
form's time is the sum over the shapes; forms are ranked by how close their fastest kernels come to
the fastest of any form, over all bands, with the larger forms held back (`rank_forms`).

This is a tool to run on a quiet machine, never part of a start: under one busy core a 0.45 ms int4
product timed 8 to 16 ms (a scheduler slice) and a one-thread kernel won. Each format's measurement
watches the rest of the machine (`cpu_load`), and the report says where others kept its CPUs busy.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from candelabra.backends.torch import cpu_load
from candelabra.backends.torch.kernel_selection import (
    Candidate,
    Kernel,
    budget_of,
    checked_rows,
    checked_values,
    nmse,
    random_x,
)
from candelabra.backends.torch.kernel_table import (
    EXACT,
    INT8,
    ROW_BANDS,
    Choice,
    KernelRow,
    isa_level,
    machine_key,
    tuned_file,
    write_tuned,
)

log = logging.getLogger("candelabra")

# Weight shapes [N, K] each format is timed at: a small model's MLP in and out, and a slice of an LM head as
# wide as oneDNN packs at once. K is whole super-blocks of 256 and whole groups of every int4 format.
TUNE_SHAPES = ((4864, 1024), (1024, 4864), (32768, 1024))
# A kernel this many times slower than the best at one band is not timed at larger bands: a kernel
# that multiplies row by row only falls further behind as rows grow.
PRUNE_RATIO = 20.0
# A kernel timed this many times slower over fewer rows than over more is timed again there (`repeats`
# more calls, the best kept): the smaller product does no more work, so the look caught something else.
# On an Intel VM of 2 cores whose other processes stayed idle, a 9728 x 896 Q5_0 product that takes
# 0.7 ms at one row timed 4.8 ms in all three calls and 1.1 ms at four rows.
INVERSION_RATIO = 1.5
# A call this slow is timed once: its time is not in doubt, and a second look costs as much again.
# Faster calls are timed TIMED_CALLS times, the best kept: on 2 cores one call in a few is preempted for
# 5 to 15 ms (on AMD EPYC Zen 5: 8.0 and 16.0 ms among 0.05 ms products).
SLOW_CALL_S = 0.05
TIMED_CALLS = 5
# How much faster a larger form must be to rank before a smaller one: its mean slowdown is weighed by its
# size over the smallest form's to this power, so a form twice the bytes must be 19% faster. Bytes are
# resident memory and, at one row, the time a decode reads them: a bfloat16 dense copy of a Q5_0 weight
# holds 2.9 times its blocks.
SIZE_WEIGHT = 0.25
# How much each band counts in a form's score: one row three times the others, since one user's decode runs
# at one row with nothing else to hide its time, and that is where llama.cpp leads (issue 53).
BAND_WEIGHTS = {1: 3.0, 4: 1.0, 16: 1.0, 64: 1.0, 256: 1.0}
# CPUs other processes may keep busy, beyond those this process's threads leave free, for a measurement to
# count as quiet: a shell, a logger or a kernel thread use a few hundredths.
QUIET_MARGIN_CPUS = 0.25


@dataclass(frozen=True)
class Timing:
    """One kernel at one band of rows on one weight shape: its time, or why it is not a candidate."""

    format: str  # the weight's stored format: a GGUF type name, or the dtype of a dense weight
    shape: tuple[int, int]  # [N, K]
    rows: int
    form: str
    kernel: str
    ms: float | None = None
    nmse: float | None = None
    dropped: str | None = None  # why not a candidate: wrong, failed, or too slow to time further

    @property
    def usable(self) -> bool:
        return self.ms is not None and self.dropped is None


def rank_forms(timings: Iterable[Timing], sizes: dict[str, int] | None = None) -> tuple[Choice, ...]:
    """Every form timed, best first, each with its fastest kernel per band (a band it was not timed at takes
    the kernel of the nearest band that was). A form's score is the mean over the bands, weighed by
    BAND_WEIGHTS, of its fastest time over the fastest of any form (PRUNE_RATIO where it has none), times its
    size in `sizes` (bytes) over the smallest's to the power SIZE_WEIGHT."""
    usable = [t for t in timings if t.usable]
    if not usable:
        raise ValueError("no usable kernel was timed")
    best: dict[tuple[str, int], Timing] = {}
    for t in usable:
        key = (t.form, t.rows)
        if key not in best or t.ms < best[key].ms:
            best[key] = t
    bands = sorted({t.rows for t in usable})
    fastest = {rows: min(t.ms for t in usable if t.rows == rows) for rows in bands}
    forms = list(dict.fromkeys(t.form for t in usable))
    sizes = sizes or {}
    smallest = min((sizes[f] for f in forms if sizes.get(f)), default=None)

    def score(form: str) -> float:
        ratios = [best[(form, rows)].ms / fastest[rows] if (form, rows) in best else PRUNE_RATIO for rows in bands]
        weights = [BAND_WEIGHTS.get(rows, 1.0) for rows in bands]
        size = (sizes.get(form) or smallest or 1) / (smallest or 1)
        return sum(r * w for r, w in zip(ratios, weights)) / sum(weights) * size**SIZE_WEIGHT

    ranked = []
    for form in sorted(forms, key=score):
        timed = sorted(rows for (f, rows) in best if f == form)
        kernels = [best[(form, min(timed, key=lambda rows: abs(np.log2(rows) - np.log2(band))))].kernel
                   for band in ROW_BANDS]
        ranked.append(Choice(form, tuple(kernels)))
    return tuple(ranked)


def summed(timings: Sequence[Timing]) -> list[Timing]:
    """One format's timings over its shapes as one: per form, kernel and band, the sum of the times where
    every shape timed it, which is what a model of those shapes spends in it."""
    shapes = {t.shape for t in timings}
    totals: dict[tuple[str, str, int], list[float]] = {}
    for t in timings:
        if t.usable:
            totals.setdefault((t.form, t.kernel, t.rows), []).append(t.ms)
    format = timings[0].format if timings else "-"
    return [Timing(format, (0, 0), rows, form, kernel, ms=sum(times))
            for (form, kernel, rows), times in totals.items() if len(times) == len(shapes)]


# measuring


class Stopwatch:
    """Seconds one kernel call takes with its weight read from memory, as a step reads it after the
    other layers' weights: the last-level cache is overwritten before each timed call."""

    def __init__(self, cache_bytes: int | None = None) -> None:
        import torch

        # float32, whose sum is vectorised: a uint8 sum of 32 MiB took 350 ms, float32 3 to 8
        self._evict = torch.ones((cache_bytes or last_level_cache_bytes()) // 4, dtype=torch.float32)

    def __call__(self, form: str, name: str, kernel: Kernel, x) -> float:
        self._evict.sum()
        start = time.perf_counter()
        kernel(x)
        return time.perf_counter() - start


def measure(format: str, shape: tuple[int, int], candidates: Sequence[Candidate], dtype: str,
            stopwatch: Callable[[str, str, Kernel, object], float], repeats: int = TIMED_CALLS, seed: int = 0,
            int8_activations: bool = False) -> tuple[list[Timing], dict[str, int]]:
    """Every candidate form built and every kernel of it timed at each band, with each form's size in bytes.
    A kernel is timed `repeats` times, the first call's output checked, and its best time kept; where that is
    INVERSION_RATIO above its time over more rows, it is timed again. Kernels that round x to 8 bits are
    candidates only with `int8_activations`."""
    timings: list[Timing] = []
    sizes: dict[str, int] = {}
    kernels: list[tuple[str, str, Kernel, np.ndarray, float]] = []
    checked = checked_rows(shape[0])
    for candidate in candidates:
        if candidate.unavailable:
            timings.append(Timing(format, shape, ROW_BANDS[0], candidate.form, "-", dropped=candidate.unavailable))
            continue
        try:
            kept = candidate.build()
        except Exception as exc:  # noqa: BLE001 - a form that cannot be built here is reported, not fatal
            timings.append(Timing(format, shape, ROW_BANDS[0], candidate.form, "-", dropped=f"failed: {exc}"))
            continue
        sizes[candidate.form] = kept.nbytes
        values = checked_values(kept, candidate, checked)
        for name, kernel in kept.kernels().items():
            if name in kept.rounds_activations and not int8_activations:
                continue
            kernels.append((candidate.form, name, kernel, values, budget_of(kept, name, dtype)))
    slow: dict[str, int] = {}  # kernel name: the rows it was found too slow at, not timed at more
    inputs: dict[int, object] = {}  # x of each band timed
    for rows in ROW_BANDS:
        x = inputs[rows] = random_x(rows, shape[1], dtype, seed + rows)
        references: dict[str, np.ndarray] = {}  # per form: x times its values, in float64
        band: list[Timing] = []
        for form, name, kernel, values, budget in kernels:
            if rows > slow.get(name, rows):
                continue
            if form not in references:
                references[form] = x.double().numpy() @ values.T
            band.append(_time_one(format, shape, rows, form, name, kernel, references[form], checked, x, budget,
                                  stopwatch, repeats))
        fastest = min((t.ms for t in band if t.usable), default=None)
        for t in band:
            if t.usable and fastest and t.ms > PRUNE_RATIO * fastest and t.ms < 1000 * SLOW_CALL_S:
                # looked at again before it is given up: one preempted look must not drop a kernel for good
                kernel = next(k for f, n, k, _, _ in kernels if (f, n) == (t.form, t.kernel))
                t = replace(t, ms=min(t.ms, 1000 * min(stopwatch(t.form, t.kernel, kernel, x) for _ in range(repeats))))
            if t.usable and fastest and t.ms > PRUNE_RATIO * fastest and rows < ROW_BANDS[-1]:
                slow[t.kernel] = min(rows, slow.get(t.kernel, rows))
                t = Timing(**{**asdict(t), "dropped": f"slow: {t.ms / fastest:.0f}x the fastest at {rows} rows, "
                                                      "not timed at more"})
            timings.append(t)
    calls = {(form, name): kernel for form, name, kernel, _, _ in kernels}
    return _inversions_timed_again(timings, calls, inputs, stopwatch, repeats), sizes


def _inversions_timed_again(timings: list[Timing], calls: dict[tuple[str, str], Kernel], inputs: dict[int, object],
                            stopwatch: Callable[[str, str, Kernel, object], float], repeats: int) -> list[Timing]:
    """`timings` with each kernel's time at a band INVERSION_RATIO above its best at a larger band taken
    again: the best of the first look and `repeats` more calls."""
    again = list(timings)
    for index, timing in enumerate(timings):
        larger = [t.ms for t in timings if t.usable and (t.form, t.kernel) == (timing.form, timing.kernel)
                  and t.rows > timing.rows]
        if not timing.usable or not larger or timing.ms <= INVERSION_RATIO * min(larger):
            continue
        kernel, x = calls[timing.form, timing.kernel], inputs[timing.rows]
        best = min(stopwatch(timing.form, timing.kernel, kernel, x) for _ in range(repeats)) * 1000
        again[index] = replace(timing, ms=min(timing.ms, best))
    return again


def _time_one(format, shape, rows, form, name, kernel, reference, checked, x, budget, stopwatch, repeats) -> Timing:
    outputs = []
    try:
        seconds = stopwatch(form, name, lambda x: outputs.append(kernel(x)), x)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails on this CPU is dropped with its error
        return Timing(format, shape, rows, form, name, dropped=f"failed: {type(exc).__name__}: {exc}")
    error = nmse(outputs[0][:, checked].double().numpy(), reference)
    if not error <= budget:
        return Timing(format, shape, rows, form, name, nmse=error, dropped=f"wrong: NMSE {error:.2g} > {budget:g}")
    for _ in range(repeats - 1 if seconds < SLOW_CALL_S else 0):
        seconds = min(seconds, stopwatch(form, name, kernel, x))
    return Timing(format, shape, rows, form, name, ms=seconds * 1000, nmse=error)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), or 32 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 * 2**20)


# the tool


@dataclass(frozen=True)
class Tuned:
    """What one format in one dtype and activation format measured: its row, and the timings summed over
    the shapes, for the report."""

    row: KernelRow
    timings: list[Timing]
    sizes: dict[str, int]  # bytes each form held, summed over the shapes
    busy_elsewhere: float | None  # CPUs other processes kept busy while it was measured, where known


def shapes_for(format: str, shapes: Sequence[tuple[int, int]] = TUNE_SHAPES) -> list[tuple[int, int]]:
    """The shapes of `shapes` whose K holds whole blocks or groups of `format`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from candelabra.core.contract.weights import INT4_GROUP_FORMATS

    step = INT4_GROUP_FORMATS.get(format) or GGML_QUANT_SIZES[GGMLQuantizationType[format]][0]
    return [shape for shape in shapes if shape[1] % step == 0]


def tune_format(format: str, dtype: str, activations: str, threads: int, shapes: Sequence[tuple[int, int]],
                stopwatch=None, repeats: int = TIMED_CALLS, seed: int = 0,
                watch_others: Callable[[], Callable[[], float | None]] = cpu_load.watch_others) -> Tuned | None:
    """`format`'s forms ranked from random weights of `shapes` in `dtype`; None where it has no form but dense
    (the weight is then dequantized, with nothing to choose)."""
    from candelabra.backends.torch.dtypes import torch_dtype
    from candelabra.backends.torch.quantized import candidates
    from candelabra.core.weights.random_quantized import random_quantized

    rng = np.random.default_rng(seed)
    stopwatch = stopwatch or Stopwatch()
    busy = watch_others()
    timings: list[Timing] = []
    sizes: dict[str, int] = {}
    for shape in shapes:
        found = candidates(random_quantized(rng, format, *shape), torch_dtype(dtype))
        if [c.form for c in found if not c.unavailable] == ["dense"]:
            return None
        measured, form_sizes = measure(format, shape, found, dtype, stopwatch, repeats, seed,
                                       int8_activations=activations == INT8)
        timings += measured
        for form, size in form_sizes.items():
            sizes[form] = sizes.get(form, 0) + size
    busy_elsewhere = busy()
    totals = summed(timings)
    if not totals:
        return None
    stamp = datetime.date.today().isoformat()
    measured_on = f"{machine_key(threads)['cpu']}, {threads} threads, candelabra tune {stamp}"
    row = KernelRow(frozenset({format}), frozenset({dtype}), isa_level(), rank_forms(totals, sizes), measured_on,
                    activations)
    return Tuned(row, timings, sizes, busy_elsewhere)


def tune(dtypes: Sequence[str], formats: Sequence[str], threads: int, activations: Sequence[str] = (EXACT, INT8),
         shapes: Sequence[tuple[int, int]] = TUNE_SHAPES, output: Path | None = None, stopwatch=None,
         repeats: int = TIMED_CALLS, progress: Callable[[str], None] | None = None) -> tuple[Path, list[Tuned]]:
    """Each format measured in each dtype and activation format, the rows written to `output` (default: this
    machine's tuned table, which serve reads); the path and what was measured. An int8 row is kept only where a
    kernel that rounds x ranks first in some form: else the exact row holds."""
    tuned: list[Tuned] = []
    for dtype in dtypes:
        for format in formats:
            fitting = shapes_for(format, shapes)
            if not fitting:
                continue
            exact = None
            for each in activations:
                if progress:
                    progress(f"{format} in {dtype}, x {each}")
                result = tune_format(format, dtype, each, threads, fitting, stopwatch, repeats)
                if result is None:
                    continue
                if each == EXACT:
                    exact = result
                elif exact is not None and result.row.choices == exact.row.choices:
                    continue
                tuned.append(result)
    path = output or tuned_file(machine_key(threads))
    write_tuned(path, machine_key(threads), [t.row for t in tuned])
    return path, tuned


def report(tuned: Sequence[Tuned], threads: int) -> str:
    """Per format, dtype and activation format: the forms ranked, each with its kernels and its time per band
    summed over the shapes, and any measurement taken while other processes kept the CPUs busy."""
    from candelabra.core.text_table import format_table

    spare = max(0, cpu_load.machine_cpus() - threads)
    lines = []
    for result in tuned:
        row = result.row
        totals = summed(result.timings)
        for rank, choice in enumerate(row.choices):
            times = []
            for band, kernel in zip(ROW_BANDS, choice.kernels):
                found = [t.ms for t in totals if (t.form, t.kernel, t.rows) == (choice.form, kernel, band)]
                times.append(f"{found[0]:.3f}" if found else "-")
            lines.append((" ".join(sorted(row.formats)) if rank == 0 else "", " ".join(sorted(row.dtypes)),
                          row.activations, str(rank + 1), choice.form, " ".join(choice.kernels), " ".join(times)))
    contended = [f"{' '.join(sorted(t.row.formats))} {' '.join(t.row.dtypes)} ({t.busy_elsewhere:.1f} CPUs)"
                 for t in tuned if t.busy_elsewhere is not None and t.busy_elsewhere > spare + QUIET_MARGIN_CPUS]
    text = format_table(("format", "dtype", "x", "rank", "form", f"kernels at {ROW_BANDS} rows", "ms summed"), lines)
    if contended:
        text += ("\nmeasured while other processes kept the CPUs busy, to tune again on a quiet machine: "
                 + ", ".join(contended))
    return text
