"""Which family's format a model writes its calls in, read from how its chat template shows
calls to it: the template teaches the model the format, so it names the parser too."""

from __future__ import annotations

from candelabra.core.server.tool_calls.family import ToolCallParser
from candelabra.core.server.tool_calls.hermes import OPEN, HermesParser
from candelabra.core.server.tool_calls.llama3 import PYTHON_TAG, Llama3JsonParser
from candelabra.core.server.tool_calls.mistral import TOOL_CALLS, MistralParser

LLAMA3_HEADER = "<|start_header_id|>"


def parser_for_template(template: str | None) -> type[ToolCallParser] | None:
    """The parser class for a chat template's text, or None when it shows no format known here."""
    if not template:
        return None
    if OPEN in template:
        return HermesParser
    if TOOL_CALLS in template:
        return MistralParser
    if LLAMA3_HEADER in template and (PYTHON_TAG in template or "tools" in template):
        return Llama3JsonParser
    return None
