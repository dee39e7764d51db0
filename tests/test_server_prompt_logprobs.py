"""Prompt logprobs over HTTP, through the real `openai` client: /v1/completions with echo and
logprobs in OpenAI's legacy shape, and vLLM's prompt_logprobs on completions and chat completions,
checked against transformers' log-softmax of the served model's own logits."""

import json

import numpy as np
import openai
import pytest

from live_server import write_chat_checkpoint
from transformers_reference import log_softmax_at_each_position

PROMPT = [80, 81, 5, 93, 47, 12, 130]
NO_SPECIAL = {"0": -100, "1": -100}  # <unk> and <eos> leave no text: keep the generated text in words
# float32 logits through different summation orders agree to about this much
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The live server's checkpoint, written again from the same seed."""
    return write_chat_checkpoint(tmp_path_factory.mktemp("same-weights"))


@pytest.fixture(scope="module")
def reference(folder):
    """Transformers' log-softmax at each position of a prompt, on the served model's weights."""
    return log_softmax_at_each_position(folder)


def test_echo_with_logprobs_covers_the_prompt_then_the_output(client, live_server, reference):
    choice = client.completions.create(model=live_server.model, prompt=PROMPT, echo=True, logprobs=3, max_tokens=4,
                                       temperature=0, logit_bias=NO_SPECIAL).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(PROMPT) + 4
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(" ".join(f"w{t}" for t in PROMPT))
    assert all(choice.text[at:at + len(token)] == token for at, token in zip(lp.text_offset, lp.tokens))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = reference(PROMPT)
    for position in range(1, len(PROMPT)):
        row = expected[position - 1]
        assert lp.token_logprobs[position] == pytest.approx(row[PROMPT[position]], abs=TOLERANCE)
        top = lp.top_logprobs[position]
        assert len(top) == 3
        np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(row)[::-1][:3], atol=TOLERANCE)
        assert set(top) == {f" w{t}" for t in np.argsort(-row)[:3]}

    chunks = list(client.completions.create(model=live_server.model, prompt=PROMPT, echo=True, logprobs=3,
                                            max_tokens=4, temperature=0, logit_bias=NO_SPECIAL, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed[0].tokens) > len(PROMPT)  # the prompt's part comes with the first chunk
    assert [t for part in streamed for t in part.tokens] == lp.tokens
    assert [o for part in streamed for o in part.text_offset] == lp.text_offset
    assert [v for part in streamed for v in part.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_echo_with_max_tokens_0_returns_the_scored_prompt_and_generates_nothing(client, live_server, reference):
    whole = client.completions.create(model=live_server.model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice, lp = whole.choices[0], whole.choices[0].logprobs
    assert choice.text == " ".join(f"w{t}" for t in PROMPT) and choice.finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPT), 0)
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = reference(PROMPT)
    assert lp.token_logprobs[1:] == pytest.approx([expected[p - 1][PROMPT[p]] for p in range(1, len(PROMPT))],
                                                  abs=TOLERANCE)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])

    chunks = list(client.completions.create(model=live_server.model, prompt=PROMPT, echo=True, logprobs=2,
                                            max_tokens=0, stream=True, stream_options={"include_usage": True}))
    [only] = [c.choices[0] for c in chunks if c.choices]
    assert (only.text, only.finish_reason, only.logprobs.tokens) == (choice.text, "length", lp.tokens)
    assert chunks[-1].usage.completion_tokens == 0

    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens" and "nothing to return" in caught.value.body["message"]


def test_vllm_prompt_logprobs_on_completions(client, live_server, reference):
    response = client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    entries = response.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    expected = reference(PROMPT)
    for position in range(1, len(PROMPT)):
        row, token, entry = expected[position - 1], PROMPT[position], entries[position]
        best = [int(t) for t in np.argsort(-row)[:2]]
        assert set(entry) == {str(t) for t in {*best, token}}  # the scored token is always there
        assert entry[str(token)]["logprob"] == pytest.approx(row[token], abs=TOLERANCE)
        assert entry[str(token)]["rank"] == 1 + int(np.sum(row > row[token]))
        assert entry[str(token)]["decoded_token"] == f" w{token}"
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]

    streamed = list(client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=2, temperature=0,
                                              stream=True, extra_body={"prompt_logprobs": 2}))
    assert streamed[0].model_dump()["choices"][0]["prompt_logprobs"] == entries


def test_vllm_prompt_logprobs_on_chat(client, live_server):
    messages = [{"role": "user", "content": "w30 w31 w32"}]
    whole = client.chat.completions.create(model=live_server.model, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 0})
    entries = whole.model_dump()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == whole.usage.prompt_tokens
    assert all(len(entry) in (1, 2) and all(v["logprob"] <= 0 for v in entry.values()) for entry in entries[1:])
    stream = client.chat.completions.create(model=live_server.model, messages=messages, max_tokens=2, temperature=0,
                                            stream=True, extra_body={"prompt_logprobs": 0})
    first = next(iter(stream)).model_dump()
    assert first["prompt_logprobs"] == entries


def test_impossible_prompt_tokens_get_the_lowest_logprob_not_infinity(folder):
    """JSON has no -inf: a token the model rules out reads as OpenAI's floor, in both shapes."""
    from candelabra.core.engine.engine import RequestOutput
    from candelabra.core.engine.prompt_logprobs import Logprob
    from candelabra.core.engine.tokenizer import Tokenizer
    from candelabra.core.server.serving import LOWEST_LOGPROB, _echo_logprobs, _vllm_prompt_logprobs
    from candelabra.core.weights.safetensors import SafetensorsCheckpoint

    tokenizer = Tokenizer.from_checkpoint(SafetensorsCheckpoint(folder))
    scores = {7: Logprob(float("-inf"), 160, " w7"), 9: Logprob(-0.01, 1, " w9")}
    output = RequestOutput("r", [5, 7], [], True, prompt_logprobs=[None, scores])
    echoed = _echo_logprobs(tokenizer, output, 1)
    assert echoed["tokens"] == ["w5", " w7"] and echoed["token_logprobs"] == [None, LOWEST_LOGPROB]
    assert echoed["top_logprobs"] == [None, {" w9": -0.01}] and echoed["text_offset"] == [0, 2]
    assert _vllm_prompt_logprobs(output, 1)[1]["7"] == {"logprob": LOWEST_LOGPROB, "rank": 160,
                                                        "decoded_token": " w7"}
    json.dumps(_vllm_prompt_logprobs(output, 1), allow_nan=False)


@pytest.mark.parametrize("bad", [21, -1])
def test_out_of_range_prompt_logprobs_are_400_naming_the_field(client, live_server, bad):
    for call in (lambda: client.completions.create(model=live_server.model, prompt="w5",
                                                   extra_body={"prompt_logprobs": bad}),
                 lambda: client.chat.completions.create(model=live_server.model, messages=[{"role": "user",
                                                                                            "content": "w5"}],
                                                        extra_body={"prompt_logprobs": bad})):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.body["param"] == "prompt_logprobs"
