"""Calls in OpenAI's shapes: in a whole message, and as streamed deltas."""

from __future__ import annotations

import json

from candelabra.core.server.tool_calls.calls import ToolCall


def message_call(call: ToolCall, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def call_delta(index: int, call: ToolCall, call_id: str) -> dict:
    """A whole call in one delta: its first delta carries index, id, type and name, and this one
    carries the arguments too."""
    return {"index": index, **message_call(call, call_id)}


def calls_for_template(tool_calls: object) -> object:
    """An assistant message's tool_calls as chat templates read them: clients send the arguments
    as JSON text, templates write them out with `tojson`, which would quote that text again."""
    if not isinstance(tool_calls, list):
        return tool_calls
    rendered = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        rendered.append(call)
    return rendered


def message_for_template(message: dict) -> dict:
    """A history message (as `ChatMessage.for_template` gives it) with its tool calls readable by templates."""
    if "tool_calls" in message:
        return {**message, "tool_calls": calls_for_template(message["tool_calls"])}
    return message
