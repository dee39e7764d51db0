"""What tools and tool_choice make of a chat request: the template's tools, the parser, the schema."""

import pytest

from candelabra.core.server.tool_calls import ToolCall
from candelabra.core.server.tool_calls.forced import NamedCallParser, RequiredCallsParser
from candelabra.core.server.tool_calls.hermes import HermesParser
from candelabra.core.server.tool_calls.plan import NoToolFormat, plan_tools

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


def test_no_tools_or_none_leaves_the_prompt_and_the_output_alone():
    for plan in (plan_tools([], "none", True, HermesParser), plan_tools([ADD], "none", True, HermesParser)):
        assert (plan.template_tools, plan.parser, plan.structured_output) == (None, None, None)


def test_auto_reads_the_familys_format_without_constraining():
    plan = plan_tools([ADD, NOOP], "auto", True, HermesParser)
    assert plan.template_tools == [ADD, NOOP] and plan.structured_output is None
    assert isinstance(plan.parser, HermesParser) and plan.parser.tool_names == {"add", "noop"}


def test_auto_needs_a_format_the_template_shows():
    with pytest.raises(NoToolFormat, match="no tool-call format"):
        plan_tools([ADD], "auto", True, None)


def test_a_named_function_is_constrained_to_its_parameters():
    plan = plan_tools([ADD, NOOP], {"type": "function", "function": {"name": "add"}}, True, None)
    assert isinstance(plan.parser, NamedCallParser) and plan.parser.name == "add"
    # closed to keys the function does not take (tools/forced.py's arguments_schema)
    assert plan.structured_output.json_schema == {**ADD["function"]["parameters"], "additionalProperties": False}
    plan = plan_tools([ADD, NOOP], {"type": "function", "function": {"name": "noop"}}, True, None)
    assert plan.structured_output.json_schema == {"type": "object"}


def test_required_is_constrained_to_calls_of_the_offered_tools():
    plan = plan_tools([ADD, NOOP], "required", True, None)
    assert isinstance(plan.parser, RequiredCallsParser) and plan.template_tools == [ADD, NOOP]
    assert plan.structured_output.json_schema["type"] == "array"
    assert "anyOf" in plan_tools([ADD, NOOP], "required", False, None).structured_output.json_schema


def test_parallel_tool_calls_false_keeps_the_first_call():
    calls = [ToolCall("add", "{}"), ToolCall("noop", "{}")]
    one = plan_tools([ADD, NOOP], "auto", False, HermesParser)
    assert one.kept(calls) == calls[:1] and one.kept(calls[1:], already=1) == []
    assert plan_tools([ADD, NOOP], "auto", True, HermesParser).kept(calls) == calls


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "add"}}, True),
                                              ({"type": "function", "function": {"name": "noop"}}, True)])
def test_the_forcing_schemas_compile_in_the_grammar_engine(choice, parallel):
    from llguidance import LLMatcher

    schema = plan_tools([ADD, NOOP], choice, parallel, None).structured_output.json_schema
    failed, problems = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_json_schema(schema))
    assert not failed and not problems, problems
