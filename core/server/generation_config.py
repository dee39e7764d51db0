"""The sampling defaults a checkpoint recommends, from the generation_config.json beside its
config.json (Qwen2.5, for one, asks for temperature 0.7, top_p 0.8, top_k 20)."""

from __future__ import annotations

import json

from candelabra.core.weights import Checkpoint, CheckpointError

SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def recommended_sampling(checkpoint: Checkpoint) -> dict[str, float | int]:
    """The sampling keys set in the checkpoint's generation_config.json; {} when it has none."""
    path = checkpoint.path
    if path.suffix == ".gguf":
        return {}
    file = (path if path.is_dir() else path.parent) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(file, f"cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(file, "does not hold a JSON object")
    found = {}
    for key, kind in SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(file, f"{key} must be a number, got {value!r}")
        found[key] = kind(value)
    return found
