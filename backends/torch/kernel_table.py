"""Which kernel multiplies a quantized weight on a CPU: a table in code, read at load and never timed there.

A row holds for some weight formats, compute dtypes, one ISA level (`isa_level`) and one activation format.
It ranks the forms a weight may be kept in (quantized.py) and names, for each form, the kernel of every
band of rows a step multiplies (`ROW_BANDS`). A weight takes the first form of the first row of its CPU's
level that it can be kept in. A level with no row for the weight passes to the level below, down to
`ANY`, whose rows hold every format and dtype. kernel_selection.py checks each kernel it takes against a
float64 product before it serves. A wrong one passes to the next form.

The rows come from `candelabra tune --backend torch` (kernel_tuning.py) on the CPUs we have, and each
names its CPU in `measured`. A machine's own tuned table, written by the same command, comes before them
(`tuned_rows`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from candelabra.backends.torch.cpu import kernel_build
from candelabra.core.contract.weights import QUANTIZED_FORMATS

log = logging.getLogger("candelabra")

# Rows a step multiplies: one decode, a few, 16 and 64 decodes, and a prefill chunk. A call runs the kernel
# of the band nearest its rows in log scale.
ROW_BANDS = (1, 4, 16, 64, 256)
# ISA levels, best first. A level's rows hold for the CPUs of that level; a weight they leave out passes to
# the next. `ANY` holds every CPU.
AMX, ANY = "amx", "any"
ISA_LEVELS = (AMX, *(variant.name for variant in kernel_build.VARIANTS), ANY)
AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
EXACT, INT8 = "exact", "int8"
INT8_ACTIVATIONS_VARIABLE = "CANDELABRA_INT8_ACTIVATIONS"


@dataclass(frozen=True)
class Choice:
    """A form a weight is kept in and the kernel each band of rows runs on it."""

    form: str
    kernels: tuple[str, ...]  # one per ROW_BANDS entry

    def __post_init__(self) -> None:
        if len(self.kernels) != len(ROW_BANDS):
            raise ValueError(f"a choice names one kernel per band {ROW_BANDS}, got {self.kernels}")

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


@dataclass(frozen=True)
class KernelRow:
    """The forms, best first, that weights of `formats` take in `dtypes` on a CPU of level `isa`, with x in
    `activations` ("exact": the compute dtype; "int8": rounded per block of 32, as llama.cpp multiplies)."""

    formats: frozenset[str]
    dtypes: frozenset[str]
    isa: str
    choices: tuple[Choice, ...]
    measured: str  # the CPU the row was measured on, and how
    activations: str = EXACT

    def holds(self, format: str, dtype: str, activations: str) -> bool:
        return format in self.formats and dtype in self.dtypes and activations == self.activations


def _row(formats: str, dtypes: str, isa: str, choices: dict[str, str], measured: str,
         activations: str = EXACT) -> KernelRow:
    """A row written compactly: formats and dtypes space-separated, each form's kernels per band
    space-separated ("blocks_float*3 blocks_rebuild*2" repeats a kernel over bands)."""
    parsed = []
    for form, kernels in choices.items():
        names = []
        for word in kernels.split():
            name, _, count = word.partition("*")
            names += [name] * int(count or 1)
        parsed.append(Choice(form, tuple(names)))
    return KernelRow(frozenset(formats.split()), frozenset(dtypes.split()), isa, tuple(parsed), measured, activations)


def _measured_rows(isa: str, measured: str, rows) -> tuple[KernelRow, ...]:
    """Rows measured together on one CPU: (formats, dtypes, activations, choices) each."""
    return tuple(_row(formats, dtypes, isa, choices, measured, activations)
                 for formats, dtypes, activations, choices in rows)


LEGACY = "Q4_0 Q4_1 Q5_0 Q5_1 Q8_0"  # blocks of 32 values
K_QUANTS = "Q2_K Q3_K Q4_K Q5_K Q6_K"  # super-blocks of 256
INT4_GROUPS = "INT4_G32 INT4_G64 INT4_G128 INT4_G256"  # GPTQ and AWQ
ALL_FORMATS = " ".join(QUANTIZED_FORMATS)
FLOAT = "float32 bfloat16 float16"

# The rows of ISA level ANY, for a CPU no row was measured on (aarch64, an x86 without AVX2) and the forms a
# measured row leaves out: the exact kernels that read the fewest bytes a weight, its blocks as stored up to
# 64 rows and slices decoded for a float32 GEMM in a prefill (what AMD Zen 3 measured, block_products.py).
UNMEASURED = "not measured on such a CPU: the exact kernels that read the fewest bytes"
FALLBACK_ROWS = (
    _row(ALL_FORMATS, "float32", ANY, {
        "blocks": "blocks_float*4 blocks_rebuild",
        "int4": "int4_mm*4 rebuild",
        "dense": "dense*5",
    }, UNMEASURED),
    _row(ALL_FORMATS, "bfloat16 float16", ANY, {
        "blocks": "blocks_float*4 blocks_rebuild_f32",
        "int4": "int4_mm*4 rebuild_f32",
        "int8": "int8_mm*4 rebuild_f32",
        "dense": "dense_f32*5",
    }, UNMEASURED),
)

ZEN5 = "AMD EPYC Zen 5 (family 26), 2 cores, AVX-512 with VNNI and BF16, no AMX (bench/results/2026-12-02-zen5-kernels)"
ZEN5_AS_AVX2 = ("AMD EPYC Zen 5 held to AVX2: torch, oneDNN and the avx2 variant "
                "(bench/results/2026-12-02-zen5-kernels)")
# oneDNN's packed int8 on AMX, against torch's int8 weight-only kernel, ms (packed_int8.py): 9728 x 896 0.44 /
# 0.70 at one row, 0.97 / 6.7 at 64; the LM head 4.4 at one row, where blocks_float took 6.4. Where oneDNN
# does not serve (float32, a weight too far from its int8 rows), the avx512 rows below hold.
XEON_AMX = "Intel Xeon, 2 cores, AVX-512 and AMX: the default model's weights (packed_int8.py)"

AMX_ROWS = (
    _row("Q8_0 Q5_0 Q5_1 Q2_K Q3_K Q5_K Q6_K", "bfloat16", AMX, {"int8_packed": "onednn*5"}, XEON_AMX),
)

# `python bench/cpu_kernel_table.py --dtype bfloat16 --dtype float32`, ranked by kernel_tuning.rank_forms.
AVX512_ROWS = _measured_rows("avx512", ZEN5, (
    ("Q4_0", "bfloat16", EXACT, {"blocks": "blocks_float*3 blocks_rebuild*2", "int4": "int4_mm*5", "dense": "dense*5"}),
    ("Q4_0", "bfloat16", INT8,
     {"blocks": "blocks_int8 blocks_float*2 blocks_rebuild*2", "int4": "int4_mm*5", "dense": "dense*5"}),
    ("Q4_1", "bfloat16", EXACT, {"blocks": "blocks_float*3 blocks_rebuild*2", "int4": "int4_mm*5", "dense": "dense*5"}),
    ("Q4_1", "bfloat16", INT8, {"blocks": "blocks_int8*3 blocks_rebuild*2", "int4": "int4_mm*5", "dense": "dense*5"}),
    ("Q5_0", "bfloat16", EXACT,
     {"int8": "int8_mm*2 int8_split rebuild*2", "blocks": "blocks_float*3 blocks_rebuild*2", "dense": "dense*5"}),
    ("Q5_0", "bfloat16", INT8,
     {"blocks": "blocks_int8*2 blocks_float blocks_rebuild*2", "int8": "int8_mm*2 int8_split*3", "dense": "dense*5"}),
    ("Q5_1", "bfloat16", EXACT,
     {"int8": "int8_mm*2 int8_split*2 rebuild", "blocks": "blocks_float*3 blocks_rebuild*2", "dense": "dense*5"}),
    ("Q5_1", "bfloat16", INT8,
     {"blocks": "blocks_int8 blocks_float blocks_rebuild*3",
      "int8": "int8_mm*2 int8_split rebuild*2", "dense": "dense*5"}),
    ("Q8_0", "bfloat16", EXACT,
     {"int8": "int8_mm*2 int8_split*2 rebuild",
      "blocks": "blocks_float*3 blocks_rebuild_f32 blocks_float", "dense": "dense*5"}),
    ("Q8_0", "bfloat16", INT8,
     {"blocks": "blocks_int8*2 blocks_rebuild*3", "int8": "int8_mm*2 rebuild int8_split rebuild", "dense": "dense*5"}),
    ("Q2_K", "bfloat16", EXACT, {"int8": "int8_mm*2 int8_split*2 rebuild", "dense": "dense*5"}),
    ("Q2_K", "bfloat16", INT8, {"int8": "int8_mm int8_split rebuild*3", "dense": "dense*5"}),
    ("Q3_K", "bfloat16", EXACT, {"int8": "int8_mm*2 int8_split*2 rebuild", "dense": "dense*5"}),
    ("Q3_K", "bfloat16", INT8, {"int8": "int8_mm*2 rebuild int8_split rebuild", "dense": "dense*5"}),
    ("Q4_K", "bfloat16", EXACT, {"blocks": "blocks_float*3 blocks_rebuild*2", "int4": "int4_mm*5", "dense": "dense*5"}),
    ("Q4_K", "bfloat16", INT8,
     {"blocks": "blocks_int8*2 blocks_float blocks_rebuild*2", "int4": "int4_mm*5", "dense": "dense*5"}),
    ("Q5_K", "bfloat16", EXACT,
     {"int8": "int8_mm*2 int8_split*2 rebuild", "blocks": "blocks_float*3 blocks_rebuild*2", "dense": "dense*5"}),
    ("Q5_K", "bfloat16", INT8,
     {"blocks": "blocks_int8*2 blocks_float blocks_rebuild*2",
      "int8": "int8_mm*2 rebuild int8_split rebuild", "dense": "dense*5"}),
    ("Q6_K", "bfloat16", EXACT,
     {"int8": "int8_mm*2 int8_split rebuild*2", "blocks": "blocks_float*2 blocks_rebuild*3", "dense": "dense*5"}),
    ("Q6_K", "bfloat16", INT8,
     {"blocks": "blocks_int8*3 blocks_rebuild*2", "int8": "int8_mm*2 int8_split*2 rebuild", "dense": "dense*5"}),
    ("INT4_G32", "bfloat16", EXACT, {"int4": "int4_mm*5", "dense": "dense*5"}),
    ("INT4_G64", "bfloat16", EXACT, {"int4": "int4_mm*5", "dense": "dense*5"}),
    ("INT4_G64", "bfloat16", INT8, {"int4": "int4_mm*5", "dense": "dense*5"}),
    ("INT4_G128", "bfloat16", EXACT, {"int4": "int4_mm*5", "dense": "dense*5"}),
    ("INT4_G128", "bfloat16", INT8, {"int4": "int4_mm*5", "dense": "dense*5"}),
    ("INT4_G256", "bfloat16", EXACT, {"int4": "int4_mm*5", "dense": "dense*5"}),
    ("Q4_0", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q4_0", "float32", INT8, {"blocks": "blocks_int8 blocks_float*4", "dense": "dense*5"}),
    ("Q4_1", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q4_1", "float32", INT8, {"blocks": "blocks_int8*3 blocks_float*2", "dense": "dense*5"}),
    ("Q5_0", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q5_0", "float32", INT8, {"blocks": "blocks_int8*3 blocks_float*2", "dense": "dense*5"}),
    ("Q5_1", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q5_1", "float32", INT8,
     {"blocks": "blocks_int8 blocks_float blocks_int8 blocks_float blocks_int8", "dense": "dense*5"}),
    ("Q8_0", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q8_0", "float32", INT8, {"blocks": "blocks_int8*3 blocks_float blocks_int8", "dense": "dense*5"}),
    ("Q4_K", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q4_K", "float32", INT8, {"blocks": "blocks_int8 blocks_float*4", "dense": "dense*5"}),
    ("Q5_K", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q5_K", "float32", INT8,
     {"blocks": "blocks_int8 blocks_float blocks_int8 blocks_float blocks_int8", "dense": "dense*5"}),
    ("Q6_K", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q6_K", "float32", INT8, {"blocks": "blocks_int8 blocks_float*2 blocks_int8*2", "dense": "dense*5"}),
    ("INT4_G32", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
    ("INT4_G32", "float32", INT8, {"dense": "dense*5", "int4": "int4_mm*5"}),
    ("INT4_G64", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
    ("INT4_G128", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
    ("INT4_G256", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
))

# `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_kernel_table.py --isa avx2
# --kernel-variant avx2 --dtype float32`: the code an AVX2 CPU runs, on Zen 5's memory and caches.
AVX2_ROWS = _measured_rows("avx2", ZEN5_AS_AVX2, (
    ("Q8_0", "float32", EXACT, {"blocks": "blocks_float*4 blocks_rebuild", "dense": "dense*5"}),
    ("Q8_0", "float32", INT8, {"blocks": "blocks_int8*5", "dense": "dense*5"}),
    ("Q4_0", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q4_0", "float32", INT8, {"blocks": "blocks_int8*5", "dense": "dense*5"}),
    ("Q4_1", "float32", EXACT, {"blocks": "blocks_float*3 blocks_rebuild*2", "dense": "dense*5", "int4": "rebuild*5"}),
    ("Q4_1", "float32", INT8, {"blocks": "blocks_int8*5", "dense": "dense*5"}),
    ("Q5_0", "float32", EXACT, {"blocks": "blocks_float*3 blocks_rebuild*2", "dense": "dense*5"}),
    ("Q5_0", "float32", INT8, {"blocks": "blocks_int8*4 blocks_rebuild", "dense": "dense*5"}),
    ("Q5_1", "float32", EXACT, {"blocks": "blocks_float*3 blocks_rebuild*2", "dense": "dense*5"}),
    ("Q5_1", "float32", INT8, {"blocks": "blocks_int8*5", "dense": "dense*5"}),
    ("Q4_K", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5", "int4": "rebuild*5"}),
    ("Q4_K", "float32", INT8, {"blocks": "blocks_int8*5", "dense": "dense*5"}),
    ("Q5_K", "float32", EXACT, {"blocks": "blocks_float*3 blocks_rebuild*2", "dense": "dense*5"}),
    ("Q5_K", "float32", INT8, {"blocks": "blocks_int8*5", "dense": "dense*5"}),
    ("Q6_K", "float32", EXACT, {"blocks": "blocks_float*5", "dense": "dense*5"}),
    ("Q6_K", "float32", INT8, {"blocks": "blocks_int8*5", "dense": "dense*5"}),
    ("INT4_G32", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
    ("INT4_G64", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
    ("INT4_G128", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
    ("INT4_G256", "float32", EXACT, {"dense": "dense*5", "int4": "rebuild*5"}),
))

TABLE: tuple[KernelRow, ...] = (*AMX_ROWS, *AVX512_ROWS, *AVX2_ROWS, *FALLBACK_ROWS)


# the CPU's level


def isa_level(flags: frozenset[str] | None = None) -> str:
    """The best ISA level of TABLE this CPU (or one with `flags`) belongs to: AMX where it has AMX and
    AVX-512, else the best kernel variant it runs, else ANY."""
    from candelabra.backends.torch.cpu.features import cpu_flags

    flags = cpu_flags() if flags is None else flags
    machine = kernel_build.machine()
    variants = [v for v in kernel_build.VARIANTS if machine in v.machines and v.cpu_flags <= flags]
    if variants and variants[0].name == "avx512" and AMX_FLAGS <= flags:
        return AMX
    return variants[0].name if variants else ANY


def levels_from(level: str) -> tuple[str, ...]:
    """`level` and those below it in ISA_LEVELS, which a weight passes to when `level` has no row for it."""
    return ISA_LEVELS[ISA_LEVELS.index(level):]


def rows_for(format: str, dtype: str, activations: str, level: str,
             tuned: tuple[KernelRow, ...] = ()) -> list[KernelRow]:
    """The rows a weight of `format` in `dtype` tries, in order: with int8 activations, the rows that round x
    before the exact ones; within each, this machine's tuned rows, then TABLE's from `level` down."""
    ordered = []
    for wanted in ((INT8, EXACT) if activations == INT8 else (EXACT,)):
        ordered += [row for row in tuned if row.holds(format, dtype, wanted)]
        for each in levels_from(level):
            ordered += [row for row in TABLE if row.isa == each and row.holds(format, dtype, wanted)]
    return ordered


def int8_activations_from_environment() -> bool:
    """Whether $CANDELABRA_INT8_ACTIVATIONS lets kernels that round x to int8 serve: 1 yes, 0 or unset no."""
    text = os.environ.get(INT8_ACTIVATIONS_VARIABLE, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{INT8_ACTIVATIONS_VARIABLE}={text!r}: 1 lets kernels that round activations to int8 "
                         "serve (as llama.cpp multiplies), 0 or unset keeps every product exact to the dtype")
    return text == "1"


# a machine's tuned table


def tables_folder() -> Path:
    """$CANDELABRA_KERNEL_TABLES/torch-cpu, else the cache's kernels/torch-cpu."""
    from candelabra.core.weights.default_model import default_cache_dir

    root = os.environ.get("CANDELABRA_KERNEL_TABLES")
    return (Path(root).expanduser() if root else default_cache_dir() / "kernels") / "torch-cpu"


def machine_key(threads: int) -> dict[str, str]:
    """What a tuned table holds for: this CPU, its flags, this torch and the thread count."""
    import torch

    from candelabra.backends.torch.cpu.features import cpu_flags, cpu_model_name

    return {
        "cpu": cpu_model_name(),
        "flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": str(threads),
    }


def tuned_file(key: dict[str, str], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder or tables_folder()) / f"{key['threads']}-threads-{digest}.json"


def write_tuned(path: Path, key: dict[str, str], rows: list[KernelRow]) -> None:
    """Written to a temporary file and renamed, so a reader never sees half a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"key": key, "rows": [_row_json(row) for row in rows]}, indent=1))
    temporary.replace(path)


def read_tuned(path: Path) -> tuple[dict[str, str], tuple[KernelRow, ...]]:
    """The key and rows of a tuned table; a file that is not one is refused, naming what is wrong."""
    try:
        data = json.loads(path.read_text())
        rows = tuple(_row_from_json(row) for row in data["rows"])
        return {str(k): str(v) for k, v in data["key"].items()}, rows
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not a tuned kernel table ({type(error).__name__}: {error}); "
                         "`candelabra tune --backend torch` writes one") from error


def tuned_rows(threads: int, folder: Path | None = None) -> tuple[tuple[KernelRow, ...], str]:
    """This machine's tuned rows for `threads` threads, and where they came from (or why there are none). A
    table that is not one is logged and left out: serving goes on with TABLE."""
    key = machine_key(threads)
    path = tuned_file(key, folder)
    if not path.exists():
        return (), "no tuned table"
    try:
        found, rows = read_tuned(path)
    except ValueError as error:
        log.warning("%s: serving from the table in code", error)
        return (), f"{path} unreadable"
    if found != key:
        return (), f"{path} was tuned for another machine"
    return rows, str(path)


def _row_json(row: KernelRow) -> dict:
    return {"formats": sorted(row.formats), "dtypes": sorted(row.dtypes), "isa": row.isa,
            "activations": row.activations, "measured": row.measured,
            "choices": [{"form": c.form, "kernels": list(c.kernels)} for c in row.choices]}


def _row_from_json(data: dict) -> KernelRow:
    if data["activations"] not in (EXACT, INT8) or data["isa"] not in ISA_LEVELS:
        raise ValueError(f"activations {data['activations']!r}, isa {data['isa']!r}")
    choices = tuple(Choice(str(c["form"]), tuple(str(k) for k in c["kernels"])) for c in data["choices"])
    return KernelRow(frozenset(map(str, data["formats"])), frozenset(map(str, data["dtypes"])), data["isa"],
                     choices, str(data["measured"]), data["activations"])


def describe(level: str | None = None, threads: int | None = None) -> list[str]:
    """The rows this CPU reads, for `candelabra backends --kernels`: its tuned table's, then TABLE's from its
    level down."""
    from candelabra.backends.torch.cpu.features import usable_cores
    from candelabra.core.text_table import format_table

    level = level or isa_level()
    tuned, source = tuned_rows(threads or usable_cores())
    described = []
    for title, rows in ((f"tuned on this machine ({source})", tuned),
                        (f"in code, ISA level {level} and below", [r for r in TABLE if r.isa in levels_from(level)])):
        lines = [(" ".join(sorted(row.formats)), " ".join(sorted(row.dtypes)), row.isa, row.activations,
                  choice.form, " ".join(choice.kernels), row.measured)
                 for row in rows for choice in row.choices]
        if lines:
            described.append(f"{title}:\n" + format_table(
                ("formats", "dtypes", "isa", "x", "form", f"kernels at {ROW_BANDS} rows", "measured"), lines))
    return described
