"""GGUF tokenizers are converted once per tokenizer, kept under a digest of what they are made
of, and the cache holds one folder per tokenizer in use however often files change."""

import json
import logging
import os

import numpy as np
import pytest

from candelabra.conformance.gguf_models import gguf_metadata, write_gguf
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.weights.gguf import GGUFCheckpoint
from candelabra.core.weights.gguf_tokenizer import tokenizer_digest

TOKENS = ["a", "b", "c", "ab", "abc", "<s>", "</s>", "Ġ", "d"]
TOKENIZER = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "qwen2",
    "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 3, 1, 1],
    "tokenizer.ggml.merges": ["a b", "ab c"],
    "tokenizer.ggml.bos_token_id": 5,
    "tokenizer.ggml.eos_token_id": 6,
    "tokenizer.ggml.padding_token_id": 6,
    "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}</s>{% endfor %}",
}


def tiny_gguf(path, seed=0, **tokenizer_changes):
    """A small qwen2 GGUF with a nine-token BPE tokenizer; `seed` changes its weights only."""
    metadata = gguf_metadata("qwen2") | TOKENIZER | tokenizer_changes
    embedding = np.random.default_rng(seed).standard_normal((len(TOKENS), 64)).astype(np.float32)
    return write_gguf(path, "qwen2", metadata, {"token_embd.weight": embedding})


def tokenizer_of(path):
    with GGUFCheckpoint(path) as checkpoint:
        return Tokenizer.from_checkpoint(checkpoint)


def entries(cache):
    """The cached GGUF tokenizers' folders, by name."""
    return sorted(folder.name for folder in (cache / "tokenizers").iterdir() if folder.name != "gguf-sources")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CANDELABRA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_of_an_architecture_transformers_cannot_load_still_gets_its_tokenizer(tmp_path, cache):
    from transformers import AutoTokenizer

    metadata = gguf_metadata("deepseek-v2") | TOKENIZER
    embedding = {"token_embd.weight": np.ones((len(TOKENS), 64), np.float32)}
    path = write_gguf(tmp_path / "deepseek.gguf", "deepseek2", metadata, embedding)
    with pytest.raises(ValueError, match="deepseek2 is not supported"):
        AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tokenizer = tokenizer_of(path)
    assert tokenizer.encode("abc ab", add_special_tokens=False) == [4, 7, 3]
    assert tokenizer.eos_token_ids == {6} and tokenizer.render_chat([{"role": "user", "content": "ab"}]) == "ab</s>"


def test_the_digest_covers_the_tokenizer_metadata_only_and_not_its_order(tmp_path):
    digest = tokenizer_digest(tiny_gguf(tmp_path / "model.gguf"))
    reordered = dict(reversed(TOKENIZER.items()))
    assert tokenizer_digest(tiny_gguf(tmp_path / "other.gguf", seed=1, **reordered)) == digest
    assert tokenizer_digest(tiny_gguf(tmp_path / "merges.gguf", **{"tokenizer.ggml.merges": ["a b"]})) != digest
    template = {"tokenizer.chat_template": "{{ messages }}"}
    assert tokenizer_digest(tiny_gguf(tmp_path / "template.gguf", **template)) != digest
    assert tokenizer_digest(tiny_gguf(tmp_path / "bos.gguf", **{"tokenizer.ggml.bos_token_id": 6})) != digest


def test_a_gguf_tokenizer_is_built_once_saying_so_then_read_from_the_cache(tmp_path, cache, caplog):
    path = tiny_gguf(tmp_path / "model.gguf")
    with caplog.at_level(logging.INFO, logger="candelabra"):
        built = tokenizer_of(path)
    assert "building the tokenizer from model.gguf" in caplog.text and "first start only" in caplog.text
    assert "tokenizer built in" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="candelabra"):
        cached = tokenizer_of(path)
    assert caplog.text == ""
    assert cached.encode("abc ab", add_special_tokens=False) == built.encode("abc ab", add_special_tokens=False) == [
        4, 7, 3]
    assert cached.render_chat([{"role": "user", "content": "abc"}]) == "abc</s>"
    assert len(entries(cache)) == 1


def test_files_holding_the_same_tokenizer_share_one_entry(tmp_path, cache, caplog):
    tokenizer_of(tiny_gguf(tmp_path / "model-q8.gguf"))
    with caplog.at_level(logging.INFO, logger="candelabra"):
        tokenizer_of(tiny_gguf(tmp_path / "model-q4.gguf", seed=1))
    assert "building" not in caplog.text
    assert len(entries(cache)) == 1


def test_a_file_touched_or_written_again_adds_no_entry(tmp_path, cache, caplog):
    path = tiny_gguf(tmp_path / "model.gguf")
    tokenizer_of(path)
    before = entries(cache)
    os.utime(path, ns=(1, 1))
    tokenizer_of(path)
    tiny_gguf(path)
    with caplog.at_level(logging.INFO, logger="candelabra"):
        tokenizer_of(path)
    assert "building" not in caplog.text
    assert entries(cache) == before


def test_a_file_whose_tokenizer_changed_replaces_its_old_entry(tmp_path, cache):
    path = tiny_gguf(tmp_path / "model.gguf")
    tokenizer_of(path)
    old = entries(cache)
    tiny_gguf(path, **{"tokenizer.chat_template": "{{ messages[0].content }}!"})
    assert tokenizer_of(path).render_chat([{"role": "user", "content": "abc"}]) == "abc!"
    assert len(entries(cache)) == 1 and entries(cache) != old


def test_an_entry_another_file_still_uses_stays_when_one_file_changes_and_goes_once_none_does(tmp_path, cache):
    first, second = tiny_gguf(tmp_path / "first.gguf"), tiny_gguf(tmp_path / "second.gguf")
    tokenizer_of(first)
    tokenizer_of(second)
    shared = entries(cache)
    tiny_gguf(first, **{"tokenizer.ggml.eos_token_id": 5})
    tokenizer_of(first)
    assert set(shared) < set(entries(cache)) and len(entries(cache)) == 2
    second.unlink()
    tiny_gguf(first)
    tokenizer_of(first)
    assert entries(cache) == shared


def test_entries_the_earlier_scheme_kept_for_the_file_are_removed_and_others_left(tmp_path, cache):
    earlier = [cache / "tokenizers" / name for name in ("model.gguf-123-456", "model.gguf-123-789", "other.gguf-1-2")]
    for folder in earlier:
        folder.mkdir(parents=True)
        (folder / "tokenizer_config.json").write_text("{}")
    tokenizer_of(tiny_gguf(tmp_path / "model.gguf"))
    assert [folder.exists() for folder in earlier] == [False, False, True]
    assert "other.gguf-1-2" in entries(cache) and len(entries(cache)) == 2


def test_an_entry_that_cannot_be_read_is_built_again(tmp_path, cache):
    path = tiny_gguf(tmp_path / "model.gguf")
    tokenizer_of(path)
    (entry,) = entries(cache)
    (cache / "tokenizers" / entry / "tokenizer_config.json").write_text("{not json")
    assert tokenizer_of(path).encode("abc", add_special_tokens=False) == [4]
    assert entries(cache) == [entry]
    assert json.loads((cache / "tokenizers" / entry / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
