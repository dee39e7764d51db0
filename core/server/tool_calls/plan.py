"""What a chat request's tools and tool_choice mean for its prompt, its sampling and its output."""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.requests.sampling_params import StructuredOutput
from candelabra.core.server.tool_calls.family import ToolCallParser
from candelabra.core.server.tool_calls.forced import (
    NamedCallParser,
    RequiredCallsParser,
    arguments_schema,
    required_schema,
)


class NoToolFormat(ValueError):
    """The chat template shows the model no call format that a parser here reads."""


@dataclass
class ToolPlan:
    template_tools: list[dict] | None  # the tools the chat template offers the model
    parser: ToolCallParser | None  # None: the output is text only
    structured_output: StructuredOutput | None = None
    max_calls: int | None = None  # parallel_tool_calls false: the first call only

    def kept(self, calls: list, already: int = 0) -> list:
        """The calls to answer, given `already` answered before them."""
        if self.max_calls is None:
            return calls
        return calls[:max(0, self.max_calls - already)]


def plan_tools(tools: list[dict] | None, tool_choice: str | dict, parallel: bool,
               family: type[ToolCallParser] | None) -> ToolPlan:
    """`tools` and a named `tool_choice` as plain dicts (validated already). "none" leaves the tools
    out of the prompt, so that the model answers in words; "auto" lets it choose and reads its
    calls in its family's format; "required" and a named function force calls by structured output."""
    if not tools or tool_choice == "none":
        return ToolPlan(None, None)
    plan = _plan_choice(tools, tool_choice, parallel, family)
    plan.max_calls = None if parallel else 1
    return plan


def _plan_choice(tools: list[dict], tool_choice: str | dict, parallel: bool,
                 family: type[ToolCallParser] | None) -> ToolPlan:
    names = frozenset(tool["function"]["name"] for tool in tools)
    if tool_choice == "auto":
        if family is None:
            raise NoToolFormat("this model's chat template shows it no tool-call format that candelabra reads "
                               "(Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]); send tool_choice "
                               "\"required\" or a named function to force calls, or leave tools out")
        return ToolPlan(tools, family(names))
    if tool_choice == "required":
        schema = required_schema(tools, parallel)
        return ToolPlan(tools, RequiredCallsParser(names), StructuredOutput(json_schema=schema))
    name = tool_choice["function"]["name"]
    tool = next(tool for tool in tools if tool["function"]["name"] == name)
    return ToolPlan(tools, NamedCallParser(names, name), StructuredOutput(json_schema=arguments_schema(tool)))


def decoding_drops_markers(tokenizer, markers: tuple[str, ...]) -> bool:
    """Whether decoding with special tokens skipped would drop any of a family's call markers,
    which are special tokens in some vocabularies (Mistral's [TOOL_CALLS], Llama's <|python_tag|>)."""
    return any(tokenizer.decode(tokenizer.encode(marker, add_special_tokens=False)) == "" for marker in markers)
