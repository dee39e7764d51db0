"""Embeddings, /tokenize and /detokenize: the pooled vectors against transformers on the in-tree
backends, the pooling path's batching and block borrowing, and the live server driven by the real
`openai` client (embeddings) and httpx (tokenizing)."""

import base64

import httpx
import numpy as np
import openai
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.conformance.embedding_cases import run_embedding_case
from candelabra.conformance.model_cases import MODEL_CASES
from candelabra.core.engine.pooling import CacheBusy, embed
from candelabra.core.models.base import DecoderModel
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.worker.model_runner import ModelRunner

ARCHITECTURE_CASES = ["llama", "mistral-sliding-window", "qwen3", "gemma2", "phi3-longrope-long-prompt", "phi2",
                      "stablelm-parallel", "glm4"]


def _case(name):
    return next(c for c in MODEL_CASES if c.name == name)


def _backend(name):
    if name == "torch":
        from candelabra.backends.torch.backend import TorchBackend

        return TorchBackend()
    return CpuBackend()


# ---- conformance of the pooled vectors


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", ARCHITECTURE_CASES)
def test_pooled_vectors_match_transformers(backend, case):
    result = run_embedding_case(_backend(backend), _case(case), seed=11)
    assert result.status == "passed", result.message
    assert set(result.nmse) == {"mean", "last"}


def test_a_subtly_wrong_model_fails_the_embedding_check(monkeypatch):
    monkeypatch.setattr(DecoderModel, "rotary_style", "gptj")
    result = run_embedding_case(CpuBackend(), _case("qwen2"), seed=11)
    assert result.status == "failed" and "pooling NMSE" in result.message


# ---- the pooling path


@pytest.fixture(scope="module")
def tiny_runner():
    """A tiny qwen2 model on the cpu backend with a cache of 8 blocks of 4."""
    import tempfile

    from candelabra.conformance.model_cases import make_reference
    from candelabra.core.loading.model import load_model
    from candelabra.core.weights.safetensors import SafetensorsCheckpoint

    reference = make_reference(_case("qwen2"), seed=3)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        with SafetensorsCheckpoint(folder) as checkpoint:
            model = load_model(checkpoint, CpuBackend(), "float32")
    return ModelRunner(model, num_blocks=8, block_size=4)


INPUTS = [[5, 6, 7], list(range(10, 21)), [9], list(range(30, 36))]


def test_chunked_and_batched_forwards_pool_as_one(tiny_runner):
    blocks = BlockManager(8, 4)
    whole = [embed(tiny_runner, blocks, [tokens], pooling) for tokens in INPUTS for pooling in ("mean", "last")]
    batched = [embed(tiny_runner, blocks, INPUTS, pooling, max_batch_tokens=8, chunk_tokens=3)
               for pooling in ("mean", "last")]
    for i in range(len(INPUTS)):
        np.testing.assert_allclose(batched[0][i], whole[2 * i][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(batched[1][i], whole[2 * i + 1][0], rtol=1e-5, atol=1e-6)
    assert blocks.num_free_blocks == 8


def test_normalize_off_keeps_the_scale(tiny_runner):
    blocks = BlockManager(8, 4)
    raw = embed(tiny_runner, blocks, INPUTS[:2], "mean", normalize=False)
    unit = embed(tiny_runner, blocks, INPUTS[:2], "mean")
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1, rtol=1e-6)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), unit, rtol=1e-5, atol=1e-6)


def test_borrowed_blocks_leave_running_sequences_and_the_prefix_cache_alone(tiny_runner):
    blocks = BlockManager(8, 4)
    blocks.allocate(0, list(range(40, 52)))  # a running sequence holds 3 blocks
    blocks.mark_computed(0, 12)
    held = blocks.block_table(0)
    embed(tiny_runner, blocks, [list(range(40, 52))], "mean")  # the same tokens: no prefix reuse either
    assert blocks.block_table(0) == held and blocks.num_free_blocks == 5
    with pytest.raises(CacheBusy, match="no room"):
        embed(tiny_runner, blocks, [list(range(24))], "mean")  # 6 blocks, 5 free
    assert blocks.num_free_blocks == 5


# ---- the live server


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)


def _post(live_server, path, body):
    return httpx.post(f"{live_server.url}{path}", json=body, timeout=30)


def test_embeddings_float_and_base64_agree(client, live_server):
    floats = client.embeddings.create(model=live_server.model, input="w10 w11 w12", encoding_format="float")
    encoded = _post(live_server, "/v1/embeddings", {"input": "w10 w11 w12", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), "<f4")
    by_client = client.embeddings.create(model=live_server.model, input="w10 w11 w12")  # base64 on the wire
    vector = np.array(floats.data[0].embedding, np.float32)
    assert floats.object == "list" and floats.model == "tiny-chat" and floats.data[0].object == "embedding"
    np.testing.assert_array_equal(decoded, vector)
    np.testing.assert_array_equal(np.array(by_client.data[0].embedding, np.float32), vector)
    assert np.linalg.norm(vector) == pytest.approx(1, abs=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 3


def test_batched_text_and_token_ids_embed_alike(client, live_server):
    tokenized = _post(live_server, "/tokenize", {"prompt": "w10 w11 w12"}).json()
    texts = client.embeddings.create(model=live_server.model, input=["w10 w11 w12", "w40", "w50 w51"])
    ids = client.embeddings.create(model=live_server.model, input=[tokenized["tokens"], [7, 8]])
    one = client.embeddings.create(model=live_server.model, input=tokenized["tokens"])
    assert [d.index for d in texts.data] == [0, 1, 2]
    assert texts.usage.prompt_tokens == 6 and ids.usage.prompt_tokens == 5
    np.testing.assert_allclose(texts.data[0].embedding, ids.data[0].embedding, atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, ids.data[0].embedding, atol=1e-6)
    assert not np.allclose(texts.data[0].embedding, texts.data[1].embedding)


def test_embeddings_between_steps_leave_generation_unchanged(client, live_server):
    request = {"model": live_server.model, "prompt": "w10 w11 w12", "temperature": 0, "max_tokens": 40,
               "logit_bias": {"0": -100, "1": -100}, "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**request).choices[0].text
    stream = client.completions.create(stream=True, **request)
    pieces = [next(stream).choices[0].text]
    during = client.embeddings.create(model=live_server.model, input=["w10 w11 w12", "w60 " * 40])
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(pieces) == alone
    assert len(during.data) == 2


def test_pooling_and_normalize_extras(client, live_server):
    def vector(**extra):
        reply = client.embeddings.create(model=live_server.model, input="w10 w11 w12", encoding_format="float",
                                         extra_body=extra)
        return np.array(reply.data[0].embedding)

    mean, last, raw = vector(), vector(pooling="last"), vector(normalize=False)
    assert not np.allclose(mean, last)
    assert np.linalg.norm(raw) != pytest.approx(1, abs=1e-3)
    np.testing.assert_allclose(raw / np.linalg.norm(raw), mean, atol=1e-5)
    np.testing.assert_allclose(vector(pooling="mean"), mean, atol=1e-6)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["w1", ""]}, "input", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": [1, 100000]}, "input", "token ids must lie in"),
    ({"input": "w1", "dimensions": 8}, "dimensions", "hidden size"),
    ({"input": "w1", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "w1", "pooling": "max"}, "pooling", ""),
    ({"input": "w1", "model": "other"}, "model", "not served here"),
    ({}, "input", "required"),
])
def test_bad_embedding_requests_name_the_field(live_server, body, param, says):
    reply = _post(live_server, "/v1/embeddings", body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and says in error["message"], error


def test_inputs_longer_than_the_context_are_refused(live_server):
    context = _post(live_server, "/tokenize", {"prompt": "w1"}).json()["max_model_len"]
    fits = _post(live_server, "/v1/embeddings", {"input": [[7] * context]})
    reply = _post(live_server, "/v1/embeddings", {"input": [[7], [7] * (context + 1)]})
    error = reply.json()["error"]
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == context
    assert reply.status_code == 400 and error["param"] == "input" and error["code"] == "context_length_exceeded"
    assert f"input[1] has {context + 1} tokens" in error["message"]


def test_the_client_sees_a_bad_request(client, live_server):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=live_server.model, input="w10", dimensions=3)


def test_tokenize_and_detokenize_round_trip(live_server):
    tokens = _post(live_server, "/tokenize", {"prompt": "w10 w11 w12"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 3 and tokens["max_model_len"] > 3
    assert _post(live_server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "w10 w11 w12"}
    chat = _post(live_server, "/tokenize", {"messages": [{"role": "user", "content": "w30 w31"}]}).json()
    # The template renders "w5 w30 w31 w6", as the chat route's prompt
    assert chat["count"] == 4
    assert _post(live_server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"] == "w5 w30 w31 w6"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "w1", "messages": [{"role": "user", "content": "w1"}]}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "w1"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "w1"}]}, "messages.0.tool_call_id"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens.1"),
    ("/detokenize", {"tokens": [100000]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_tokenize_bodies_name_the_field(live_server, path, body, param):
    reply = _post(live_server, path, body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
