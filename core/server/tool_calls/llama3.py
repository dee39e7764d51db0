"""Llama 3.1 / 3.2 JSON calls: the answer is `{"name": ..., "parameters": {...}}` (several joined
by `;`), either the whole output or after `<|python_tag|>`."""

from __future__ import annotations

import json

from candelabra.core.server.tool_calls.calls import ToolCall, call_from_object
from candelabra.core.server.tool_calls.family import CallsAfterMarker

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(CallsAfterMarker):
    family = "llama3_json"
    markers = (PYTHON_TAG,)
    marker = PYTHON_TAG

    def section_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith("{"):
            return len(text) - len(stripped)
        return text.find(PYTHON_TAG)

    def settled(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{"):
            return 0  # an answer that opens with JSON is a call until it proves otherwise
        return super().settled(text)

    def read_calls(self, section: str) -> list[ToolCall] | None:
        rest = section.removeprefix(PYTHON_TAG) if section.startswith(PYTHON_TAG) else section
        decoder, calls = json.JSONDecoder(), []
        rest = rest.strip()
        while rest:
            try:
                value, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return None
            call = call_from_object(value, self.tool_names)
            if call is None:
                return None
            calls.append(call)
            rest = rest[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
        return calls or None
