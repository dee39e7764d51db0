"""Separating a reply's thinking from its answer: streamed in any pieces as on the whole text, and
the prompts that open a thought."""

import random

import pytest

from candelabra.core.server.reasoning import ReasoningSplitter, opens_thinking, split_reasoning

PIECES = ["<", "think", ">", "</", "think>", "</think>", "<think>", "a", " b", "\n", "c<", "<t", "d"]


def reference(text: str, starts_in_reasoning: bool) -> tuple[str | None, str]:
    """What a reader would say: the thinking ends at the first close tag; a reply that starts
    (after blanks) with the open tag thinks; the answer loses its leading blanks after a thought."""
    if not starts_in_reasoning:
        if not text.lstrip().startswith("<think>"):
            return None, text
        text = text.lstrip()[len("<think>"):]
    thought, closed, answer = text.partition("</think>")
    return thought, answer.lstrip() if closed else ""


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_streamed_split_matches_the_whole_text_split(starts_in_reasoning):
    rng = random.Random(1234)
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        splitter = ReasoningSplitter(starts_in_reasoning)
        reasoning, content, rest = "", "", text
        while rest:
            cut = rng.randint(1, len(rest))
            r, c = splitter.feed(rest[:cut])
            reasoning, content, rest = reasoning + r, content + c, rest[cut:]
        r, c = splitter.finish()
        reasoning, content = reasoning + r, content + c
        expected = reference(text, starts_in_reasoning)
        assert (reasoning if splitter.thought else None, content) == expected, text
        assert split_reasoning(text, starts_in_reasoning) == expected, text


def test_prompts_that_open_a_thought():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")
