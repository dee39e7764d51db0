"""Open whichever checkpoint the command line names, as candle-vllm's flags do:
`--weight-path` a folder (safetensors, or one .gguf), `--weight-file` a file in it (or on its own),
`--model-id` (with `--revision`) a model in the local Hugging Face cache. `--load-format dummy`
reads only the config.json there and draws random weights in its shapes. `--isq FORMAT` quantizes a
dense checkpoint's linear weights as they load (see `in_situ`)."""

from __future__ import annotations

from pathlib import Path

from candelabra.core.loading.in_situ import InSituQuantized
from candelabra.core.loading.quant_flag import check_quant
from candelabra.core.weights import Checkpoint, CheckpointError
from candelabra.core.weights.default_model import default_model_path
from candelabra.core.weights.hf_cache import resolve_snapshot
from candelabra.core.weights.safetensors import SafetensorsCheckpoint, is_safetensors_folder

USAGE = "pass --weight-path FOLDER, --weight-file FILE or --model-id ORG/NAME"
# auto: the weights the path holds; dummy: random weights shaped by its config.json.
LOAD_FORMATS = ("auto", "dummy")


def open_checkpoint(
    weight_path: str | Path | None = None,
    weight_file: str | None = None,
    model_id: str | None = None,
    revision: str | None = None,
    load_format: str = "auto",
    dummy_quantization: str | None = None,
) -> Checkpoint:
    """The checkpoint the flags name; CheckpointError saying what to pass when they name none.
    With `load_format` "dummy", random weights (quantized in `dummy_quantization`, a GGUF format,
    if given) shaped by the config.json there."""
    check_load_format(load_format, dummy_quantization)
    path = checkpoint_path(weight_path, weight_file, model_id, revision)
    if load_format == "dummy":
        from candelabra.core.loading.dummy import DummyCheckpoint

        return DummyCheckpoint(path, quantization=dummy_quantization)
    return open_path(path)


def check_load_format(load_format: str, dummy_quantization: str | None) -> None:
    """ValueError in one line for an unknown format, or a quantization without dummy weights."""
    from candelabra.core.loading.dummy import check_dummy_quantization

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format} is unknown; choose one of {', '.join(LOAD_FORMATS)}")
    if dummy_quantization is not None and load_format != "dummy":
        raise ValueError(f"--dummy-quantization {dummy_quantization} applies to --load-format dummy only")
    check_dummy_quantization(dummy_quantization)


def checkpoint_path(
    weight_path: str | Path | None, weight_file: str | None, model_id: str | None, revision: str | None
) -> Path:
    if weight_path is not None and model_id is not None:
        raise CheckpointError(f"--weight-path {weight_path}", f"given with --model-id {model_id}; pass one, not both")
    if revision is not None and model_id is None:
        raise CheckpointError(f"--revision {revision}", "applies to --model-id only; pass --model-id ORG/NAME with it")
    if weight_path is not None:
        root: Path | None = Path(weight_path).expanduser()
    elif model_id is not None:
        root = resolve_snapshot(model_id, revision)
    else:
        root = None
    if weight_file is None:
        if root is None:
            raise CheckpointError("no checkpoint given", USAGE)
        return root
    file = Path(weight_file).expanduser()
    return file if root is None or file.is_absolute() else root / file


def open_path(path: Path) -> Checkpoint:
    if not path.exists():
        raise CheckpointError(path, f"does not exist; {USAGE}")
    if path.is_file():
        return open_file(path)
    if is_safetensors_folder(path):
        return SafetensorsCheckpoint(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return open_file(ggufs[0])
    if ggufs:
        names = ", ".join(gguf.name for gguf in ggufs)
        raise CheckpointError(path, f"holds several GGUF files ({names}); choose one with --weight-file NAME")
    raise CheckpointError(
        path,
        "holds neither model.safetensors, model.safetensors.index.json nor a .gguf file; "
        "pass a Hugging Face model folder or a GGUF file",
    )


def open_file(path: Path) -> Checkpoint:
    if path.suffix == ".gguf":
        from candelabra.core.weights.gguf import GGUFCheckpoint

        return GGUFCheckpoint(path)
    if path.suffix == ".safetensors":
        return SafetensorsCheckpoint(path)
    raise CheckpointError(path, "is neither a .safetensors nor a .gguf file; pass a model folder or one of those")


def open_model(model: str | Path | None = None, model_id: str | None = None, weight_file: str | None = None,
               revision: str | None = None, load_format: str = "auto", dummy_quantization: str | None = None,
               quant: str | None = None, isq: str | None = None) -> Checkpoint:
    """The checkpoint `model` (a folder or a file) or the flags name; the default model when none is named.
    `load_format` "dummy" draws random weights shaped by the config.json there (see DummyCheckpoint).
    `quant` (--quant gptq, awq, marlin or gguf) must name the checkpoint's own quantization where given
    (see `quant_flag`). With `isq` (a GGML format, "q4k" or "Q4_K"), its linear weights quantized to it
    as they load (CheckpointError for a checkpoint quantized already)."""
    checkpoint = _open_model(model, model_id, weight_file, revision, load_format, dummy_quantization)
    try:
        check_quant(quant, checkpoint)
        return checkpoint if isq is None else InSituQuantized(checkpoint, isq)
    except BaseException:
        checkpoint.close()
        raise


def _open_model(model: str | Path | None, model_id: str | None, weight_file: str | None, revision: str | None,
                load_format: str, dummy_quantization: str | None) -> Checkpoint:
    check_load_format(load_format, dummy_quantization)
    formats = {"load_format": load_format, "dummy_quantization": dummy_quantization}
    if model is None and model_id is None and weight_file is None:
        if load_format == "dummy":
            raise CheckpointError("--load-format dummy", "needs a config.json to shape the weights; pass "
                                  "--weight-path FOLDER (holding config.json) or --model-id ORG/NAME")
        model = default_model_path()
    path = Path(model) if model is not None else None
    if path is not None and path.is_file() and weight_file is None:
        return open_checkpoint(weight_path=path.parent, weight_file=path.name, **formats)
    return open_checkpoint(weight_path=path, weight_file=weight_file, model_id=model_id, revision=revision, **formats)
