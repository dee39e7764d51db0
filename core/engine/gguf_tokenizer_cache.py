"""GGUF tokenizers converted once and kept in candelabra's cache, one folder per tokenizer.

Building a tokenizer from a GGUF's vocabulary takes transformers tens of seconds for a 150k
vocabulary, so the result is saved as <cache>/tokenizers/gguf-<key>. The key digests what the
conversion reads (gguf_tokenizer.tokenizer_digest) and the transformers version that converts
it, never the file's path or time: files holding the same tokenizer share one folder, and a file
touched or downloaded again finds its tokenizer.

Which folder each file last used is noted in <cache>/tokenizers/gguf-sources/, one small file per
path. When a file's tokenizer changes, its old folder goes unless another existing file still
uses it, and so do the folders the earlier scheme kept for the same file name, one per size and
modification time ("<name>-<size>-<mtime_ns>"), so the cache does not grow with each download.

Other processes may use the cache at the same time: a folder is written under a temporary name
and renamed into place, and removed by renaming it away first, so a folder under an entry's name
is always whole; a process that loses the folder while reading it builds the tokenizer again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from candelabra.core.weights.default_model import default_cache_dir
from candelabra.core.weights.gguf_tokenizer import tokenizer_digest

log = logging.getLogger("candelabra")

FORMAT = 1  # bump when what an entry holds changes, so older entries are not reused
ENTRY = re.compile(r"gguf-[0-9a-f]{32}")
SOURCES = "gguf-sources"


def cached_gguf_tokenizer(gguf: Path, build: Callable[[], object], load: Callable[[Path], object]):
    """The tokenizer of the GGUF file `gguf`: `load(folder)` of its cache entry, or `build()`
    saved as the entry when there is none."""
    import transformers

    root = default_cache_dir() / "tokenizers"
    key = hashlib.sha256(f"{FORMAT} {transformers.__version__} {tokenizer_digest(gguf)}".encode()).hexdigest()
    entry = root / f"gguf-{key[:32]}"
    tokenizer = _load(entry, load)
    if tokenizer is None:
        log.info("building the tokenizer from %s's vocabulary: on first start only, this takes a while; it is then "
                 "kept in %s", gguf.name, root)
        started = time.perf_counter()
        tokenizer = build()
        log.info("tokenizer built in %.1f s", time.perf_counter() - started)
        _save(tokenizer, entry)
    _note_source(root, gguf, entry.name)
    return tokenizer


def _load(entry: Path, load: Callable[[Path], object]):
    if not (entry / "tokenizer_config.json").is_file():
        return None
    try:
        return load(entry)
    except (OSError, ValueError) as exc:  # removed by another process while read, or damaged
        log.info("the cached tokenizer %s cannot be read (%s); building it again", entry, exc)
        _remove(entry)
        return None


def _save(tokenizer, entry: Path) -> None:
    partial = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(entry)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not entry.exists():
            raise
        # else another process got there first


@dataclass(frozen=True)
class SourceNote:
    """A file's note in gguf-sources: the entry it used when last loaded."""

    source: str  # the GGUF file's resolved path
    entry: str  # the name of the entry's folder

    @classmethod
    def read(cls, path: Path) -> SourceNote | None:
        """The note in `path`, None if there is none or it is not one."""
        try:
            fields = json.loads(path.read_text())
            note = cls(**fields) if isinstance(fields, dict) else None
        except (OSError, ValueError, TypeError):
            return None
        valid = note is not None and isinstance(note.source, str) and isinstance(note.entry, str)
        return note if valid and ENTRY.fullmatch(note.entry) else None

    def write(self, path: Path) -> None:
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        partial.write_text(json.dumps(asdict(self)))
        partial.replace(path)


def _note_source(root: Path, gguf: Path, entry_name: str) -> None:
    """Note that `gguf` uses `entry_name`, and remove the entries that replaces for it."""
    sources = root / SOURCES
    source = str(gguf.resolve())
    path = sources / hashlib.sha256(source.encode()).hexdigest()[:32]
    previous = SourceNote.read(path)
    if previous is None or previous.entry != entry_name:
        sources.mkdir(parents=True, exist_ok=True)
        SourceNote(source, entry_name).write(path)
        if previous is not None and not _in_use(sources, previous.entry):
            _remove(root / previous.entry)
    earlier_scheme = re.compile(re.escape(gguf.name) + r"-\d+-\d+")
    for folder in root.iterdir():
        if earlier_scheme.fullmatch(folder.name):
            _remove(folder)


def _in_use(sources: Path, entry_name: str) -> bool:
    """Whether a file that still exists was using `entry_name` when last loaded."""
    notes = (SourceNote.read(path) for path in sources.iterdir())
    return any(note is not None and note.entry == entry_name and Path(note.source).is_file() for note in notes)


def _remove(folder: Path) -> None:
    doomed = folder.with_name(f"{folder.name}.removed-{os.getpid()}")
    try:
        folder.rename(doomed)
    except OSError:  # gone already, or not ours to remove: either way it is not worth failing a load for
        return
    shutil.rmtree(doomed, ignore_errors=True)
