"""Which CPU kernel multiplies each weight: chosen by timing the candidates here, never by what is present.

The same instruction set runs one library's kernel a thousand times slower than another's: one row
through a 4864 x 896 int8 weight took 189 ms in oneDNN's packed kernel and 0.14 ms in torch's int8
weight-only kernel on AMD Zen 4, while on an Intel CPU with AMX the packed kernel was the faster.
So for every weight format and shape a model uploads, each form the weight can be kept in (`forms`)
and each kernel that multiplies that form is timed at every band of rows a step multiplies
(`ROW_BANDS`), on the real weight, and its output is checked against a float64 product of the
form's own values. The form kept is the one that comes closest to the fastest over all bands; each
band then runs that form's fastest kernel (`choose`).

Measuring stops once a budget of seconds is spent (`CANDELABRA_KERNEL_BUDGET_S`, 6 by default);
a weight measured after that follows the nearest measured shape of its format, and a band a weight
was not timed at takes the timings of the nearest shape of its format that was (`filled_in`). What was measured is
kept in the cache directory, one file per CPU model, CPU flags, torch version, thread count and
compute dtype (`cache_key`), so a second start on the same machine measures nothing, and another
CPU measures afresh.

Timings taken while other processes keep busy the CPUs this one's threads need are not to be
trusted: under one busy core a 0.45 ms int4 product timed 8 to 16 ms (a scheduler slice) and a
one-thread kernel won. Each measurement watches the rest of the machine (`cpu_load`); a weight
measured under contention serves this start, and later starts measure it again and keep each
kernel's best time over all looks (contention only slows a kernel), until one look ran quiet or
`MAX_LOOKS` were taken.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from candelabra.backends.torch import cpu_load

log = logging.getLogger("candelabra")

# Rows a step multiplies: one decode, a few, 16 and 64 decodes, and a prefill chunk. A call is timed
# at the band nearest its rows (in log scale).
ROW_BANDS = (1, 4, 16, 64, 256)
# The bands are timed most telling first: one decode and a batch decide most choices; a band left out
# when the budget runs short takes the kernel of the nearest band that was timed.
MEASURING_ORDER = (1, 64, 256, 16, 4)
BUDGET_VARIABLE, DEFAULT_BUDGET_S = "CANDELABRA_KERNEL_BUDGET_S", 6.0
# The share of the budget one weight shape may spend on bands past the first: a 151,936-row head took all
# of it at 1, 64 and 256 rows, leaving every other weight timed at one row only.
ENTRY_SHARE = 0.25
# A kernel this many times slower than the best at one band is not timed at larger bands: a kernel
# that multiplies row by row only falls further behind as rows grow.
PRUNE_RATIO = 20.0
# A kernel timed this many times slower over fewer rows than over more is timed again there (TIMED_CALLS
# more calls, the best kept): the smaller product does no more work, so the look caught something else.
# On an Intel VM of 2 cores whose other processes stayed idle, a 9728 x 896 Q5_0 product that takes
# 0.7 ms at one row timed 4.8 ms in all three calls and 1.1 ms at four rows; the weight went dense and
# one request's decode step took 89 ms instead of 53 (29 November).
INVERSION_RATIO = 1.5
# A call this slow is timed once: its time is not in doubt, and a second look costs as much again.
# Faster calls are timed three times, the best kept: on 2 cores one call in a few is preempted for 5 to
# 15 ms, which made a 0.3 ms kernel look 50 times slower at one band than at the next; and with two, a
# quiet start on the Intel VM kept int8_mm on a Q6_K 896 x 4864 weight at 7.99 ms (0.42 in 60 calls
# after), so the weight went to blocks_float at 1.0 ms for good.
SLOW_CALL_S = 0.05
TIMED_CALLS = 3
# Largest NMSE of a kernel's output against the float64 product of its form's values, per compute
# dtype: the conformance suite's general limits, far above a correct kernel's rounding (about 1e-14
# in float32, 1e-6 in bfloat16) and far below a wrong one's.
KERNEL_NMSE_BUDGET = {"float32": 1e-9, "float16": 1e-5, "bfloat16": 1e-4}
# A kernel that rounds x to 8 bits per block of 32 first, as llama.cpp multiplies, measures about 3e-5 on
# random inputs and 1.5e-4 with a few channels 100 times the rest, within what the conformance suite
# allows llama.cpp's own rounding. It is a candidate only where the user asks for it
# (`INT8_ACTIVATIONS_VARIABLE`): in bfloat16 it turned Gemma 3 270M's greedy "0 degrees" into "0°C"
# (tests/test_real_models.py), and docs/torch-backend.md gives its distance from the float32 reference
# on the default model (bench/quality_vs_reference.py). The NMSE such a kernel may reach, in any dtype:
# three times the outlying channels' case, below the 8.5e-4 that wrongly decoded blocks measured at the least
# (conformance/compare.py). At real widths (K of 896 and more) blocks_int8 measured at most 8.1e-5; the formats
# with an offset (Q4_1, Q5_1) at K = 64, two blocks, up to 1.7e-3 on the conformance suite's tiny models, whose
# weights of that width then keep the exact kernel.
ROUNDED_ACTIVATIONS_NMSE_BUDGET = 5e-4
INT8_ACTIVATIONS_VARIABLE = "CANDELABRA_INT8_ACTIVATIONS"
# Output features of a weight whose products are checked against float64: a wrong kernel is wrong on
# thousands of them.
CHECKED_OUTPUTS = 4096
# Version of the candidate set and of how they are timed: a new kernel or form, or a new way of timing
# them, makes every cached table stale (6: tables before it may hold timings taken under contention; 7:
# blocks_float decodes a chunk for 8 rows of x, not 4, and is faster from 8 rows; 8: with AVX-512,
# blocks_float takes 4 weight rows at a time and is faster from 16 rows; 9: blocks_float prefetches the
# weight and is faster at one row; 10: blocks_int8 is a candidate where the user allows it, within
# ROUNDED_ACTIVATIONS_NMSE_BUDGET).
CANDIDATES_VERSION = 10
# A weight measured under contention is measured again by later starts until one look runs quiet or it has
# had this many: the best of three contended looks is close to a quiet one, and each costs budget.
MAX_LOOKS = 3
# CPUs other processes may keep busy, beyond those this process's threads leave free, for a look to count as
# quiet: a shell, a logger or a kernel thread use a few hundredths.
QUIET_MARGIN_CPUS = 0.25

Kernel = Callable[[object], object]


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
    scaled_from: tuple[int, int] | None = None  # an estimate from this shape's timing, never measured itself

    @property
    def usable(self) -> bool:
        return self.ms is not None and self.dropped is None


@dataclass(frozen=True)
class Choice:
    """The form a weight is kept in and the kernel each band of rows runs on it."""

    form: str
    kernels: tuple[str, ...]  # one per ROW_BANDS entry

    def kernel_for(self, rows: int) -> str:
        return self.kernels[band_index(rows)]


def _nearest_band(rows: int) -> int:
    position = math.log2(max(rows, 1))
    return min(range(len(ROW_BANDS)), key=lambda i: abs(math.log2(ROW_BANDS[i]) - position))


# every call looks its band up: a table, since working it out took most of a small matmul's 9 us overhead
_BAND_OF_ROWS = tuple(_nearest_band(rows) for rows in range(4 * ROW_BANDS[-1] + 1))


def band_index(rows: int) -> int:
    """The index of the band in ROW_BANDS nearest `rows` in log scale."""
    return _BAND_OF_ROWS[rows] if rows < len(_BAND_OF_ROWS) else len(ROW_BANDS) - 1


def choose(timings: Iterable[Timing]) -> Choice:
    """The form whose fastest kernels come closest to the fastest of any form, on average over the bands
    (a form with no usable kernel at a band counts PRUNE_RATIO there), and its fastest kernel per band;
    a band its form was not timed at takes the kernel of the nearest band that was."""
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

    def slowdown(form: str) -> float:
        ratios = [best[(form, rows)].ms / fastest[rows] if (form, rows) in best else PRUNE_RATIO for rows in bands]
        return sum(ratios) / len(ratios)

    form = min(forms, key=slowdown)
    timed = sorted(rows for (f, rows) in best if f == form)
    kernels = []
    for band in ROW_BANDS:
        nearest = min(timed, key=lambda rows: abs(math.log2(rows) - math.log2(band)))
        kernels.append(best[(form, nearest)].kernel)
    return Choice(form, tuple(kernels))


def filled_in(timings: Sequence[Timing], entry: tuple[str, tuple[int, int]]) -> list[Timing]:
    """The timings of one weight (format, shape), and at each band it was not timed at, those of the
    shape of its format nearest in size that was, scaled by the ratio of the sizes: past the budget a
    weight is often timed at one row only, and the kernel that suits one row rarely suits 64."""
    format, shape = entry
    own = [t for t in timings if (t.format, t.shape) == entry]
    timed_bands = {t.rows for t in own if t.usable}
    size = shape[0] * shape[1]
    estimates = []
    for band in ROW_BANDS:
        if band in timed_bands:
            continue
        others = {t.shape for t in timings if t.format == format and t.rows == band and t.usable and t.shape != shape}
        if not others:
            continue
        nearest = min(others, key=lambda other: (abs(math.log(other[0] * other[1] / size)), other))
        ratio = size / (nearest[0] * nearest[1])
        estimates += [Timing(format, shape, band, t.form, t.kernel, ms=t.ms * ratio, scaled_from=nearest)
                      for t in timings if t.shape == nearest and t.format == format and t.rows == band and t.usable]
    return own + estimates


@dataclass(frozen=True)
class Looks:
    """How many times one weight (format, shape) was measured over the starts, whether one of them ran on a
    quiet machine, and the CPUs other processes kept busy during the latest (None where unknown)."""

    count: int = 1
    quiet: bool = True
    busy_elsewhere: float | None = None

    @property
    def settled(self) -> bool:
        """Whether later starts take its timings as they are."""
        return self.quiet or self.count >= MAX_LOOKS

    def then(self, later: Looks) -> Looks:
        return Looks(self.count + later.count, self.quiet or later.quiet, later.busy_elsewhere)


def merged(earlier: Sequence[Timing], later: Sequence[Timing]) -> list[Timing]:
    """Two measurements of the same weights as one: per kernel and band the faster time, since contention
    only ever slows a kernel down; a kernel found wrong or failing in either stays dropped."""
    kept: dict[tuple, Timing] = {}
    for timing in [*earlier, *later]:
        key = (timing.format, timing.shape, timing.rows, timing.form, timing.kernel)
        other = kept.get(key)
        kept[key] = timing if other is None else _trusted(other, timing)
    return list(kept.values())


def _trusted(earlier: Timing, later: Timing) -> Timing:
    for timing in (later, earlier):
        if timing.dropped and timing.ms is None:  # wrong, failed or unavailable: not a matter of speed
            return timing
    return earlier if earlier.ms <= later.ms else later


# measuring


@dataclass
class Candidate:
    """A form a weight can be kept in: how to build it, and its kernels once built."""

    form: str
    build: Callable[[], object]  # returns the kept weight, a weight_forms.KeptWeight
    values: Callable[[], object] | None = None  # its values, where the kept weight cannot give them back
    unavailable: str | None = None  # why it cannot be built here, if so


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
            stopwatch: Callable[[str, str, Kernel, object], float], seconds_left: Callable[[], float],
            repeats: int = TIMED_CALLS, seed: int = 0, int8_activations: bool = False,
            ) -> tuple[list[Timing], dict[str, object]]:
    """Every candidate form built and every kernel of it timed at one row, then at the other bands in
    MEASURING_ORDER while `seconds_left()` is positive (a band begun is finished); with the forms that
    were built. A kernel is timed `repeats` times, the first call's
    output checked, and its best time kept; where that is INVERSION_RATIO above its time over more rows, it
    is timed again. Kernels that round x to 8 bits are candidates only with `int8_activations`."""
    import torch

    from candelabra.backends.torch.dtypes import torch_dtype

    rng = np.random.default_rng(seed)
    # outputs checked: a sample of a large weight's rows, whose float64 product costs a few percent of the
    # whole one's (a 151,936-row head took seconds of the budget in float64 copies and products)
    checked = np.sort(rng.choice(shape[0], CHECKED_OUTPUTS, replace=False)) if shape[0] > CHECKED_OUTPUTS \
        else slice(None)
    timings: list[Timing] = []
    built: dict[str, object] = {}
    kernels: list[tuple[str, str, Kernel, np.ndarray, float]] = []
    for candidate in candidates:
        if candidate.unavailable:
            timings.append(Timing(format, shape, ROW_BANDS[0], candidate.form, "-", dropped=candidate.unavailable))
            continue
        try:
            kept = built[candidate.form] = candidate.build()
        except Exception as exc:  # noqa: BLE001 - a form that cannot be built here is reported, not fatal
            timings.append(Timing(format, shape, ROW_BANDS[0], candidate.form, "-", dropped=f"failed: {exc}"))
            continue
        values = (candidate.values or kept.dense)()[checked].double().numpy()
        for name, kernel in kept.kernels().items():
            rounding = name in getattr(kept, "rounds_activations", ())
            if rounding and not int8_activations:
                timings.append(Timing(format, shape, ROW_BANDS[0], candidate.form, name,
                                      dropped=f"rounds activations to 8 bits: a candidate with "
                                              f"{INT8_ACTIVATIONS_VARIABLE}=1 only"))
                continue
            budget = ROUNDED_ACTIVATIONS_NMSE_BUDGET if rounding else KERNEL_NMSE_BUDGET[dtype]
            kernels.append((candidate.form, name, kernel, values, budget))
    slow: dict[str, int] = {}  # kernel name: the rows it was found too slow at, not timed at more
    inputs: dict[int, object] = {}  # x of each band timed
    for rows in MEASURING_ORDER:
        if rows > MEASURING_ORDER[0] and seconds_left() <= 0:
            break
        x = inputs[rows] = torch.from_numpy(rng.standard_normal((rows, shape[1]))).to(torch_dtype(dtype))
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
            if t.usable and fastest and t.ms > PRUNE_RATIO * fastest and rows < ROW_BANDS[-1]:
                slow[t.kernel] = min(rows, slow.get(t.kernel, rows))
                t = Timing(**{**asdict(t), "dropped": f"slow: {t.ms / fastest:.0f}x the fastest at {rows} rows, "
                                                      "not timed at more"})
            timings.append(t)
    calls = {(form, name): kernel for form, name, kernel, _, _ in kernels}
    return _inversions_timed_again(timings, calls, inputs, stopwatch, repeats, seconds_left), built


def _inversions_timed_again(timings: list[Timing], calls: dict[tuple[str, str], Kernel], inputs: dict[int, object],
                            stopwatch: Callable[[str, str, Kernel, object], float], repeats: int,
                            seconds_left: Callable[[], float]) -> list[Timing]:
    """`timings` with each kernel's time at a band INVERSION_RATIO above its best at a larger band taken
    again, while the budget lasts: the best of the first look and `repeats` more calls."""
    again = list(timings)
    for index, timing in enumerate(timings):
        larger = [t.ms for t in timings if t.usable and (t.form, t.kernel) == (timing.form, timing.kernel)
                  and t.rows > timing.rows]
        if not timing.usable or not larger or timing.ms <= INVERSION_RATIO * min(larger) or seconds_left() <= 0:
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
    error = _nmse(outputs[0][:, checked].double().numpy(), reference)
    if not error <= budget:
        return Timing(format, shape, rows, form, name, nmse=error, dropped=f"wrong: NMSE {error:.2g} > {budget:g}")
    for _ in range(repeats - 1 if seconds < SLOW_CALL_S else 0):
        seconds = min(seconds, stopwatch(form, name, kernel, x))
    return Timing(format, shape, rows, form, name, ms=seconds * 1000, nmse=error)


def _nmse(output: np.ndarray, reference: np.ndarray) -> float:
    scale = float(np.sum(np.square(reference)))
    error = float(np.sum(np.square(output - reference)))
    return error / scale if scale else (0.0 if error == 0 else math.inf)


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


# the table kept per machine


def cache_key(dtype: str, threads: int, int8_activations: bool = False) -> dict[str, str]:
    """What a measured table holds for: this CPU, its flags, this torch, the threads, the dtype and whether
    kernels that round x to int8 were candidates."""
    import torch

    from candelabra.backends.torch.cpu.features import cpu_flags, cpu_model_name

    return {
        "cpu": cpu_model_name(),
        "flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": str(threads),
        "dtype": dtype,
        "candidates": str(CANDIDATES_VERSION),
        "activations": "int8" if int8_activations else "exact",
    }


def tables_folder() -> Path:
    """$CANDELABRA_KERNEL_TABLES, else the cache's kernels/. The test suite keeps its tables apart: it
    measures while its workers load every core, and entries measured under load three times are kept
    (Looks), which would leave a server started later on a quiet machine with the suite's timings."""
    from candelabra.core.weights.default_model import default_cache_dir

    if os.environ.get("CANDELABRA_KERNEL_TABLES"):
        return Path(os.environ["CANDELABRA_KERNEL_TABLES"]).expanduser()
    return default_cache_dir() / "kernels"


def cache_file(key: dict[str, str], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    rounded = "-int8-activations" if key.get("activations") == "int8" else ""
    return (folder or tables_folder()) / f"{key['dtype']}{rounded}-{digest}.json"


Entry = tuple[str, tuple[int, int]]  # a weight's format and shape [N, K]


class KernelTable(NamedTuple):
    """What a table file holds: the timings, and per weight (format, shape) how it was measured."""

    timings: list[Timing]
    looks: dict[Entry, Looks]


def read_table(path: Path, key: dict[str, str]) -> KernelTable:
    """The table cached at `path` for `key`; empty when the file is missing, unreadable or for another key."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return KernelTable([], {})
        timings = [Timing(**{**t, "shape": tuple(t["shape"])}) for t in data["timings"]]
        looks = {(look["format"], tuple(look["shape"])): Looks(look["count"], look["quiet"], look["busy_elsewhere"])
                 for look in data["looks"]}
        return KernelTable(timings, looks)
    except (OSError, ValueError, KeyError, TypeError):
        return KernelTable([], {})


def write_table(path: Path, key: dict[str, str], table: KernelTable) -> None:
    """Written to a temporary file and renamed, so a reader never sees half a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    looks = [{"format": format, "shape": shape, **asdict(look)} for (format, shape), look in table.looks.items()]
    temporary.write_text(json.dumps({"key": key, "timings": [asdict(t) for t in table.timings], "looks": looks},
                                    indent=1))
    temporary.replace(path)


class KernelChooser:
    """The choices of one process for one compute dtype: read from the cache, measured where missing (or
    measured under contention before) while the budget lasts, written back."""

    def __init__(self, dtype: str, threads: int, budget_s: float | None = None, folder: Path | None = None,
                 stopwatch: Callable[[str, str, Kernel, object], float] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 watch_others: Callable[[], Callable[[], float | None]] = cpu_load.watch_others,
                 machine_cpus: int | None = None, int8_activations: bool | None = None) -> None:
        """`watch_others` starts watching the rest of the machine and returns what gives the CPUs other
        processes kept busy since; a look is quiet while they stay within the `machine_cpus` (default: all
        of the machine's) this process's `threads` leave free, plus QUIET_MARGIN_CPUS. Kernels that round x to
        int8 are candidates where `int8_activations` (default: $CANDELABRA_INT8_ACTIVATIONS) says so, and are
        measured into a table of their own."""
        self.dtype = dtype
        self.int8_activations = int8_activations_from_environment() if int8_activations is None else int8_activations
        self.key = cache_key(dtype, threads, self.int8_activations)
        self.path = cache_file(self.key, folder)
        self.timings, self.looks = read_table(self.path, self.key)
        self.budget_s = budget_from_environment() if budget_s is None else budget_s
        self.spent_s = 0.0
        self._stopwatch = stopwatch
        self._clock = clock  # what the budget is counted in
        self._watch_others = watch_others
        self.spare_cpus = max(0, (machine_cpus or cpu_load.machine_cpus()) - threads)
        self.used: dict[Entry, int] = {}  # weights following each measured entry
        self.measured_here: dict[Entry, Looks] = {}  # this process's look at each entry it measured
        self._logged = self._warned = False

    def keep(self, format: str, shape: tuple[int, int], candidates: Sequence[Candidate]):
        """The weight in the form chosen for its format and shape, with its kernel per band set. Weights of
        one format and shape share their timings, but not always their candidates (int8 rows only where a
        weight's values allow them): each chooses among its own."""
        forms = {c.form for c in candidates if not c.unavailable}
        entry = self._entry(format, shape, forms)
        built: dict[str, object] = {}
        if entry is None:  # measured now
            entry = (format, shape)
            timings, built = self._measure(entry, candidates)
            own = [t for t in self.timings if (t.format, t.shape) == entry]
            self.timings = [t for t in self.timings if (t.format, t.shape) != entry] + merged(own, timings)
            self._save()
        choice = choose(t for t in filled_in(self.timings, entry) if t.form in forms)
        self.used[entry] = self.used.get(entry, 0) + 1
        kept = built.get(choice.form) or next(c for c in candidates if c.form == choice.form).build()
        kept.choice = choice
        return kept

    def _measure(self, entry: Entry, candidates: Sequence[Candidate]) -> tuple[list[Timing], dict[str, object]]:
        """The entry's timings and the forms built, this process's look at it recorded beside the earlier ones."""
        started = self._clock()
        stopwatch = self._stopwatch or Stopwatch()  # its cache-sized buffer lives while measuring only
        busy_elsewhere = self._watch_others()

        def seconds_left() -> float:
            spent = self._clock() - started
            return min(self.budget_s - self.spent_s - spent, ENTRY_SHARE * self.budget_s - spent)

        timings, built = measure(*entry, candidates, self.dtype, stopwatch, seconds_left,
                                 int8_activations=self.int8_activations)
        self.spent_s += self._clock() - started
        busy = busy_elsewhere()
        busy = None if busy is None else round(busy, 3)
        look = Looks(1, busy is None or busy <= self.spare_cpus + QUIET_MARGIN_CPUS, busy)
        self.measured_here[entry] = look
        self.looks[entry] = self.looks[entry].then(look) if entry in self.looks else look
        if not look.quiet and not self._warned:
            log.warning("kernel timings taken while other processes keep %.1f CPUs busy (this process's threads "
                        "leave %d free), first of %s %dx%d: they serve this start, and later starts measure the "
                        "weights again, up to %d looks each", busy, self.spare_cpus, entry[0], *entry[1], MAX_LOOKS)
            self._warned = True
        return timings, built

    def _entry(self, format: str, shape: tuple[int, int], forms: set[str]):
        """The measured (format, shape) this weight follows, or None when it is to be measured now: its
        own where one of its forms was timed there (measured again, while the budget lasts, where earlier
        starts looked only under contention), else, past the budget, the nearest shape of its format where
        one was."""
        own = (format, shape)
        if forms & self._forms(own):
            settled = own in self.measured_here or own not in self.looks or self.looks[own].settled
            return own if settled or self.spent_s >= self.budget_s else None
        if self.spent_s < self.budget_s:
            return None
        same_format = [entry for entry in {(t.format, t.shape) for t in self.timings}
                       if entry[0] == format and forms & self._forms(entry)]
        if not same_format:
            return None  # never guessed across formats: measured even past the budget
        size = shape[0] * shape[1]
        return min(same_format, key=lambda entry: abs(math.log(entry[1][0] * entry[1][1] / size)))

    def _forms(self, entry) -> set[str]:
        return {t.form for t in self.timings if (t.format, t.shape) == entry and t.usable}

    def _save(self) -> None:
        """Write the table back, with the weights another process measured into the file meanwhile."""
        theirs = read_table(self.path, self.key)
        mine = set(self.looks) | {(t.format, t.shape) for t in self.timings}
        self.timings += [t for t in theirs.timings if (t.format, t.shape) not in mine]
        self.looks.update({entry: look for entry, look in theirs.looks.items() if entry not in mine})
        try:
            write_table(self.path, self.key, KernelTable(self.timings, self.looks))
        except OSError as exc:
            log.warning("could not keep the kernel table in %s (%s): the next start measures again", self.path, exc)

    def report(self) -> str:
        """The table of what the weights used: per format and shape, per band, the kernel chosen, its time
        and the runner-up, and what measuring cost."""
        entries = list(self.used)
        table = format_choices(self.timings, entries)
        measured = sum(1 for e in entries if e in self.measured_here)
        source = (f"measured {measured} of {len(entries)} weight shapes in {self.spent_s:.1f} s "
                  f"(budget {self.budget_s:g} s), the rest from {self.path}" if measured
                  else f"all {len(entries)} weight shapes from {self.path}")
        contended = [look.busy_elsewhere for look in self.measured_here.values() if not look.quiet]
        if contended:
            source += (f"; {len(contended)} measured while other processes kept up to {max(contended):.1f} CPUs "
                       f"busy, to be measured again by the next start")
        rounded = f", x rounded to int8 where a kernel does ({INT8_ACTIVATIONS_VARIABLE}=1)" \
            if self.int8_activations else ""
        return f"kernels for {self.dtype} on {self.key['cpu']}{rounded} ({source}):\n{table}"

    def log_once(self) -> None:
        if self.used and not self._logged:
            log.info("%s", self.report())
            self._logged = True


def budget_from_environment() -> float:
    text = os.environ.get(BUDGET_VARIABLE, "").strip()
    if not text:
        return DEFAULT_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{BUDGET_VARIABLE}={text!r}: give the seconds kernel measuring may take, e.g. 4")
    return value


def int8_activations_from_environment() -> bool:
    """Whether $CANDELABRA_INT8_ACTIVATIONS lets kernels that round x to int8 serve: 1 yes, 0 or unset no."""
    text = os.environ.get(INT8_ACTIVATIONS_VARIABLE, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{INT8_ACTIVATIONS_VARIABLE}={text!r}: 1 lets kernels that round activations to int8 "
                         "serve (as llama.cpp multiplies), 0 or unset keeps every product exact to the dtype")
    return text == "1"


def format_choices(timings: Sequence[Timing], entries: Iterable[tuple[str, tuple[int, int]]]) -> str:
    """One line per weight (format, shape) and band: the chosen kernel and time, the runner-up, and
    the candidates dropped with their reason."""
    from candelabra.core.text_table import format_table

    lines = []
    for entry in entries:
        mine = filled_in(timings, entry)
        if not any(t.usable for t in mine):
            continue
        choice = choose(mine)
        for band, kernel in zip(ROW_BANDS, choice.kernels):
            at_band = sorted((t for t in mine if t.rows == band and t.usable), key=lambda t: t.ms)
            chosen = next((t for t in at_band if t.form == choice.form and t.kernel == kernel), None)
            others = [t for t in at_band if t is not chosen]
            lines.append((
                f"{entry[0]} {entry[1][0]}x{entry[1][1]}", str(band), f"{choice.form}/{kernel}",
                _shown_ms(chosen) if chosen else "(nearest band)",
                f"{others[0].form}/{others[0].kernel} {_shown_ms(others[0])}" if others else "-",
            ))
        for t in mine:
            if t.dropped and not t.dropped.startswith("slow"):
                lines.append((f"{entry[0]} {entry[1][0]}x{entry[1][1]}", str(t.rows), f"{t.form}/{t.kernel}",
                              "dropped", t.dropped))
    return format_table(("weight", "rows", "chosen", "ms", "runner-up ms"), lines)


def _shown_ms(timing: Timing) -> str:
    if timing.scaled_from:
        return f"~{timing.ms:.3f} (as {timing.scaled_from[0]}x{timing.scaled_from[1]})"
    return f"{timing.ms:.3f}"


def cached_tables(folder: Path | None = None) -> list[tuple[dict[str, str], list[Timing]]]:
    """Every table cached for this CPU, flags and torch (any dtype, thread count or activation rounding)."""
    folder = folder or tables_folder()
    mine = {k: v for k, v in cache_key("-", 0).items() if k not in ("dtype", "threads", "activations")}
    tables = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            key = data["key"]
        except (OSError, ValueError, KeyError):
            continue
        if all(key.get(k) == v for k, v in mine.items()):
            tables.append((key, read_table(path, key).timings))
    return tables


_CHOOSERS: dict[tuple[str, int, Path, bool], KernelChooser] = {}


def chooser_for(dtype: str, threads: int) -> KernelChooser:
    """One chooser per compute dtype, thread count, cache folder and activation rounding in a process, so
    that its budget is spent once."""
    key = (dtype, threads, tables_folder(), int8_activations_from_environment())
    if key not in _CHOOSERS:
        _CHOOSERS[key] = KernelChooser(dtype, threads, folder=key[2], int8_activations=key[3])
    return _CHOOSERS[key]


def log_choices() -> None:
    """Each chooser's table, the first time its weights are all loaded."""
    for chooser in _CHOOSERS.values():
        chooser.log_once()


def describe_cached(folder: Path | None = None) -> list[str]:
    """The tables measured on this machine (any dtype and thread count), for `candelabra backends --kernels`."""
    described = []
    for key, timings in cached_tables(folder):
        entries = list(dict.fromkeys((t.format, t.shape) for t in timings))
        rounded = ", x rounded to int8" if key.get("activations") == "int8" else ""
        described.append(f"{key['dtype']}{rounded}, {key['threads']} threads, {key['cpu']}, torch {key['torch']}:\n"
                         f"{format_choices(timings, entries)}")
    return described
