"""Tool calling over HTTP: bad requests refused naming the field (tiny model), and the default
model calling a tool through the real `openai` client and langchain's ChatOpenAI."""

import json

import httpx
import openai
import pytest

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASKS_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
ASKS_NOTHING_OF_TOOLS = [{"role": "user", "content": "Write a short poem about the sea."}]


# ---- bad requests, on the tiny test model


def _chat(live_server, **body):
    return httpx.post(f"{live_server.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "w10"}], "max_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "tool_choice", "'launch', which is not among the tools (get_weather)"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name",
     "is required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]},
     "tools.0.function.parameters", "dictionary"),
    ({"tools": [{"type": "function", "function": {"name": "has spaces"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools.0.type", "is required"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one entry in tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function"}}, "tool_choice", '"function": {"name": ...}'),
    ({"functions": [{"name": "f"}]}, None, "send tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    # The tiny model's template offers no tools in any format a parser here reads.
    ({"tools": [WEATHER_TOOL]}, "tools", "no tool-call format"),
])
def test_bad_tool_requests_name_the_field(live_server, body, param, says):
    reply = _chat(live_server, **body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and says in error["message"], error


def test_tool_choice_none_leaves_the_tools_out(live_server):
    reply = _chat(live_server, tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)


def test_completions_take_no_tools(live_server):
    reply = httpx.post(f"{live_server.url}/v1/completions", json={"prompt": "w10", "tools": [WEATHER_TOOL]},
                       timeout=60)
    assert reply.status_code == 400 and "chat/completions" in reply.json()["error"]["message"]


# ---- the default model


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(client, default_server, messages=ASKS_WEATHER, **extra):
    return client.chat.completions.create(model=default_server.model, messages=messages, tools=[WEATHER_TOOL],
                                          temperature=0, **{"max_tokens": 64, **extra})


def _joined_stream(stream) -> tuple[str, list[dict], list[str]]:
    """(content, calls, finish reasons) joined from the chunks as a client joins them."""
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or []:
                if entry.index not in calls:  # a call's first delta names it
                    assert entry.id and entry.type == "function" and entry.function.name
                    calls[entry.index] = {"id": entry.id, "name": entry.function.name, "arguments": ""}
                calls[entry.index]["arguments"] += entry.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], finishes


@pytest.mark.slow
def test_the_default_model_calls_a_tool(client, default_server):
    reply = _ask(client, default_server)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.slow
def test_a_streamed_call_joins_into_the_same_call(client, default_server):
    content, calls, finishes = _joined_stream(_ask(client, default_server, stream=True))
    assert content == "" and finishes == ["tool_calls"]
    [call] = calls
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


@pytest.mark.slow
def test_the_tool_result_comes_back_through_the_template(client, default_server):
    call = _ask(client, default_server).choices[0].message.tool_calls[0]
    history = ASKS_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 23, "sky": "sunny"})}]
    reply = _ask(client, default_server, messages=history)
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    assert "23" in reply.choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cut", [{"stop": ["Paris"]}, {"max_tokens": 8}])
def test_a_call_cut_short_comes_back_as_text(client, default_server, stream, cut):
    reply = _ask(client, default_server, stream=stream, **cut)
    if stream:
        content, calls, finishes = _joined_stream(reply)
    else:
        choice = reply.choices[0]
        content, calls, finishes = choice.message.content, choice.message.tool_calls or [], [choice.finish_reason]
    assert calls == [] and finishes == ["stop" if "stop" in cut else "length"]
    assert '"name": "get_weather"' in content and "Paris" not in content


@pytest.mark.slow
def test_tokenize_counts_the_offered_tools_as_the_chat_does(client, default_server):
    def count(**extra):
        body = {"messages": ASKS_WEATHER, **extra}
        return httpx.post(f"{default_server.url}/tokenize", json=body, timeout=60).json()["count"]

    assert count(tools=[WEATHER_TOOL]) == _ask(client, default_server).usage.prompt_tokens > count()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_answers_in_words(client, default_server, stream):
    reply = _ask(client, default_server, tool_choice="none", stream=stream)
    if stream:
        content, calls, finishes = _joined_stream(reply)
    else:
        choice = reply.choices[0]
        content, calls, finishes = choice.message.content, choice.message.tool_calls or [], [choice.finish_reason]
    assert calls == [] and finishes in (["stop"], ["length"]) and content.strip()


@pytest.mark.slow
def test_a_broken_parameters_schema_is_refused_when_it_would_constrain(default_server):
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
    body = {"messages": ASKS_WEATHER, "tools": [broken], "tool_choice": "required", "max_tokens": 4}
    reply = httpx.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "tools" and "frob" in error["message"], error


# tool_choice "required" and a named function: the prompts below ask for no tool at all, so only
# the engine's structured output (the JSON schema built from the tools) makes these calls.


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_always_called_with_arguments_that_parse(client, default_server, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=default_server.model, messages=ASKS_NOTHING_OF_TOOLS,
                                           tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice, temperature=0,
                                           max_tokens=64, stream=stream)
    if stream:
        _, calls, finishes = _joined_stream(reply)
    else:
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in reply.choices[0].message.tool_calls or []]
        finishes = [reply.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    [call] = calls
    assert call["name"] == "get_time" and isinstance(json.loads(call["arguments"])["city"], str)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls_offered_tools(client, default_server, parallel):
    reply = client.chat.completions.create(model=default_server.model, messages=ASKS_NOTHING_OF_TOOLS,
                                           tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                                           parallel_tool_calls=parallel, temperature=0, max_tokens=96)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert len(choice.message.tool_calls) == 1 or parallel
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments)["city"], str)


# ---- langchain


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_langchain_binds_a_tool_and_gets_the_call(default_server, stream):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"sunny in {city}"

    model = ChatOpenAI(base_url=f"{default_server.url}/v1", api_key="unused", model=default_server.model,
                       temperature=0, max_tokens=64, max_retries=0, timeout=300).bind_tools([get_weather])
    question = "What is the weather like in Paris right now?"
    if stream:
        message = None
        for chunk in model.stream(question):
            message = chunk if message is None else message + chunk
    else:
        message = model.invoke(question)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"]
    assert get_weather.invoke(call["args"]) == "sunny in Paris"


@pytest.mark.slow
def test_langchain_forces_a_named_tool(default_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(city: str) -> str:
        """Get the current local time in a city."""
        return "noon"

    model = ChatOpenAI(base_url=f"{default_server.url}/v1", api_key="unused", model=default_server.model,
                       temperature=0, max_tokens=64, max_retries=0, timeout=300)
    message = model.bind_tools([get_time], tool_choice="get_time").invoke("Write a short poem about the sea.")
    [call] = message.tool_calls
    assert call["name"] == "get_time" and isinstance(call["args"]["city"], str)
