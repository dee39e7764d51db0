"""The checkpoint's tokenizer and chat template: round trips, template arguments, the sandbox."""

import json

import pytest
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from candelabra.core.engine.tokenizer import ChatTemplateError, Tokenizer
from candelabra.core.weights.safetensors import SafetensorsCheckpoint

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)


def _checkpoint(tmp_path, template=TEMPLATE):
    words = ["<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<think>", "</think>",
             "hello", "world", "how", "are", "you", "?"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"<\|\w+\|>|</?think>|\w+|\?"), behavior="isolated"),
    ])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|end|>")
    hf.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>"]})
    hf.chat_template = template
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return SafetensorsCheckpoint(tmp_path)


def test_encode_decode_round_trip_and_eos(tmp_path):
    tokenizer = Tokenizer.from_checkpoint(_checkpoint(tmp_path), eos_token_ids=(12,))
    ids = tokenizer.encode("hello world how are you?", add_special_tokens=False)
    assert ids == [7, 8, 9, 10, 11, 12]
    assert tokenizer.decode(ids) == "hello world how are you ?"  # a word-level vocabulary joins with spaces
    assert tokenizer.eos_token_ids == {1, 12}


def test_chat_template_renders_with_template_arguments(tmp_path):
    tokenizer = Tokenizer.from_checkpoint(_checkpoint(tmp_path))
    messages = [{"role": "user", "content": "hello"}]
    assert tokenizer.render_chat(messages) == "<|user|>hello<|end|><|assistant|>"
    assert tokenizer.render_chat(messages, enable_thinking=False) == "<|user|>hello<|end|><|assistant|><think></think>"
    assert tokenizer.chat_token_ids(messages) == [2, 7, 1, 3]


def test_a_template_reaching_for_python_internals_is_stopped(tmp_path):
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer.from_checkpoint(_checkpoint(tmp_path, evil))
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_a_model_without_chat_template_says_what_to_do(tmp_path):
    tokenizer = Tokenizer.from_checkpoint(_checkpoint(tmp_path, template=None))
    with pytest.raises(ChatTemplateError, match="no chat template; send it plain text"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
