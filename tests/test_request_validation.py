"""OpenAI requests as the server's protocol models read them: every accepted form of stop and of a
completion prompt, text parts and the developer role, requests refused with the field named, and the
prompt tokens an echo scores."""

import pytest
from pydantic import ValidationError

from candelabra.core.server.protocol import ChatCompletionRequest, CompletionRequest

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
def test_invalid_chat_requests_are_refused_naming_the_field_or_the_problem(fields, problem):
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
def test_each_completion_prompt_form_reads_as_a_list_of_texts_or_of_token_lists(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("fields, problem", [
    ({"prompt": []}, "empty"), ({"prompt": [[]]}, "empty"), ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "nothing to return"),
    ({"prompt": "x", "max_tokens": -1, "echo": True}, "greater than or equal to 0"),
])
def test_invalid_completion_requests_are_refused_naming_the_field_or_the_problem(fields, problem):
    with pytest.raises(ValidationError, match=problem):
        CompletionRequest(**fields)


def test_echoed_prompt_is_scored_at_the_larger_of_logprobs_and_prompt_logprobs():
    assert CompletionRequest(prompt="x", echo=True, logprobs=3).num_prompt_logprobs == 3
    assert CompletionRequest(prompt="x", echo=True, logprobs=3, prompt_logprobs=5).num_prompt_logprobs == 5
    assert CompletionRequest(prompt="x", logprobs=3).num_prompt_logprobs is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], prompt_logprobs=0)
    assert chat.num_prompt_logprobs == 0


def test_max_tokens_0_with_echo_only_echoes_and_without_echo_is_refused_at_max_tokens():
    assert CompletionRequest(prompt="x", echo=True, max_tokens=0).only_echoes
    assert not CompletionRequest(prompt="x", echo=True, max_tokens=1).only_echoes
    with pytest.raises(ValidationError) as caught:
        CompletionRequest(prompt="x", max_tokens=0)
    assert [error["loc"] for error in caught.value.errors()] == [("max_tokens",)]


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


@pytest.mark.parametrize("message, location, problem", [
    ({"role": "tool", "content": "3"}, ("messages", 1, "tool_call_id"), 'role "tool"'),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": {"a": 1}}}]},
     ("messages", 1, "tool_calls", 0, "function", "arguments"), "not an object"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add"}}]},
     ("messages", 1, "tool_calls", 0, "function", "arguments"), "required"),
])
def test_tool_history_is_refused_at_the_field_that_breaks_openais_shape(message, location, problem):
    with pytest.raises(ValidationError, match=problem) as caught:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, message])
    assert caught.value.errors()[0]["loc"] == location


def test_tool_history_reaches_the_template_as_it_was_sent():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    request = ChatCompletionRequest(messages=messages)
    assert [m.for_template() for m in request.messages] == [{**m, "content": m["content"] or ""} for m in messages]
