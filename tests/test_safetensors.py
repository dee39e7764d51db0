"""Safetensors checkpoints: tiny transformers models load exactly as saved, and every malformed
file or folder gives one CheckpointError line naming the file, at once."""

import json
import re
import struct

import numpy as np
import pytest

from candelabra.core.weights import CheckpointError
from candelabra.core.weights.safetensors import SafetensorsCheckpoint
from support import mapped_resident_kib, needs_smaps, one_line_checkpoint_error, peak_allocation

CONFIG = {"model_type": "llama", "hidden_size": 4}


def save_tiny_llama(folder, dtype_name="float32", **save_options):
    """A random 2-layer Llama saved by transformers; returns its state_dict."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype_name))
    model.save_pretrained(folder, **save_options)
    return model.state_dict()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "single": (root / "single", save_tiny_llama(root / "single")),
        "sharded": (root / "sharded", save_tiny_llama(root / "sharded", max_shard_size="20KB")),
        "bfloat16": (root / "bfloat16", save_tiny_llama(root / "bfloat16", "bfloat16")),
        "bfloat16-sharded": (
            root / "bfloat16-sharded",
            save_tiny_llama(root / "bfloat16-sharded", "bfloat16", max_shard_size="20KB"),
        ),
    }


@pytest.mark.parametrize("kind", ["single", "sharded", "bfloat16", "bfloat16-sharded"])
def test_tiny_model_loads_as_saved(tiny_models, kind):
    folder, state_dict = tiny_models[kind]
    with SafetensorsCheckpoint(folder) as checkpoint:
        assert checkpoint.config == json.loads((folder / "config.json").read_text())
        assert sorted(checkpoint.tensor_names()) == sorted(state_dict)
        for name, tensor in state_dict.items():
            assert checkpoint.tensor_shape(name) == tuple(tensor.shape)
            loaded = checkpoint.load(name)
            assert loaded.dtype == np.float32
            np.testing.assert_array_equal(loaded, tensor.float().numpy(), err_msg=name)
        assert checkpoint.tokenizer_files() == {"pretrained_model_name_or_path": str(folder)}


@needs_smaps
def test_released_pages_leave_resident_memory_and_load_again(tiny_models):
    folder, state_dict = tiny_models["sharded"]
    shards = sorted(folder.resolve().glob("*.safetensors"))
    with SafetensorsCheckpoint(folder) as checkpoint:
        for name in state_dict:
            checkpoint.load(name)
        assert all(mapped_resident_kib(shard) > 0 for shard in shards)
        checkpoint.release_pages()
        assert sum(mapped_resident_kib(shard) for shard in shards) == 0
        for name, tensor in state_dict.items():
            np.testing.assert_array_equal(checkpoint.load(name), tensor.float().numpy(), err_msg=name)


def test_sharded_model_really_has_an_index_and_shards(tiny_models):
    folder, _ = tiny_models["sharded"]
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1


def test_single_file_path_uses_its_folder_config(tiny_models):
    folder, state_dict = tiny_models["bfloat16"]
    with SafetensorsCheckpoint(folder / "model.safetensors") as checkpoint:
        assert checkpoint.config["hidden_size"] == 64
        assert set(checkpoint.tensor_names()) == set(state_dict)
        assert checkpoint.tokenizer_files() == {"pretrained_model_name_or_path": str(folder)}


def test_unknown_tensor_is_a_key_error_naming_it_and_the_file(tiny_models):
    folder, _ = tiny_models["single"]
    with SafetensorsCheckpoint(folder) as checkpoint, pytest.raises(KeyError, match="no_such.weight") as info:
        checkpoint.load("no_such.weight")
    assert str(folder) in str(info.value)


def safetensors_bytes(header, data=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def model_folder(tmp_path, content: bytes, name="model.safetensors"):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / name).write_bytes(content)
    return tmp_path


def test_hand_made_dtypes_convert_to_float32(tmp_path):
    bf16_bits = np.array([0x3F80, 0xC020, 0x7F80, 0x0001], dtype="<u2")  # 1.0, -2.5, inf, tiny subnormal
    tensors = {
        "bf16": ("BF16", [2, 2], bf16_bits.tobytes()),
        "f16": ("F16", [3], np.array([0.5, -1, 65504], dtype="<f2").tobytes()),
        "f64": ("F64", [2], np.array([1.25, -3], dtype="<f8").tobytes()),
        "i64": ("I64", [2], np.array([7, -9], dtype="<i8").tobytes()),
        "flags": ("BOOL", [2], bytes([1, 0])),
        "empty": ("F32", [0, 4], b""),
    }
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    with SafetensorsCheckpoint(model_folder(tmp_path, safetensors_bytes(header, data))) as checkpoint:
        assert checkpoint.tensor_names() == list(tensors)
        expected_bf16 = (bf16_bits.astype(np.uint32) << 16).view(np.float32).reshape(2, 2)
        np.testing.assert_array_equal(checkpoint.load("bf16"), expected_bf16)
        assert checkpoint.load("bf16")[0, 1] == -2.5 and np.isinf(checkpoint.load("bf16")[1, 0])
        np.testing.assert_array_equal(checkpoint.load("f16"), [0.5, -1, 65504])
        np.testing.assert_array_equal(checkpoint.load("f64"), [1.25, -3])
        np.testing.assert_array_equal(checkpoint.load("i64"), [7, -9])
        np.testing.assert_array_equal(checkpoint.load("flags"), [1, 0])
        assert checkpoint.load("empty").shape == (0, 4)
        assert all(checkpoint.load(name).dtype == np.float32 for name in tensors)


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


MALFORMED_FILES = {
    "shorter than 8 bytes": (b"\x01\x02\x03", "too short"),
    "header longer than file": (struct.pack("<Q", 1000) + b"{}", "claims a 1000-byte header"),
    "absurd header length": (struct.pack("<Q", 2**62) + b"{}", "limit 100000000"),
    "header not json": (safetensors_bytes(b"{not json"), "not valid JSON"),
    "header not utf-8": (safetensors_bytes(b"\xff\xfe\xfd"), "not valid JSON"),
    "header not an object": (safetensors_bytes(b"[1, 2]"), "JSON list"),
    "entry not an object": (safetensors_bytes({"w": 3}), "'w' is not an object"),
    "unknown dtype": (
        safetensors_bytes({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, bytes(2)),
        "unknown dtype 'Q4'",
    ),
    "negative dimension": (safetensors_bytes({"w": f32([-1], 0, 4)}, bytes(4)), "non-negative"),
    "one data offset": (
        safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)),
        "data_offsets [0]",
    ),
    "size differs from span": (safetensors_bytes({"w": f32([2, 3], 0, 20)}, bytes(24)), "24 bytes"),
    "data beyond file end": (safetensors_bytes({"w": f32([2], 0, 8)}, bytes(4)), "truncated"),
    "offsets backwards": (safetensors_bytes({"w": f32([2], 8, 0)}, bytes(8)), "run backwards"),
    "tensors overlap": (
        safetensors_bytes({"a": f32([2], 0, 8), "b": f32([2], 4, 12)}, bytes(12)),
        "'a' and 'b' overlap",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED_FILES))
def test_malformed_file_is_one_line_error_naming_it(tmp_path, case):
    content, problem = MALFORMED_FILES[case]
    folder = model_folder(tmp_path, content)
    with peak_allocation(4 << 20), pytest.raises(CheckpointError, match=re.escape(problem)) as info:
        SafetensorsCheckpoint(folder)
    assert "\n" not in str(info.value)
    assert str(folder / "model.safetensors") in str(info.value)


def test_fp8_tensor_opens_but_load_says_it_is_unsupported(tmp_path):
    header = {"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}
    with SafetensorsCheckpoint(model_folder(tmp_path, safetensors_bytes(header, bytes(4)))) as checkpoint:
        assert checkpoint.tensor_shape("w") == (4,)
        with pytest.raises(CheckpointError, match="F8_E4M3.*not supported") as info:
            checkpoint.load("w")
    assert "model.safetensors" in str(info.value) and "\n" not in str(info.value)


def valid_file():
    return safetensors_bytes({"w": f32([2], 0, 8)}, bytes(8))



def test_a_folder_without_config_json_is_a_one_line_error_saying_it_is_missing(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(valid_file())
    one_line_checkpoint_error(lambda: SafetensorsCheckpoint(tmp_path), "config.json", "missing")


@pytest.mark.parametrize(("config", "problem"), [("{oops", "not valid JSON"), ("[1]", "expected an object")])
def test_a_config_json_that_is_not_a_json_object_is_a_one_line_error_saying_so(tmp_path, config, problem):
    folder = model_folder(tmp_path, valid_file())
    (folder / "config.json").write_text(config)
    one_line_checkpoint_error(lambda: SafetensorsCheckpoint(folder), "config.json", problem)


def test_folder_without_weights_names_other_safetensors_files(tmp_path):
    folder = model_folder(tmp_path, valid_file(), name="consolidated.safetensors")
    one_line_checkpoint_error(
        lambda: SafetensorsCheckpoint(folder), str(folder), "neither model.safetensors", "consolidated.safetensors"
    )


def test_a_path_that_does_not_exist_is_a_one_line_error_naming_it(tmp_path):
    one_line_checkpoint_error(lambda: SafetensorsCheckpoint(tmp_path / "nowhere"), "nowhere", "does not exist")


def sharded_folder(tmp_path, weight_map):
    folder = model_folder(tmp_path, valid_file(), name="shard-1.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_index_naming_a_missing_shard(tmp_path):
    folder = sharded_folder(tmp_path, {"w": "shard-1.safetensors", "v": "shard-2.safetensors"})
    one_line_checkpoint_error(
        lambda: SafetensorsCheckpoint(folder), "model.safetensors.index.json", "'shard-2.safetensors'"
    )


def test_index_placing_a_tensor_in_a_shard_without_it(tmp_path):
    folder = sharded_folder(tmp_path, {"w": "shard-1.safetensors", "v": "shard-1.safetensors"})
    one_line_checkpoint_error(
        lambda: SafetensorsCheckpoint(folder), "model.safetensors.index.json", "tensor 'v'", "does not hold it"
    )


@pytest.mark.parametrize("index", ["{oops", '{"metadata": {}}', '{"weight_map": {"w": 3}}'])
def test_a_malformed_index_is_a_one_line_error_naming_the_index_file(tmp_path, index):
    folder = sharded_folder(tmp_path, {})
    (folder / "model.safetensors.index.json").write_text(index)
    one_line_checkpoint_error(lambda: SafetensorsCheckpoint(folder), "model.safetensors.index.json")


def test_malformed_shard_names_the_shard(tmp_path):
    folder = sharded_folder(tmp_path, {"w": "shard-1.safetensors"})
    (folder / "shard-1.safetensors").write_bytes(b"\x00")
    one_line_checkpoint_error(lambda: SafetensorsCheckpoint(folder), "shard-1.safetensors", "too short")


def test_valid_sharded_hand_made_folder(tmp_path):
    folder = sharded_folder(tmp_path, {"w": "shard-1.safetensors"})
    with SafetensorsCheckpoint(folder) as checkpoint:
        assert checkpoint.tensor_names() == ["w"]
        np.testing.assert_array_equal(checkpoint.load("w"), [0, 0])


def test_file_truncated_after_opening_fails_on_load_not_with_a_crash(tmp_path):
    folder = model_folder(tmp_path, valid_file())
    content = (folder / "model.safetensors").read_bytes()
    with SafetensorsCheckpoint(folder) as checkpoint:
        (folder / "model.safetensors").write_bytes(content[:-4])
        one_line_checkpoint_error(lambda: checkpoint.load("w"), "model.safetensors", "truncated")
    with SafetensorsCheckpoint(model_folder(tmp_path, content)) as checkpoint:
        checkpoint.load("w")
        with open(folder / "model.safetensors", "r+b") as file:
            file.truncate(len(content) - 4)
        one_line_checkpoint_error(lambda: checkpoint.load("w"), "model.safetensors", "truncated")
