"""Pieces of the server that need no server: thinking separation and request validation."""

import random

import pytest
from pydantic import ValidationError

from candelabra.core.server.protocol import ChatCompletionRequest, CompletionRequest
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


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stop, expected", [
    ("x", ["x"]), (["x", "y"], ["x", "y"]), ({"Single": "x"}, ["x"]), ({"Multiple": ["x", "y"]}, ["x", "y"]),
    (None, None),
])
def test_stop_in_every_accepted_form(stop, expected):
    assert ChatCompletionRequest(messages=MESSAGES, stop=stop).stop == expected


@pytest.mark.parametrize("fields, problem", [
    ({"stop": [""]}, "must not be empty"),
    ({"stop": {"Other": "x"}}, "stop"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs requires logprobs"),
    ({"functions": [{"name": "f"}]}, "not supported"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "send text"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_chat_requests_refused(fields, problem):
    with pytest.raises(ValidationError, match=problem):
        ChatCompletionRequest(**{"messages": MESSAGES, **fields})


def test_text_parts_and_developer_role_reach_the_template_as_plain_text():
    request = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
    ])
    assert [m.for_template() for m in request.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}]


@pytest.mark.parametrize("prompt, expected", [
    ("text", ["text"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("fields, problem", [
    ({"prompt": []}, "empty"), ({"prompt": [[]]}, "empty"), ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
])
def test_completion_requests_refused(fields, problem):
    with pytest.raises(ValidationError, match=problem):
        CompletionRequest(**fields)


def test_echoed_prompt_is_scored_at_the_larger_of_logprobs_and_prompt_logprobs():
    assert CompletionRequest(prompt="x", echo=True, logprobs=3).num_prompt_logprobs == 3
    assert CompletionRequest(prompt="x", echo=True, logprobs=3, prompt_logprobs=5).num_prompt_logprobs == 5
    assert CompletionRequest(prompt="x", logprobs=3).num_prompt_logprobs is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], prompt_logprobs=0)
    assert chat.num_prompt_logprobs == 0


def test_backend_auto_says_which_and_why(caplog):
    import logging

    from candelabra.core.llm import choose_backend

    with caplog.at_level(logging.INFO, logger="candelabra"):
        chosen = choose_backend("auto")
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"backend auto: chose {chosen.name}, priority {chosen.probe().priority}, the highest available" in message
    assert "chose gcu" not in message  # no GCU here, and its CPU stand-in only when asked for
    if chosen.name == "torch":  # the fast CPU path, over the numpy reference
        assert "passed over: cpu: priority 10, on cpu (" in message
    if chosen.name == "cpu":  # MLX's CPU build here: passed over for its lower priority, saying why it is lower
        assert "passed over: metal: priority 5, on cpu (MLX" in message and "slower than the numpy backend" in message


def test_generation_config_is_read_and_checked(tmp_path):
    from candelabra.core.server.generation_config import recommended_sampling
    from candelabra.core.weights import CheckpointError

    class Folder:
        path = tmp_path

    assert recommended_sampling(Folder()) == {}
    config = tmp_path / "generation_config.json"
    config.write_text('{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": true}')
    assert recommended_sampling(Folder()) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                              "repetition_penalty": 1.05}
    config.write_text('{"temperature": "hot"}')
    with pytest.raises(CheckpointError, match="temperature must be a number"):
        recommended_sampling(Folder())
    config.write_text("{broken")
    with pytest.raises(CheckpointError, match="generation_config.json: cannot be read as JSON"):
        recommended_sampling(Folder())
