"""Separating a reasoning model's thinking from its answer, as text streams in.

Reasoning models (Qwen3, DeepSeek-R1 and their distillations) write their thinking between
`<think>` and `</think>`. Some chat templates open the `<think>` in the prompt, so the output
starts inside the thinking; others leave it to the model. Text that might be the start of a tag
is held back until it is known not to be one.
"""

from __future__ import annotations

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open thinking block."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN_TAG)


class ReasoningSplitter:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._held = ""
        self._content_started = False
        self.thought = starts_in_reasoning  # whether any thinking block was seen

    def feed(self, text: str) -> tuple[str, str]:
        """The new (reasoning, content) text from the next piece of output."""
        reasoning, content = "", ""
        buffer, self._held = self._held + text, ""
        while buffer:
            if self._state == "start":
                stripped = buffer.lstrip()
                if stripped.startswith(OPEN_TAG):
                    buffer, self._state = stripped[len(OPEN_TAG):], "reasoning"
                    self.thought = True
                elif OPEN_TAG.startswith(stripped):
                    self._held = buffer
                    break
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = buffer.find(CLOSE_TAG)
                if end >= 0:
                    reasoning += buffer[:end]
                    buffer, self._state = buffer[end + len(CLOSE_TAG):], "content"
                    continue
                keep = _partial_tag_suffix(buffer, CLOSE_TAG)
                reasoning += buffer[:len(buffer) - keep]
                self._held = buffer[len(buffer) - keep:]
                break
            else:
                if not self._content_started and self.thought:
                    buffer = buffer.lstrip()
                    self._content_started = bool(buffer)
                content += buffer
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever is still held back once the output has ended."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held


def _partial_tag_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could begin `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def split_reasoning(text: str, starts_in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None when there was none, content) of a whole output."""
    splitter = ReasoningSplitter(starts_in_reasoning)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if splitter.thought else None), content
