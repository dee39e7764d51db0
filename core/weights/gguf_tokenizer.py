"""What a GGUF file's tokenizer is made of, and a digest that names it whatever file holds it.

transformers builds a GGUF's tokenizer from the `tokenizer.*` metadata (model, pre-tokenizer,
tokens, scores, token types, merges, special token ids and flags, chat templates) and picks the
tokenizer's class from the architecture (`general.architecture`, and `general.name` for files
that say llama but hold Mistral). The digest covers exactly those entries, as stored, so two
files with the same tokenizer (two quantizations of one model) get the same digest and a file
touched or downloaded again keeps it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from candelabra.core.weights.gguf_file import GGUFFile

ARCHITECTURE_KEYS = ("general.architecture", "general.name")


def is_tokenizer_metadata(key: str) -> bool:
    return key.startswith("tokenizer.") or key in ARCHITECTURE_KEYS


def tokenizer_digest(path: str | Path) -> str:
    """A hex SHA-256 of the metadata the file's tokenizer is built from (CheckpointError if the
    file cannot be read)."""
    gguf = GGUFFile(path)
    try:
        digest = hashlib.sha256()
        # Each entry is stored with its key's length, its type and its value's length, so joined
        # entries cannot run into each other; sorting makes the order of the file's entries not matter.
        for key in sorted(filter(is_tokenizer_metadata, gguf.metadata)):
            digest.update(gguf.metadata_entry(key))
        return digest.hexdigest()
    finally:
        gguf.close()
