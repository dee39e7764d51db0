"""Each family's tool-call parser on outputs in its format, whole and streamed."""

import json

import pytest

from candelabra.core.server.tool_calls import Parsed, ToolCall, ToolCallStream
from candelabra.core.server.tool_calls.forced import (
    NamedCallParser,
    RequiredCallsParser,
    arguments_schema,
    required_schema,
)
from candelabra.core.server.tool_calls.hermes import HermesParser
from candelabra.core.server.tool_calls.llama3 import Llama3JsonParser
from candelabra.core.server.tool_calls.mistral import MistralParser
from candelabra.core.server.tool_calls.shapes import call_delta, calls_for_template

TOOLS = {"get_weather", "add"}
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
ADD = ToolCall("add", '{"a": 1, "b": 2}')


def hermes_block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# (parser, output, expected content, expected calls)
CASES = {
    "hermes one call": (HermesParser, hermes_block("get_weather", '{"city": "Paris"}'), "", [WEATHER]),
    "hermes two calls": (HermesParser, hermes_block("get_weather", '{"city": "Paris"}') + "\n"
                         + hermes_block("add", '{"a": 1, "b": 2}'), "", [WEATHER, ADD]),
    "hermes text before": (HermesParser, "Let me look that up.\n\n" + hermes_block("get_weather", '{"city": "Paris"}'),
                           "Let me look that up.", [WEATHER]),
    "hermes text around": (HermesParser, "First. " + hermes_block("add", '{"a": 1, "b": 2}') + " Then.",
                           "First.\nThen.", [ADD]),
    "hermes malformed json": (HermesParser, 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>',
                              'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', []),
    "hermes one good one malformed": (HermesParser, hermes_block("add", '{"a": 1, "b": 2}')
                                      + "\n<tool_call>{oops</tool_call>", "<tool_call>{oops</tool_call>", [ADD]),
    "hermes unknown function": (HermesParser, hermes_block("launch_rocket", "{}"),
                                hermes_block("launch_rocket", "{}"), []),
    "hermes unclosed but whole": (HermesParser, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n',
                                  "", [ADD]),
    "hermes unclosed and cut": (HermesParser, 'Hm <tool_call>\n{"name": "add", "argu',
                                'Hm <tool_call>\n{"name": "add", "argu', []),
    "hermes plain text": (HermesParser, "No tools needed: 4.", "No tools needed: 4.", []),
    "hermes text that looks like a tag": (HermesParser, "a <tool is < not a call", "a <tool is < not a call", []),
    "hermes bare call": (HermesParser, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
    "hermes fenced call": (HermesParser, '```json\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n```', "",
                           [ADD]),
    "hermes fenced code": (HermesParser, "```python\nprint({1: 2})\n```", "```python\nprint({1: 2})\n```", []),
    "hermes bare json that is no call": (HermesParser, '{"city": "Paris"}', '{"city": "Paris"}', []),
    "hermes bare unknown function": (HermesParser, '{"name": "nope", "arguments": {}}',
                                     '{"name": "nope", "arguments": {}}', []),
    "llama whole output": (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
                           [WEATHER]),
    "llama python tag, two calls": (Llama3JsonParser, '<|python_tag|>{"name": "get_weather", "parameters": '
                                    '{"city": "Paris"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}', "",
                                    [WEATHER, ADD]),
    "llama text before": (Llama3JsonParser, 'I will check. <|python_tag|>{"name": "add", "parameters": '
                          '{"a": 1, "b": 2}}', "I will check.", [ADD]),
    "llama malformed json": (Llama3JsonParser, '{"name": "add", "parameters": {"a": 1', '{"name": "add", '
                             '"parameters": {"a": 1', []),
    "llama json that is no call": (Llama3JsonParser, '{"answer": 42}', '{"answer": 42}', []),
    "llama unknown function": (Llama3JsonParser, '{"name": "nope", "parameters": {}}',
                               '{"name": "nope", "parameters": {}}', []),
    "llama plain text": (Llama3JsonParser, "The answer is {42}.", "The answer is {42}.", []),
    "mistral list": (MistralParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [WEATHER, ADD]),
    "mistral text before": (MistralParser, 'Checking.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
                            "Checking.", [ADD]),
    "mistral args form": (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]'
                          '{"a": 1, "b": 2}', "", [WEATHER, ADD]),
    "mistral malformed": (MistralParser, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}',
                          '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', []),
    "mistral unknown function": (MistralParser, '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
                                 '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', []),
}


@pytest.mark.parametrize("case", CASES)
def test_a_whole_output_parses_into_its_content_and_calls_with_object_arguments(case):
    parser_class, text, content, calls = CASES[case]
    parsed = parser_class(TOOLS).parse(text)
    assert parsed.content == content
    assert parsed.calls == calls
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


def joined_deltas(parser, pieces: list[str]) -> tuple[str, list[dict]]:
    """Streams `pieces` through the parser and joins the OpenAI deltas as a client does."""
    stream, deltas = ToolCallStream(parser), []
    for i, piece in enumerate(pieces):
        content, calls = stream.feed(piece)
        if i == len(pieces) - 1:
            more_content, more_calls = stream.finish()
            content, calls = content + more_content, calls + more_calls
        sent = sum(len(d.get("tool_calls", [])) for d in deltas)
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call_delta(sent + j, call, parser.new_call_id()) for j, call in enumerate(calls)]
        deltas.append(delta)
    content, joined = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if entry["index"] not in joined:  # a call's first delta: everything but the rest of its arguments
                assert entry["type"] == "function" and entry["id"] and entry["function"]["name"]
                joined[entry["index"]] = {"name": entry["function"]["name"], "arguments": ""}
            joined[entry["index"]]["arguments"] += entry["function"].get("arguments", "")
    assert sorted(joined) == list(range(len(joined)))
    return content, [joined[i] for i in sorted(joined)]


@pytest.mark.parametrize("case", CASES)
def test_streamed_at_every_split_joins_into_the_whole_parse(case):
    parser_class, text, content, calls = CASES[case]
    expected = (content, [{"name": c.name, "arguments": c.arguments} for c in calls])
    parser = parser_class(TOOLS)
    assert joined_deltas(parser, list(text)) == expected  # one character at a time
    for cut in range(1, len(text)):
        assert joined_deltas(parser, [text[:cut], text[cut:]]) == expected, cut


def test_calls_stream_out_before_the_output_ends():
    stream = ToolCallStream(HermesParser(TOOLS))
    assert stream.feed("Checking. <tool") == ("Checking.", [])
    assert stream.feed('_call>{"name": "add", "arguments": {"a": 1, "b": 2}}') == ("", [])
    assert stream.feed("</tool_call>\n<tool_call>") == ("", [ADD])
    assert stream.feed(hermes_block("get_weather", '{"city": "Paris"}')[len("<tool_call>"):]) == ("", [WEATHER])
    assert stream.finish() == ("", [])


def test_mistral_ids_are_nine_letters_and_digits():
    call_id = MistralParser(TOOLS).new_call_id()
    assert len(call_id) == 9 and call_id.isalnum()
    assert HermesParser(TOOLS).new_call_id().startswith("call_")


def test_named_function_output_is_its_arguments():
    parser = NamedCallParser(TOOLS, "get_weather")
    assert parser.parse('{"city": "Paris"}') == Parsed("", [WEATHER])
    assert parser.parse('{"city": "Par') == Parsed('{"city": "Par')
    assert parser.parse("[1, 2]") == Parsed("[1, 2]")


def test_required_output_is_one_call_or_a_list():
    parser = RequiredCallsParser(TOOLS)
    assert parser.parse('{"name": "add", "arguments": {"a": 1, "b": 2}}') == Parsed("", [ADD])
    assert parser.parse('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                        '{"name": "add", "arguments": {"a": 1, "b": 2}}]') == Parsed("", [WEATHER, ADD])
    assert parser.parse('[{"name": "nope", "arguments": {}}]').calls == []
    assert parser.parse("[]").calls == []


def test_required_schema_names_each_tool_with_its_parameters():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "noop"}}]
    one = required_schema(tools, parallel=False)
    assert [branch["properties"]["name"] for branch in one["anyOf"]] == [{"const": "add"}, {"const": "noop"}]
    assert one["anyOf"][0]["properties"]["arguments"] == {**tools[0]["function"]["parameters"],
                                                         "additionalProperties": False}
    assert one["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    assert required_schema(tools, parallel=True) == {"type": "array", "items": one, "minItems": 1}


def test_forced_arguments_take_only_the_declared_parameters_unless_the_schema_allows_more():
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"},
                       "when": {"type": "object", "properties": {"hour": {"type": "integer"}}},
                       "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
                       "extra": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
                       "free": {"type": "object"},
                       "either": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "string"}]},
                       "parts": {"allOf": [{"type": "object", "properties": {"a": {}}}],
                                 "properties": {"b": {}}},
                       "named": {"$ref": "#/$defs/point"}},
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_time", "parameters": parameters}}
    closed = arguments_schema(tool)
    properties = closed["properties"]
    assert closed["additionalProperties"] is False and closed["required"] == ["city"]
    assert properties["when"]["additionalProperties"] is False
    assert properties["tags"]["items"]["additionalProperties"] is False
    assert properties["extra"]["additionalProperties"] is True  # the schema's own word stands
    assert "additionalProperties" not in properties["free"]  # an object of any keys stays one
    assert properties["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in properties["parts"]  # allOf names keys elsewhere
    assert "additionalProperties" not in properties["parts"]["allOf"][0]
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert "additionalProperties" not in parameters and "additionalProperties" not in parameters["properties"]["when"]
    assert arguments_schema({"type": "function", "function": {"name": "noop"}}) == {"type": "object"}


def test_history_arguments_reach_templates_as_objects():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
             {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": "not json"}}]
    rendered = calls_for_template(calls)
    assert rendered[0]["function"]["arguments"] == {"a": 1}
    assert rendered[1]["function"]["arguments"] == "not json"
    assert calls[0]["function"]["arguments"] == '{"a": 1}'  # the request's own message is left as it was


def test_text_that_cannot_become_a_call_is_not_held_back():
    stream = ToolCallStream(HermesParser(TOOLS))
    assert stream.feed("```") == ("", [])  # a fence may open a bare call
    assert stream.feed("python\n") == ("", [])
    assert stream.feed("x = 1") == ("```python\nx = 1", [])
    stream = ToolCallStream(HermesParser(TOOLS))
    assert stream.feed("Paris is sunny") == ("Paris is sunny", [])
