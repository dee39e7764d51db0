"""The GEMV kernels' tiling for each weight shape on a GPU model, as measured there: for the int4 GEMV
(bench/cuda_int4_tiles.py, or the backend at start-up) and for the 16-bit one (at start-up, against
cuBLAS, which a dense table may name instead). This package's tables hold the GPUs we have measured; the
ones a user's runs saved win. A table holds, per [N, K], the tiling that streamed the weight fastest at
one row, among several copies of the weight together past the L2 cache, as a step's layers are."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from candelabra.backends.cuda.kernels.split_k import splittable

log = logging.getLogger("candelabra")

PACKAGE_TABLES = Path(__file__).resolve().parent / "gemv_tables"
FIELDS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
# Per kind of weight: its tables' file suffix, the key of their entries and the shallowest step along K.
KINDS = {"int4": ("", "gemv", 32), "dense": (".dense", "dense_gemv", 8)}
# A dense table's entry for a shape where cuBLAS was faster than every GEMV tiling: None in the tables.
CUBLAS = "cublas"


@dataclass(frozen=True)
class GemvTiling:
    """A GEMV launch's tiling, the int4 kernel's (int4_matmul.TileConfig at block_m 1) or the 16-bit one's
    (dense_gemv); num_stages 2 loads each step's weight ahead of the step before's math, 1 does not."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def user_tables() -> Path:
    """$CANDELABRA_KERNEL_TABLES/cuda, else the cache's kernels/cuda."""
    from candelabra.core.weights.default_model import default_cache_dir

    root = os.environ.get("CANDELABRA_KERNEL_TABLES")
    return (Path(root).expanduser() if root else default_cache_dir() / "kernels") / "cuda"


def table_file(folder: Path, device_name: str, kind: str = "int4") -> Path:
    """The `kind` table of `device_name` (torch.cuda.get_device_name's) in `folder`."""
    return folder / f"{re.sub(r'[^a-z0-9]+', '-', device_name.lower()).strip('-')}{KINDS[kind][0]}.json"


def read_table(path: Path, kind: str = "int4") -> dict[tuple[int, int], GemvTiling | None]:
    """The tilings of a `kind` table file by [N, K] (None: cuBLAS, in a dense table); a file that is not
    one is refused, naming what is wrong."""
    entries_key = KINDS[kind][1]
    try:
        table = json.loads(path.read_text())
        tilings = {}
        for entry in table[entries_key]:
            shape = (int(entry["columns"]), int(entry["width"]))
            if kind == "dense" and entry.get("kernel") == CUBLAS:
                tilings[shape] = None
                continue
            tiling = GemvTiling(*(int(entry[field]) for field in FIELDS))
            _check(tiling, shape, kind)
            tilings[shape] = tiling
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a table of {kind} GEMV tilings ({type(error).__name__}: {error}); "
                         f"{'bench/cuda_int4_tiles.py --save-table or ' if kind == 'int4' else ''}"
                         f"the backend's measurement at start-up writes one") from error
    return tilings


def _check(tiling: GemvTiling, shape: tuple[int, int], kind: str) -> None:
    columns, width = shape
    powers = (tiling.block_n, tiling.block_k, tiling.num_warps)
    shallowest = KINDS[kind][2]
    if min(shape) < 1 or any(p < 1 or p & (p - 1) for p in powers) or tiling.block_k < shallowest:
        raise ValueError(f"[{columns}, {width}]: shape, block_n, block_k (at least {shallowest}) and num_warps "
                         f"must be positive, the three powers of two")
    if width % tiling.block_k or not splittable(width // tiling.block_k, tiling.split_k):
        raise ValueError(f"[{columns}, {width}]: block_k {tiling.block_k} must divide K into steps, and split_k "
                         f"{tiling.split_k} split them with a step for each split")
    if tiling.num_stages not in (1, 2):
        raise ValueError(f"[{columns}, {width}]: num_stages is 1 or 2, not {tiling.num_stages}")


def write_table(path: Path, device_name: str, tilings: dict[tuple[int, int], GemvTiling | None], source: str,
                kind: str = "int4") -> None:
    """Writes `tilings` as `device_name`'s `kind` table, saying in `source` how they were measured."""
    entries = []
    for (columns, width), tiling in sorted(tilings.items()):
        if tiling is None and kind == "dense":
            entries.append({"columns": columns, "width": width, "kernel": CUBLAS})
            continue
        if tiling is None:
            raise ValueError(f"[{columns}, {width}]: an {kind} table names a tiling for every shape")
        _check(tiling, (columns, width), kind)
        entries.append({"columns": columns, "width": width, **{field: getattr(tiling, field) for field in FIELDS}})
    path.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all, for a reader in another process (the other ranks of a tensor-parallel model)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({"device": device_name, "measured": source, KINDS[kind][1]: entries},
                                  indent=1) + "\n")
    os.replace(partial, path)
    measured_tilings.cache_clear()


def save_measured(device_name: str, measured: dict[tuple[int, int], GemvTiling | None], source: str,
                  kind: str = "int4", path: Path | None = None) -> tuple[Path, dict]:
    """`measured` added to `device_name`'s `kind` table at `path` (default: the user's, where the backend
    looks), over what that table held; the path and the whole table written."""
    if path is None:
        path = table_file(user_tables(), device_name, kind)
        held = users_table(device_name, kind)
    else:
        held = read_table(path, kind) if path.is_file() else {}
    tilings = {**held, **measured}
    write_table(path, device_name, tilings, source, kind)
    return path, tilings


@cache
def measured_tilings(device_name: str, kind: str = "int4") -> dict[tuple[int, int], GemvTiling | None]:
    """The package's `kind` table for `device_name` updated by the user's, each where it exists. A user's
    table that does not read is passed over, with a warning: the shapes it held are measured again."""
    path = table_file(PACKAGE_TABLES, device_name, kind)
    tilings = read_table(path, kind) if path.is_file() else {}
    return {**tilings, **users_table(device_name, kind)}


def users_table(device_name: str, kind: str = "int4") -> dict[tuple[int, int], GemvTiling | None]:
    """The user's `kind` table for `device_name`: empty where there is none, or where it does not read
    (warned)."""
    path = table_file(user_tables(), device_name, kind)
    if not path.is_file():
        return {}
    try:
        return read_table(path, kind)
    except ValueError as error:
        log.warning("%s; passed over, and written anew once its shapes are measured again", error)
        return {}
