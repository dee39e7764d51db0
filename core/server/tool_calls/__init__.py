"""Tool calling: reading the calls a model writes in its family's format, forcing calls with
structured output when tool_choice demands one, and the OpenAI shapes of calls and their deltas.

A family's parser is picked from the model's chat template (`parser_for_template`); each
request builds its own parser instance knowing the names of the tools it offered.
"""

from candelabra.core.server.tool_calls.calls import Parsed, ToolCall
from candelabra.core.server.tool_calls.choose import parser_for_template
from candelabra.core.server.tool_calls.streaming import ToolCallStream

__all__ = ["Parsed", "ToolCall", "ToolCallStream", "parser_for_template"]
