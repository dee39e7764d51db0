"""The OpenAI-compatible server, live on 127.0.0.1, driven by the real `openai` client."""

import asyncio
import json
import os
import socket
import time

import httpx
import openai
import pytest

from live_server import LiveServer, write_chat_checkpoint

MESSAGES = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]
# Neither <unk> (0) nor <eos> (1): both are special, so they would leave no word in the text.
WORDS_ONLY = {"0": -100, "1": -100}
WORDS = {"logit_bias": WORDS_ONLY, "extra_body": {"ignore_eos": True}}
GREEDY = {"temperature": 0, "max_tokens": 12, **WORDS}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)


def words(n: int, start: int = 10) -> str:
    return " ".join(f"w{start + i % 140}" for i in range(n))


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---- chat


def test_chat_answers_and_counts_usage(client, live_server):
    reply = client.chat.completions.create(model=live_server.model, messages=MESSAGES, **GREEDY)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "tiny-chat"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.message.content.split()) == 12
    # The template renders "w4 w20 w21 w5 w30 w31 w32 w6": 8 prompt tokens.
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (8, 12, 20)


def test_chat_stream_matches_the_whole_reply(client, live_server):
    whole = client.chat.completions.create(model=live_server.model, messages=MESSAGES, **GREEDY)
    stream = client.chat.completions.create(model=live_server.model, messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    text, chunks = stream_text(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens_and_n(client, live_server):
    reply = client.chat.completions.create(model=live_server.model, messages=MESSAGES, n=3, seed=5,
                                           max_completion_tokens=6, **WORDS)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert all(len(c.message.content.split()) == 6 for c in reply.choices)
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == 18


def test_the_same_seed_gives_the_same_sample_and_another_seed_a_different_one(client, live_server):
    def sample(seed):
        return client.chat.completions.create(model=live_server.model, messages=MESSAGES, temperature=1.0,
                                              seed=seed, max_tokens=16).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_strings_in_every_form(client, live_server):
    text = client.completions.create(model=live_server.model, prompt="w40 w41", temperature=0, max_tokens=10,
                                     **WORDS).choices[0].text
    stop_word = text.split()[3]
    expected = text[:text.index(" " + stop_word)]
    for stop in (stop_word, [stop_word, "w999"]):
        choice = client.completions.create(model=live_server.model, prompt="w40 w41", temperature=0, max_tokens=10,
                                           stop=stop, **WORDS).choices[0]
        assert (choice.text.rstrip(), choice.finish_reason) == (expected, "stop")
    for candle_form in ({"Single": stop_word}, {"Multiple": [stop_word]}):
        body = {"prompt": "w40 w41", "temperature": 0, "max_tokens": 10, "ignore_eos": True, "stop": candle_form,
                "logit_bias": WORDS_ONLY}
        choice = httpx.post(f"{live_server.url}/v1/completions", json=body).json()["choices"][0]
        assert (choice["text"].rstrip(), choice["finish_reason"]) == (expected, "stop")


def test_chat_logprobs_spell_the_reply_with_descending_top_logprobs_led_by_the_chosen_token(client, live_server):
    reply = client.chat.completions.create(model=live_server.model, messages=MESSAGES, logprobs=True,
                                           top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == 12
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())


# ---- completions


def test_completion_prompt_forms_agree(client, live_server):
    as_text = client.completions.create(model=live_server.model, prompt="w50 w51 w52", temperature=0,
                                        max_tokens=8, **WORDS)
    as_ids = client.completions.create(model=live_server.model, prompt=[50, 51, 52], temperature=0, max_tokens=8,
                                       **WORDS)
    as_list = client.completions.create(model=live_server.model, prompt=["w60", "w50 w51 w52"], temperature=0,
                                        max_tokens=8, **WORDS)
    assert as_text.choices[0].text == as_ids.choices[0].text == as_list.choices[1].text
    assert [c.index for c in as_list.choices] == [0, 1]
    assert as_list.usage.prompt_tokens == 4 and as_list.usage.completion_tokens == 16


def test_completion_echo_and_stream(client, live_server):
    whole = client.completions.create(model=live_server.model, prompt="w70 w71", temperature=0, max_tokens=6,
                                      echo=True, **WORDS)
    assert whole.choices[0].text.startswith("w70 w71")
    chunks = list(client.completions.create(model=live_server.model, prompt="w70 w71", temperature=0, max_tokens=6,
                                            echo=True, stream=True, **WORDS))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_line_up_with_the_text_and_stream_the_same_as_whole(client, live_server):
    choice = client.completions.create(model=live_server.model, prompt="w80 w81", temperature=0, max_tokens=5,
                                       logprobs=2, **WORDS).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == choice.text
    assert all(choice.text[at:at + len(token)] == token for at, token in zip(lp.text_offset, lp.tokens))
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[token] == pytest.approx(logprob) and logprob == max(top.values())
    chunks = list(client.completions.create(model=live_server.model, prompt="w80 w81", temperature=0, max_tokens=5,
                                            logprobs=2, stream=True, **WORDS))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == lp.tokens
    assert [o for lp in streamed for o in lp.text_offset] == lp.text_offset


# ---- errors


def bad_request(call) -> openai.APIStatusError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    return caught.value


def test_invalid_requests_are_400_in_openai_shape(client, live_server):
    chat = client.chat.completions.create
    error = bad_request(lambda: chat(model=live_server.model, messages=MESSAGES, temperature=-1))
    assert error.body["param"] == "temperature"
    error = bad_request(lambda: chat(model=live_server.model, messages=MESSAGES, top_p=1.5))
    assert error.body["param"] == "top_p"
    error = bad_request(lambda: chat(model="no-such-model", messages=MESSAGES))
    assert error.body["code"] == "model_not_found" and "tiny-chat" in error.body["message"]
    error = bad_request(lambda: chat(model=live_server.model, messages=[]))
    assert error.body["param"] == "messages"
    error = bad_request(lambda: chat(model=live_server.model, messages=MESSAGES, logit_bias={"abc": 1}))
    assert error.body["param"] == "logit_bias"
    error = bad_request(lambda: chat(model=live_server.model, messages=MESSAGES, n=0))
    assert error.body["param"] == "n"
    tool_result = {"role": "tool", "tool_call_id": "call_1", "content": "w1"}
    error = bad_request(lambda: chat(model=live_server.model, messages=[tool_result]))
    assert "template" in error.body["message"]
    error = bad_request(lambda: client.completions.create(model=live_server.model, prompt=[]))
    assert error.body["param"] == "prompt"
    error = bad_request(lambda: client.completions.create(model=live_server.model, prompt=[999]))
    assert "[0, 160)" in error.body["message"]


def test_tool_history_without_a_call_id_or_with_arguments_not_as_json_text_is_refused_naming_the_field(
        client, live_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    history = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "content": "w2"}]
    error = bad_request(lambda: client.chat.completions.create(model=live_server.model, messages=history))
    assert error.body["param"] == "messages.2.tool_call_id" and '"tool"' in error.body["message"]
    history[1]["tool_calls"] = [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]
    history[2]["tool_call_id"] = "call_1"
    error = bad_request(lambda: client.chat.completions.create(model=live_server.model, messages=history))
    assert error.body["param"] == "messages.1.tool_calls.0.function.arguments"
    assert "not an object" in error.body["message"]


def test_prompt_plus_max_tokens_over_the_context_names_both(client, live_server):
    error = bad_request(lambda: client.completions.create(model=live_server.model, prompt=words(500),
                                                          max_tokens=100))
    message = error.body["message"]
    assert "500 tokens" in message and "100" in message and "512" in message
    assert error.body["code"] == "context_length_exceeded"
    error = bad_request(lambda: client.completions.create(model=live_server.model, prompt=words(600)))
    assert "600 tokens" in error.body["message"] and "512" in error.body["message"]


def test_malformed_bodies_are_400s_and_unknown_paths_404s_with_an_error_message(live_server):
    url = f"{live_server.url}/v1/chat/completions"
    for content, expected in ((b"{not json", "not valid JSON"), (b"[1, 2]", None), (b"{}", "messages")):
        response = httpx.post(url, content=content, headers={"content-type": "application/json"})
        error = response.json()["error"]
        assert response.status_code == 400 and error["type"] == "invalid_request_error"
        assert expected is None or expected in error["message"]
    response = httpx.post(url, json={"messages": [{"role": "robot", "content": "w1"}]})
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages.0.role")
    response = httpx.get(f"{live_server.url}/v1/nowhere")
    assert response.status_code == 404 and "message" in response.json()["error"]


def test_the_server_keeps_serving_after_failed_requests(client, live_server):
    for _ in range(3):
        bad_request(lambda: client.chat.completions.create(
            model=live_server.model, messages=[{"role": "tool", "tool_call_id": "call_1", "content": "w1"}]))
    assert httpx.get(f"{live_server.url}/health").json() == {"status": "ok"}
    assert client.chat.completions.create(model=live_server.model, messages=MESSAGES, **GREEDY).choices


# ---- models, health, metrics


def test_models_lists_and_retrieves_only_the_served_model_and_health_answers_200(client, live_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    assert models.data[0].max_model_len == 512
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(f"{live_server.url}/health").status_code == 200


def test_metrics_count_tokens_and_latencies(client, live_server):
    before = live_server.metric("candelabra_generation_tokens_total")
    requests_before = live_server.metric("candelabra_e2e_request_latency_seconds_count")
    client.chat.completions.create(model=live_server.model, messages=MESSAGES, **GREEDY)
    assert live_server.metric("candelabra_generation_tokens_total") == before + 12
    assert live_server.metric("candelabra_e2e_request_latency_seconds_count") == requests_before + 1
    text = httpx.get(f"{live_server.url}/metrics").text
    for name in ("candelabra_requests_running", "candelabra_requests_waiting", "candelabra_kv_cache_usage_ratio",
                 "candelabra_prompt_tokens_total", "candelabra_time_to_first_token_seconds_bucket",
                 "candelabra_inter_token_latency_seconds_bucket", "candelabra_e2e_request_latency_seconds_bucket"):
        assert name in text


# ---- thinking


def test_thinking_goes_to_reasoning_content(client, live_server):
    # "<think>" and "</think>" are tokens 158 and 159 here; the bias makes the thought end mid-reply.
    bias = {**WORDS_ONLY, "158": -100, "159": 4.0}
    options = {"temperature": 0, "max_tokens": 16,
               "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
               "logit_bias": bias}
    reply = client.chat.completions.create(model=live_server.model, messages=MESSAGES, **options)
    raw = client.completions.create(model=live_server.model, prompt="w4 w20 w21 w5 w30 w31 w32 w6 <think>",
                                    temperature=0, max_tokens=16, logit_bias=bias,
                                    extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0].text
    thought, _, answer = raw.partition("</think>")
    assert thought.strip() and answer.strip(), f"the bias should end the thought mid-reply: {raw!r}"
    message = reply.choices[0].message
    assert message.reasoning_content == thought and message.content == answer.lstrip()

    chunks = list(client.chat.completions.create(model=live_server.model, messages=MESSAGES, stream=True,
                                                 **options))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer.lstrip()
    no_thinking = client.chat.completions.create(model=live_server.model, messages=MESSAGES, **GREEDY)
    assert getattr(no_thinking.choices[0].message, "reasoning_content", None) is None


# ---- load and disconnects


def test_32_concurrent_streams_give_the_lone_greedy_texts(client, live_server):
    prompts = [words(3 + i % 7, start=10 + 3 * i) for i in range(32)]
    alone = [client.completions.create(model=live_server.model, prompt=p, temperature=0, max_tokens=16,
                                       **WORDS).choices[0].text for p in prompts]
    aclient = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)

    async def one(prompt):
        stream = await aclient.completions.create(model=live_server.model, prompt=prompt, temperature=0,
                                                  max_tokens=16, stream=True, **WORDS)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(all_at_once()) == alone


def wait_for(condition, timeout=20.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(live_server):
    aborted_before = _finished(live_server, "abort")
    body = {"prompt": words(40), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live_server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines)]
        assert any(line.startswith("data: {") for line in received)
        assert live_server.metric("candelabra_kv_cache_used_blocks") > 0
    assert wait_for(lambda: live_server.metric("candelabra_kv_cache_used_blocks") == 0)
    assert live_server.metric("candelabra_requests_running") == 0
    assert _finished(live_server, "abort") == aborted_before + 1


def test_a_client_that_gives_up_on_a_whole_response_frees_its_blocks(live_server):
    """The client hangs up once the server reports its request running, whatever the machine's
    speed; the server notices at once, aborts the request and frees its blocks."""
    aborted_before = _finished(live_server, "abort")
    body = json.dumps({"prompt": words(40), "max_tokens": 450, "ignore_eos": True}).encode()
    host, port = httpx.URL(live_server.url).host, httpx.URL(live_server.url).port
    with socket.create_connection((host, port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: live_server.metric("candelabra_requests_running") == 1, timeout=60, interval=0)
    assert wait_for(lambda: _finished(live_server, "abort") == aborted_before + 1)
    assert live_server.metric("candelabra_kv_cache_used_blocks") == 0
    assert live_server.metric("candelabra_requests_running") == 0


def _finished(server, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith("candelabra_requests_finished_total") and f'finish_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- servers with other flags


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def test_api_key_is_required_when_set(chat_checkpoint):
    args = ("--weight-path", str(chat_checkpoint), "--backend", "cpu", "--kvcache-mem-gpu", "2")
    with LiveServer(*args, env={"CANDELABRA_API_KEY": "sesame"}) as server:
        assert "API key   required" in server.startup
        for key in ("wrong", "sesam", "sesame-and-more"):
            with pytest.raises(openai.AuthenticationError) as caught:
                openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0).models.list()
            assert caught.value.body["type"] == "authentication_error"
        missing = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES})
        assert missing.status_code == 401 and "Authorization" in missing.json()["error"]["message"]
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        assert good.chat.completions.create(model=server.model, messages=MESSAGES, **GREEDY).choices
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_full_queue_answers_503_with_retry_after(chat_checkpoint):
    args = ("--weight-path", str(chat_checkpoint), "--backend", "cpu", "--kvcache-mem-gpu", "2",
            "--max-num-seqs", "1", "--max-waiting", "1")
    with LiveServer(*args) as server:
        url = f"{server.url}/v1/completions"
        long = {"prompt": words(20), "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=long) as running:
            running_lines = running.iter_lines()  # kept: dropping the iterator would close the stream
            next(running_lines)
            with httpx.stream("POST", url, json=long) as waiting:
                assert waiting.status_code == 200
                assert wait_for(lambda: server.metric("candelabra_requests_waiting") == 1)
                refused = httpx.post(url, json={**long, "stream": False})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "server_busy"
        assert wait_for(lambda: server.metric("candelabra_kv_cache_used_blocks") == 0)
        ok = httpx.post(url, json={"prompt": "w3", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_serve_on_the_metal_backend(chat_checkpoint):
    with LiveServer("--weight-path", str(chat_checkpoint), "--backend", "metal", "--kvcache-mem-gpu", "2") as server:
        assert "backend   metal" in server.startup
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=server.model, messages=MESSAGES, **GREEDY)
        assert len(reply.choices[0].message.content.split()) == 12


def test_serve_refuses_bad_flags_with_one_line(chat_checkpoint):
    from support import run_candelabra

    result = run_candelabra("serve", "--weight-path", str(chat_checkpoint), "--quant", "q7k")
    assert result.returncode == 2 and "--quant q7k is not known" in result.stderr
    result = run_candelabra("serve", "--weight-path", str(chat_checkpoint), "--quant", "gptq", "--backend", "cpu")
    assert result.returncode == 1 and "--quant gptq serves GPTQ checkpoints" in result.stderr
    assert "is not quantized" in result.stderr
    result = run_candelabra("serve", "--weight-path", str(chat_checkpoint), "--device-ids", "0,0")
    assert result.returncode == 2 and "--device-ids 0,0: a device is named twice" in result.stderr
    result = run_candelabra("serve", "--weight-path", str(chat_checkpoint / "missing"), "--port", "0")
    assert result.returncode == 1 and "does not exist" in result.stderr
    result = run_candelabra("serve", "--weight-path", str(chat_checkpoint), "llama3", "--port", "0",
                            "--backend", "cpu")
    assert result.returncode == 1 and "llama3" in result.stderr


def test_serve_without_the_default_model_says_how_to_install_it(tmp_path):
    import subprocess
    import sys

    hide_chunks = ("import sys; import candelabra.core.weights.default_model as d; "
                   "d.CHUNKS = [('candelabra_no_such_chunk_package', 'model.part')]; "
                   "from candelabra.core.cli import main; sys.exit(main(['serve', '--port', '0']))")
    result = subprocess.run([sys.executable, "-c", hide_chunks], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CANDELABRA_CACHE": str(tmp_path)})
    assert result.returncode == 1
    assert "not installed" in result.stderr and "pip install 'candelabra[demo]'" in result.stderr


def test_sampling_flags_are_defaults_that_requests_override(chat_checkpoint):
    args = ("--weight-path", str(chat_checkpoint), "--backend", "cpu", "--kvcache-mem-gpu", "2",
            "--temperature", "0", "--max-gen-tokens", "5", "--thinking")
    with LiveServer(*args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model=server.model, prompt="w40 w41", **WORDS)
        explicit = client.completions.create(model=server.model, prompt="w40 w41", temperature=0, max_tokens=5,
                                             **WORDS)
        assert plain.usage.completion_tokens == 5 and plain.choices[0].text == explicit.choices[0].text
        longer = client.completions.create(model=server.model, prompt="w40 w41", max_tokens=9, **WORDS)
        assert longer.usage.completion_tokens == 9
        assert longer.choices[0].text.startswith(plain.choices[0].text)
        sampled = {client.completions.create(model=server.model, prompt="w40 w41", temperature=1.5, seed=s,
                                             **WORDS).choices[0].text for s in range(4)}
        assert len(sampled) > 1
        # --thinking opens the template's thought without the request asking.
        reply = client.chat.completions.create(model=server.model, messages=MESSAGES, **WORDS)
        assert reply.choices[0].message.reasoning_content is not None


def test_the_checkpoints_generation_config_sets_defaults_under_the_flags(tmp_path):
    folder = write_chat_checkpoint(tmp_path)
    (folder / "generation_config.json").write_text('{"temperature": 0.0, "top_k": 5, "do_sample": false}')
    with LiveServer("--weight-path", str(folder), "--backend", "cpu", "--kvcache-mem-gpu", "2") as server:
        assert "sampling  temperature 0.0, top_k 5 (requests may override)" in server.startup
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        texts = {client.completions.create(model=server.model, prompt="w40 w41", max_tokens=8, seed=s,
                                           **WORDS).choices[0].text for s in range(3)}
        greedy = client.completions.create(model=server.model, prompt="w40 w41", max_tokens=8, temperature=0,
                                           **WORDS).choices[0].text
        assert texts == {greedy}
    with LiveServer("--weight-path", str(folder), "--backend", "cpu", "--kvcache-mem-gpu", "2",
                    "--generation-config", "none", "--top-p", "0.9") as server:
        assert "sampling  top_p 0.9 (requests may override)" in server.startup


def test_a_server_scheduling_ahead_answers_concurrent_clients_as_one_in_turn(client, live_server, tmp_path):
    """`--async-scheduling` through the server: concurrent requests, streamed and whole, ending on their
    length, a stop string and an end token, get what the server stepping in turn gives them."""
    from concurrent.futures import ThreadPoolExecutor

    folder = tmp_path / "model"
    folder.mkdir()
    write_chat_checkpoint(folder)
    requests = [dict(prompt=words(5, 40), max_tokens=12, temperature=0, **WORDS),
                dict(prompt=words(9, 60), max_tokens=10, temperature=0.9, seed=4, **WORDS),
                dict(prompt=words(3, 80), max_tokens=12, temperature=0, stop=[" w90", " w91", " w92", " w93"]),
                dict(prompt=words(7, 20), max_tokens=8, temperature=0.7, seed=9, n=2, **WORDS)]

    def answers(some_client) -> list:
        def whole(request):
            reply = some_client.completions.create(model=live_server.model, **request)
            return [(c.text, c.finish_reason) for c in reply.choices]

        def streamed(request):
            chunks = list(some_client.completions.create(model=live_server.model, stream=True, **request))
            texts: dict[int, str] = {}
            for chunk in chunks:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
            return [texts[i] for i in sorted(texts)]

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(whole, requests)) + list(pool.map(streamed, requests))

    with LiveServer("--weight-path", str(folder), "--backend", "cpu", "--kvcache-mem-gpu", "4",
                    "--kvcache-mem-cpu", "1", "--served-model-name", "tiny-chat", "--async-scheduling") as ahead:
        ahead_client = openai.OpenAI(base_url=f"{ahead.url}/v1", api_key="unused", max_retries=0)
        got = answers(ahead_client)
    expected = answers(client)
    assert got == expected
    assert {reason for choices in expected[:4] for _, reason in choices} >= {"length", "stop"}
