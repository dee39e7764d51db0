"""Find a model in the local Hugging Face hub cache, without network.

The cache holds one folder per repository, `models--{org}--{name}`, with `refs/{revision}` files
naming a commit and `snapshots/{commit}/` folders holding that commit's files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from candelabra.core.weights import CheckpointError

COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
MODEL_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def hub_cache_dir() -> Path:
    """The cache folder huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        home = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def repo_folder(model_id: str, cache_dir: Path) -> Path:
    return cache_dir / ("models--" + model_id.replace("/", "--"))


def resolve_snapshot(model_id: str, revision: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """The snapshot folder of `model_id` at `revision` (a branch, tag or commit; default main)."""
    if not MODEL_ID.fullmatch(model_id) or ".." in model_id:
        problem = "is not a Hugging Face model id; expected org/name (e.g. Qwen/Qwen2.5-0.5B), or --weight-path FOLDER"
        raise CheckpointError(model_id, problem)
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    revision = revision or "main"
    repo = repo_folder(model_id, cache)
    if not repo.is_dir():
        raise CheckpointError(
            model_id, f"is not in the local Hugging Face cache (looked for {repo}); {how_to_fetch(model_id)}"
        )
    commit = read_ref(repo, revision)
    if commit is None:
        known = ", ".join(sorted(cached_refs(repo))) or "none"
        raise CheckpointError(
            model_id,
            f"has no revision {revision!r} in the cache at {repo} (cached refs: {known}); {how_to_fetch(model_id)}",
        )
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise CheckpointError(
            model_id, f"revision {revision!r} points to {commit}, but {snapshot} is missing; {how_to_fetch(model_id)}"
        )
    return snapshot


def read_ref(repo: Path, revision: str) -> str | None:
    """The commit a branch or tag names, or the revision itself when it is a cached commit."""
    ref = repo / "refs" / revision
    if ".." not in revision and not Path(revision).is_absolute() and ref.is_file():
        return ref.read_text(encoding="utf-8").strip()
    if COMMIT_HASH.fullmatch(revision) and (repo / "snapshots" / revision).is_dir():
        return revision
    return None


def cached_refs(repo: Path) -> list[str]:
    refs = repo / "refs"
    return [ref.relative_to(refs).as_posix() for ref in refs.rglob("*") if ref.is_file()] if refs.is_dir() else []


def how_to_fetch(model_id: str) -> str:
    return (
        f"fetch it on a machine with network with `hf download {model_id}` (older huggingface_hub: "
        f"`huggingface-cli download {model_id}`) and copy the cache here, set HF_HUB_CACHE or HF_HOME to the cache "
        "that holds it, or pass --weight-path to a local model folder"
    )
