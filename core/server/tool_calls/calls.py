"""What every family's parser produces: calls (a name and JSON arguments) and the text around them."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: text, not a dict


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def call_from_object(value: object, tool_names: frozenset[str]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments" or "parameters": {...}}`, or None when it is
    not one: not an object, no name, a tool that was not offered, or arguments that are no object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if value["name"] not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def call_from_json(text: str, tool_names: frozenset[str]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call_from_object(value, tool_names)


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
