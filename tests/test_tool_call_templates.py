"""The tool-call parser is picked from the chat template, and tools, assistant tool calls and tool
results render through the template: the default model's own, and one per family."""

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import tool_templates
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.server.protocol import ChatCompletionRequest
from candelabra.core.server.tool_calls import parser_for_template
from candelabra.core.server.tool_calls.hermes import HermesParser
from candelabra.core.server.tool_calls.llama3 import Llama3JsonParser
from candelabra.core.server.tool_calls.mistral import MistralParser
from candelabra.core.server.tool_calls.plan import decoding_drops_markers
from candelabra.core.server.tool_calls.shapes import message_for_template
from candelabra.core.weights.default_model import default_model_path
from candelabra.core.weights.gguf import GGUFCheckpoint
from candelabra.core.weights.safetensors import SafetensorsCheckpoint

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcDEF123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temperature_c": 22}'},
]


def checkpoint_with_template(folder, template: str) -> SafetensorsCheckpoint:
    """A byte-level tokenizer (every byte a token, no merges) with the families' markers as special
    tokens, saved by transformers beside a config and an empty weights file."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw = RawTokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|eot_id|>")
    hf.add_special_tokens({"additional_special_tokens": tool_templates.SPECIAL_TOKENS})
    hf.chat_template = template
    hf.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return SafetensorsCheckpoint(folder)


def tokenizer_with(tmp_path, template: str) -> Tokenizer:
    return Tokenizer.from_checkpoint(checkpoint_with_template(tmp_path, template))


def history_for_template() -> list[dict]:
    request = ChatCompletionRequest(messages=HISTORY, tools=[WEATHER_TOOL])
    return [message_for_template(m.for_template()) for m in request.messages]


@pytest.fixture(scope="module")
def default_tokenizer():
    return Tokenizer.from_checkpoint(GGUFCheckpoint(default_model_path()))


@pytest.mark.parametrize("template, parser", [
    ("HERMES", HermesParser), ("LLAMA31", Llama3JsonParser), ("LLAMA32", Llama3JsonParser),
    ("MISTRAL", MistralParser), ("PLAIN", None)])
def test_the_parser_is_picked_from_the_template(tmp_path, template, parser):
    tokenizer = tokenizer_with(tmp_path, getattr(tool_templates, template))
    assert parser_for_template(tokenizer.chat_template_text) is parser


def test_the_default_model_writes_hermes_calls(default_tokenizer):
    assert parser_for_template(default_tokenizer.chat_template_text) is HermesParser


def test_tools_and_tool_history_render_through_the_default_models_template(default_tokenizer):
    prompt = default_tokenizer.render_chat(history_for_template(), tools=[WEATHER_TOOL])
    assert json.dumps(WEATHER_TOOL) in prompt  # offered in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature_c": 22}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "get_weather" not in default_tokenizer.render_chat(HISTORY[:1])


@pytest.mark.parametrize("template, call, result", [
    ("HERMES", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     '<tool_response>\n{"temperature_c": 22}\n</tool_response>'),
    ("LLAMA31", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>',
     'ipython<|end_header_id|>\n\n{"temperature_c": 22}<|eot_id|>'),
    ("LLAMA32", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
     'ipython<|end_header_id|>\n\n{"temperature_c": 22}<|eot_id|>'),
    ("MISTRAL", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]</s>',
     '[TOOL_RESULTS] {"content": "{\\"temperature_c\\": 22}", "call_id": "abcDEF123"}[/TOOL_RESULTS]')])
def test_tool_history_renders_through_each_familys_template(tmp_path, template, call, result):
    tokenizer = tokenizer_with(tmp_path, getattr(tool_templates, template))
    prompt = tokenizer.render_chat(history_for_template() + [{"role": "user", "content": "And now?"}],
                                   tools=[WEATHER_TOOL])
    assert call in prompt and result in prompt
    assert '"name": "get_weather", "description": "The weather in a city now"' in prompt


@pytest.mark.parametrize("template, drops", [("HERMES", False), ("LLAMA31", True), ("MISTRAL", True)])
def test_markers_that_are_special_tokens_are_kept_in_the_text(tmp_path, template, drops):
    tokenizer = tokenizer_with(tmp_path, getattr(tool_templates, template))
    parser = parser_for_template(tokenizer.chat_template_text)
    assert decoding_drops_markers(tokenizer, parser.markers) is drops
