"""Mistral calls after the `[TOOL_CALLS]` token: a JSON list of `{"name", "arguments"}` objects
(v3 tokenizers), or `name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (v11 on)."""

from __future__ import annotations

import json
import secrets
import string

from candelabra.core.server.tool_calls.calls import ToolCall, call_from_object
from candelabra.core.server.tool_calls.family import CallsAfterMarker

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
ID_ALPHABET = string.ascii_letters + string.digits


class MistralParser(CallsAfterMarker):
    family = "mistral"
    markers = (TOOL_CALLS, ARGS)
    marker = TOOL_CALLS

    def new_call_id(self) -> str:
        # Mistral's chat templates refuse tool call ids other than nine letters and digits.
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))

    def read_calls(self, section: str) -> list[ToolCall] | None:
        calls = []
        for part in section.split(TOOL_CALLS)[1:]:
            part = part.strip()
            found = self._json_list(part) if part.startswith(("[", "{")) else self._named(part)
            if found is None:
                return None
            calls.extend(found)
        return calls or None

    def _json_list(self, part: str) -> list[ToolCall] | None:
        try:
            value = json.loads(part)
        except json.JSONDecodeError:
            return None
        values = value if isinstance(value, list) else [value]
        calls = [call_from_object(v, self.tool_names) for v in values]
        return None if not calls or None in calls else calls

    def _named(self, part: str) -> list[ToolCall] | None:
        name, args_marker, arguments = part.partition(ARGS)
        if not args_marker:
            return None
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        call = call_from_object({"name": name.strip(), "arguments": value}, self.tool_names)
        return None if call is None else [call]
