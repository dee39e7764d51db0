"""The int4 GEMV's tiling for each weight shape on a GPU model, as bench/cuda_int4_tiles.py measured it
there: this package's tables for the GPUs we have measured, and the ones a user's own run saved
(`--save-table`), which win. A table holds, per [N, K], the tiling that streamed the weight fastest at
one row, among several copies of the weight together past the L2 cache, as a step's layers are."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger("candelabra")

PACKAGE_TABLES = Path(__file__).resolve().parent / "gemv_tables"
FIELDS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")


@dataclass(frozen=True)
class GemvTiling:
    """A GEMV launch's tiling (int4_matmul.TileConfig at block_m 1); num_stages 2 loads each step's weight
    ahead of the step before's math, 1 does not."""

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


def table_file(folder: Path, device_name: str) -> Path:
    """The table of `device_name` (torch.cuda.get_device_name's) in `folder`."""
    return folder / f"{re.sub(r'[^a-z0-9]+', '-', device_name.lower()).strip('-')}.json"


def read_table(path: Path) -> dict[tuple[int, int], GemvTiling]:
    """The tilings of a table file by [N, K]; a file that is not one is refused, naming what is wrong."""
    try:
        table = json.loads(path.read_text())
        entries = table["gemv"]
        tilings = {}
        for entry in entries:
            shape = (int(entry["columns"]), int(entry["width"]))
            tiling = GemvTiling(*(int(entry[field]) for field in FIELDS))
            _check(tiling, shape)
            tilings[shape] = tiling
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a table of int4 GEMV tilings ({type(error).__name__}: {error}); "
                         f"bench/cuda_int4_tiles.py --save-table writes one") from error
    return tilings


def _check(tiling: GemvTiling, shape: tuple[int, int]) -> None:
    columns, width = shape
    powers = (tiling.block_n, tiling.block_k, tiling.num_warps)
    if min(shape) < 1 or any(p < 1 or p & (p - 1) for p in powers) or tiling.block_k < 32:
        raise ValueError(f"[{columns}, {width}]: shape, block_n, block_k (at least 32) and num_warps must be "
                         f"positive, the three powers of two")
    if width % tiling.block_k or (width // tiling.block_k) % tiling.split_k or tiling.split_k < 1:
        raise ValueError(f"[{columns}, {width}]: block_k {tiling.block_k} and split_k {tiling.split_k} must "
                         f"divide K into whole steps per split")
    if tiling.num_stages not in (1, 2):
        raise ValueError(f"[{columns}, {width}]: num_stages is 1 or 2, not {tiling.num_stages}")


def write_table(path: Path, device_name: str, tilings: dict[tuple[int, int], GemvTiling], source: str) -> None:
    """Writes `tilings` as `device_name`'s table, saying in `source` how they were measured."""
    for shape, tiling in tilings.items():
        _check(tiling, shape)
    entries = [{"columns": columns, "width": width, **{field: getattr(tiling, field) for field in FIELDS}}
               for (columns, width), tiling in sorted(tilings.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all, for a reader in another process (the other ranks of a tensor-parallel model)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({"device": device_name, "measured": source, "gemv": entries}, indent=1) + "\n")
    os.replace(partial, path)
    measured_tilings.cache_clear()


@cache
def measured_tilings(device_name: str) -> dict[tuple[int, int], GemvTiling]:
    """The package's table for `device_name` updated by the user's, each where it exists. A user's table
    that does not read is passed over, with a warning: the shapes it held are measured again."""
    path = table_file(PACKAGE_TABLES, device_name)
    tilings = read_table(path) if path.is_file() else {}
    return {**tilings, **users_table(device_name)}


def users_table(device_name: str) -> dict[tuple[int, int], GemvTiling]:
    """The user's table for `device_name`: empty where there is none, or where it does not read (warned)."""
    path = table_file(user_tables(), device_name)
    if not path.is_file():
        return {}
    try:
        return read_table(path)
    except ValueError as error:
        log.warning("%s; passed over, and written anew once its shapes are measured again", error)
        return {}
