"""Resolving --model-id from a hand-built local Hugging Face cache, and open_checkpoint's dispatch
between safetensors folders, GGUF files and the cache, with its errors."""

import json
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from candelabra.core.loading.open import open_checkpoint
from candelabra.core.weights.hf_cache import hub_cache_dir, resolve_snapshot
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from support import one_line_checkpoint_error

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
MODEL_ID = "tiny-org/tiny-llama"


def save_tiny_llama(folder):
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model.state_dict()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A cache holding MODEL_ID at main (a saved tiny Llama) and at tag v1 (an older, empty commit)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--tiny-org--tiny-llama"
    save_tiny_llama(repo / "snapshots" / COMMIT)
    (repo / "snapshots" / OLD_COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(OLD_COMMIT + "\n")
    return cache


@pytest.fixture
def cache_env(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache



def test_cache_dir_follows_hugging_face_environment(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_resolves_main_branch_tag_and_commit(cache_env):
    repo = cache_env / "models--tiny-org--tiny-llama"
    assert resolve_snapshot(MODEL_ID) == repo / "snapshots" / COMMIT
    assert resolve_snapshot(MODEL_ID, "main") == repo / "snapshots" / COMMIT
    assert resolve_snapshot(MODEL_ID, "v1") == repo / "snapshots" / OLD_COMMIT
    assert resolve_snapshot(MODEL_ID, OLD_COMMIT) == repo / "snapshots" / OLD_COMMIT


def test_resolves_through_hf_home(hub_cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "hub").symlink_to(hub_cache)
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_snapshot(MODEL_ID).name == COMMIT


def test_missing_model_says_where_it_looked_and_how_to_fetch(cache_env):
    message = one_line_checkpoint_error(
        lambda: resolve_snapshot("other-org/absent-model"),
        "other-org/absent-model",
        str(cache_env / "models--other-org--absent-model"),
        "hf download other-org/absent-model",
        "HF_HUB_CACHE",
        "--weight-path",
    )
    assert message.startswith("other-org/absent-model: ")


def test_missing_revision_lists_cached_refs(cache_env):
    one_line_checkpoint_error(lambda: resolve_snapshot(MODEL_ID, "v2"), MODEL_ID, "'v2'", "main, v1")
    one_line_checkpoint_error(lambda: resolve_snapshot(MODEL_ID, "/etc/hostname"), MODEL_ID, "'/etc/hostname'")
    one_line_checkpoint_error(lambda: resolve_snapshot(MODEL_ID, "../refs/main"), MODEL_ID, "'../refs/main'")


def test_ref_to_a_missing_snapshot(cache_env, tmp_path):
    repo = tmp_path / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    one_line_checkpoint_error(lambda: resolve_snapshot(MODEL_ID, cache_dir=tmp_path), COMMIT, "missing")


@pytest.mark.parametrize("model_id", ["", "a/b/c", "../etc", "/abs/path", "org/na me"])
def test_a_malformed_model_id_is_refused_as_not_a_hugging_face_model_id(cache_env, model_id):
    one_line_checkpoint_error(lambda: resolve_snapshot(model_id), "not a Hugging Face model id")


def test_open_checkpoint_from_the_cache(cache_env):
    with open_checkpoint(model_id=MODEL_ID) as checkpoint:
        assert isinstance(checkpoint, SafetensorsCheckpoint)
        assert checkpoint.folder.name == COMMIT
        assert "model.layers.1.mlp.down_proj.weight" in checkpoint.tensor_names()
        assert checkpoint.config["num_hidden_layers"] == 2


def test_open_checkpoint_from_the_cache_at_a_revision_without_weights(cache_env):
    one_line_checkpoint_error(lambda: open_checkpoint(model_id=MODEL_ID, revision="v1"), OLD_COMMIT, "neither")


def write_tiny_safetensors_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    data = np.array([1.5, -2], dtype="<f4").tobytes()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    return folder


def test_open_checkpoint_safetensors_folder_file_and_weight_file(tmp_path):
    folder = write_tiny_safetensors_folder(tmp_path / "model")
    for arguments in (
        {"weight_path": folder},
        {"weight_path": str(folder)},
        {"weight_path": folder / "model.safetensors"},
        {"weight_path": folder, "weight_file": "model.safetensors"},
        {"weight_file": str(folder / "model.safetensors")},
    ):
        with open_checkpoint(**arguments) as checkpoint:
            assert isinstance(checkpoint, SafetensorsCheckpoint), arguments
            np.testing.assert_array_equal(checkpoint.load("w"), [1.5, -2])


class FakeGGUFCheckpoint:
    def __init__(self, path):
        self.path = path


@pytest.fixture
def fake_gguf(monkeypatch):
    """Stands in for candelabra.core.weights.gguf, so dispatch is tested whatever that module holds."""
    module = types.ModuleType("candelabra.core.weights.gguf")
    module.GGUFCheckpoint = FakeGGUFCheckpoint
    monkeypatch.setitem(sys.modules, "candelabra.core.weights.gguf", module)


def test_open_checkpoint_dispatches_gguf(tmp_path, fake_gguf, cache_env):
    (tmp_path / "model-q4.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("")
    for arguments in (
        {"weight_path": tmp_path},
        {"weight_path": tmp_path / "model-q4.gguf"},
        {"weight_path": tmp_path, "weight_file": "model-q4.gguf"},
        {"weight_file": str(tmp_path / "model-q4.gguf")},
    ):
        checkpoint = open_checkpoint(**arguments)
        assert isinstance(checkpoint, FakeGGUFCheckpoint), arguments
        assert checkpoint.path == tmp_path / "model-q4.gguf"
    snapshot = cache_env / "models--tiny-org--tiny-llama" / "snapshots" / OLD_COMMIT
    (snapshot / "model.gguf").write_bytes(b"GGUF")
    try:
        checkpoint = open_checkpoint(model_id=MODEL_ID, revision="v1", weight_file="model.gguf")
        assert checkpoint.path == snapshot / "model.gguf"
    finally:
        (snapshot / "model.gguf").unlink()


def test_several_gguf_files_need_weight_file(tmp_path, fake_gguf):
    for name in ("model-q4.gguf", "model-q8.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    one_line_checkpoint_error(lambda: open_checkpoint(tmp_path), "model-q4.gguf, model-q8.gguf", "--weight-file")
    assert open_checkpoint(tmp_path, "model-q8.gguf").path == tmp_path / "model-q8.gguf"


def test_open_checkpoint_explains_each_missing_unusable_or_conflicting_argument_in_one_line(tmp_path, cache_env):
    usage = "--weight-path FOLDER, --weight-file FILE or --model-id ORG/NAME"
    one_line_checkpoint_error(lambda: open_checkpoint(), "no checkpoint given", usage)
    one_line_checkpoint_error(lambda: open_checkpoint(tmp_path / "nowhere"), "nowhere", "does not exist")
    one_line_checkpoint_error(lambda: open_checkpoint(tmp_path, "nowhere.gguf"), "nowhere.gguf", "does not exist")
    one_line_checkpoint_error(lambda: open_checkpoint(tmp_path), str(tmp_path), "neither", ".gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    one_line_checkpoint_error(lambda: open_checkpoint(tmp_path / "weights.bin"), "weights.bin",
                              "neither a .safetensors nor")
    one_line_checkpoint_error(lambda: open_checkpoint(tmp_path, model_id=MODEL_ID), "--weight-path", "not both")
    one_line_checkpoint_error(lambda: open_checkpoint(tmp_path, revision="v1"), "--revision v1", "--model-id")
    one_line_checkpoint_error(lambda: open_checkpoint(model_id="absent/model"), "absent/model", "hf download")
