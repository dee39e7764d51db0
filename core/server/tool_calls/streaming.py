"""Reading calls out of an output while it is still being written."""

from __future__ import annotations

from candelabra.core.server.tool_calls.calls import Parsed, ToolCall
from candelabra.core.server.tool_calls.family import ToolCallParser


class ToolCallStream:
    """Feed it the output's text piece by piece; it answers the content and the calls that are
    settled so far. Text that may still turn into a call is held back; the pieces of content and
    the calls it gives, joined, are what `parser.parse` gives for the whole output."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._calls_sent = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.text += text
        return self._news(self.parser.parse(self.text[:self.parser.settled(self.text)]))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._news(self.parser.parse(self.text))

    @property
    def called(self) -> bool:
        return self._calls_sent > 0

    def _news(self, parsed: Parsed) -> tuple[str, list[ToolCall]]:
        content = parsed.content[self._content_sent:]
        calls = parsed.calls[self._calls_sent:]
        self._content_sent, self._calls_sent = len(parsed.content), len(parsed.calls)
        return content, calls
