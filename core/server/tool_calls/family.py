"""The interface every family's parser has, and the shared shape of the families whose calls fill
the end of the output after one marker (Llama 3's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from candelabra.core.server.tool_calls.calls import Parsed, ToolCall, openai_call_id, partial_suffix


class ToolCallParser(ABC):
    """Reads the calls out of one output. `parse` reads a whole output; `settled` says how much of
    an output still being written can already be parsed for good: parsing that prefix gives a
    prefix of the content and of the calls that the whole output will give, whatever follows."""

    family = ""
    markers: tuple[str, ...] = ()  # the texts that frame calls, which may be special tokens

    def __init__(self, tool_names: frozenset[str] | set[str] | list[str]) -> None:
        self.tool_names = frozenset(tool_names)

    @abstractmethod
    def parse(self, text: str) -> Parsed: ...

    @abstractmethod
    def settled(self, text: str) -> int: ...

    def new_call_id(self) -> str:
        return openai_call_id()


class CallsAfterMarker(ToolCallParser):
    """Text, then `marker` and the calls up to the end. All the calls parse, or the whole section
    stays text: a reader cannot tell where a broken call ends and the next begins."""

    marker = ""

    def section_start(self, text: str) -> int:
        """Where the calls begin (the marker's position), or -1."""
        return text.find(self.marker)

    @abstractmethod
    def read_calls(self, section: str) -> list[ToolCall] | None:
        """The calls written after the marker, or None when they do not all parse."""

    def parse(self, text: str) -> Parsed:
        start = self.section_start(text)
        if start < 0:
            return Parsed(text)
        calls = self.read_calls(text[start:])
        if not calls:
            return Parsed(text)
        return Parsed(text[:start].rstrip(), calls)

    def settled(self, text: str) -> int:
        start = self.section_start(text)
        end = start if start >= 0 else len(text) - partial_suffix(text, self.marker)
        return len(text[:end].rstrip())
