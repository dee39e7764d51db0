"""Hermes-style calls, as Qwen2.5, Qwen3 and Hermes models write them: each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, text around them."""

from __future__ import annotations

import re

from candelabra.core.server.tool_calls.calls import Parsed, ToolCall, call_from_json, partial_suffix
from candelabra.core.server.tool_calls.family import ToolCallParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
FENCE_OPENING = re.compile(r"```[A-Za-z]*\s*")


class HermesParser(ToolCallParser):
    """Each block stands alone: one that does not parse stays in the content as it was written.
    Whitespace between text and a call is dropped. A last block left open by the end of the output
    still counts when its JSON is whole (the model may stop before the closing tag).

    Small Qwen models often leave the tags out and answer with nothing but the call's JSON object,
    bare or in a Markdown code fence; such an output, naming an offered tool, is a call too."""

    family = "hermes"
    markers = (OPEN, CLOSE)

    def parse(self, text: str) -> Parsed:
        if OPEN not in text:
            call = _bare_call(text, self.tool_names)
            return Parsed("", [call]) if call is not None else Parsed(text)
        pieces: list[str | ToolCall] = []
        position = 0
        while True:
            start = text.find(OPEN, position)
            if start < 0:
                pieces.append(text[position:])
                break
            pieces.append(text[position:start])
            end = text.find(CLOSE, start)
            block_end = len(text) if end < 0 else end + len(CLOSE)
            call = call_from_json(text[start + len(OPEN):block_end - (0 if end < 0 else len(CLOSE))],
                                  self.tool_names)
            pieces.append(call if call is not None else text[start:block_end])
            position = block_end
            if end < 0:
                break
        return _joined(pieces)

    def settled(self, text: str) -> int:
        if OPEN not in text and _may_become_bare_call(text):
            return 0
        position = 0
        while True:
            start = text.find(OPEN, position)
            if start < 0:
                end = len(text) - partial_suffix(text, OPEN)
                break
            close = text.find(CLOSE, start)
            if close < 0:
                end = start
                break
            position = close + len(CLOSE)
        return len(text[:end].rstrip())


def _bare_call(text: str, tool_names: frozenset[str]) -> ToolCall | None:
    body = text.strip()
    fenced = FENCED.fullmatch(body)
    if fenced:
        body = fenced.group(1)
    return call_from_json(body, tool_names) if body.startswith("{") else None


def _may_become_bare_call(text: str) -> bool:
    """Whether the output so far opens the way a bare or fenced call does."""
    start = text.lstrip()
    if not start or start.startswith("{") or FENCE.startswith(start):
        return True
    opening = FENCE_OPENING.match(start)
    return bool(opening) and (opening.end() == len(start) or start[opening.end()] == "{")


def _joined(pieces: list[str | ToolCall]) -> Parsed:
    """Adjacent texts merge (a block that did not parse is text); text loses its whitespace on the
    sides that touch a call, and texts parted by calls join on a new line."""
    merged: list[str | ToolCall] = []
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    content, calls = [], []
    for i, piece in enumerate(merged):
        if isinstance(piece, ToolCall):
            calls.append(piece)
            continue
        if i > 0:
            piece = piece.lstrip()
        if i < len(merged) - 1:
            piece = piece.rstrip()
        if piece:
            content.append(piece)
    return Parsed("\n".join(content), calls)
