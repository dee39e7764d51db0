"""POST /v1/embeddings, as OpenAI serves it: the served model's pooled, final-normed hidden states.

The number of inputs is checked first, then each text is tokenized (on a worker thread, so that
streams go on meanwhile) and checked in turn, the request refused at the first input over a bound
(core/server/limits.py). The forwards run on the engine thread, a slice a step beside generation
(core/engine/pooling.py); a client that disconnects aborts its request between two slices, and its
blocks go back. `encoding_format` "base64" sends each vector as its little-endian float32 bytes,
as OpenAI does (the `openai` client asks for it by default). `dimensions` is accepted only when it
equals the model's hidden size: a decoder's hidden states are not trained for truncation, so
cutting them shorter is refused rather than done quietly. Under tensor parallelism the route
answers 501.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from candelabra.core.engine.async_engine import EngineStopping
from candelabra.core.engine.pooling import PoolingJob, PoolingUnsupported, check_poolable
from candelabra.core.server.disconnect import ClientGone, unless_disconnected
from candelabra.core.server.errors import APIError, bad_request
from candelabra.core.server.protocol import EmbeddingRequest
from candelabra.core.server.serving import ServedModel, check_model
from candelabra.core.worker.failure import EngineFailure


async def create_embeddings(served: ServedModel, request: EmbeddingRequest, http: Request,
                            default_pooling: str = "mean"):
    """The response body of one embeddings request; APIError for a bad one."""
    check_model(served, request.model)
    try:
        check_poolable(served.engine.llm_engine)
    except PoolingUnsupported as exc:
        raise APIError(501, f"{exc} (more than one of --device-ids)", code="not_implemented") from exc
    hidden_size = served.engine.llm_engine.model.config.hidden_size
    if request.dimensions is not None and request.dimensions != hidden_size:
        raise bad_request(f"dimensions must be the model's hidden size ({hidden_size}) or left out; this server "
                          f"does not shorten embeddings (got {request.dimensions})", "dimensions")
    items = request.inputs()
    served.limits.check_count(len(items), "max_inputs", "input", "items")
    inputs = await asyncio.to_thread(_all_token_ids, served, items)
    job = PoolingJob(inputs, request.pooling or default_pooling, request.normalize)
    try:
        stream = served.engine.add_pooling(f"embd-{uuid.uuid4().hex}", job)
    except EngineStopping as exc:
        raise APIError(503, str(exc)) from exc
    try:
        pooled = await unless_disconnected(stream.result(), http)
    except ClientGone:
        raise APIError(499, "the client disconnected") from None
    except (EngineStopping, EngineFailure) as exc:
        raise APIError(503, str(exc)) from exc
    except ValueError as exc:  # the engine refused the request
        raise bad_request(str(exc), "input") from exc
    except RuntimeError as exc:  # a step failed, and every request in it
        raise APIError(500, str(exc)) from exc
    finally:
        stream.close()
    body = await asyncio.to_thread(_response_body, served.name, pooled.embeddings, pooled.num_tokens,
                                   request.encoding_format)
    return Response(body, media_type="application/json")


def _response_body(model: str, vectors: np.ndarray, num_tokens: int, encoding_format: str) -> bytes:
    """The answer's JSON, written a vector at a time on a worker thread. Written in one json.dumps on the
    event loop, 2,048 vectors as floats held every stream: their largest gap between two tokens beside
    that request was 111 ms, against 27 to 37 ms written so (tiny model, 2 cores)."""
    items = [json.dumps({"object": "embedding", "index": i, "embedding": _encoded(vector, encoding_format)})
             for i, vector in enumerate(vectors)]
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return (f'{{"object": "list", "data": [{", ".join(items)}], "model": {json.dumps(model)}, '
            f'"usage": {json.dumps(usage)}}}').encode()


def _all_token_ids(served: ServedModel, items: list[str | list[int]]) -> list[list[int]]:
    """Every input as token ids, tokenized in turn, up to the first one over a bound."""
    counter = served.limits.token_counter("input")
    inputs = []
    for position, item in enumerate(items):
        label = "input" if len(items) == 1 else f"input[{position}]"
        inputs.append(_token_ids(served, item, label))
        counter.add(len(inputs[-1]), label if len(items) > 1 else None)
    return inputs


def _token_ids(served: ServedModel, item: str | list[int], label: str) -> list[int]:
    """One input (`label` in messages) as token ids, checked against the vocabulary, the context and
    the KV cache."""
    engine = served.engine.llm_engine
    tokens = served.tokenizer.encode(item) if isinstance(item, str) else list(item)
    if not tokens:
        raise bad_request(f"{label} has no tokens", "input")
    vocab = served.vocab_size
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise bad_request(f"{label}: token ids must lie in [0, {vocab})", "input")
    if len(tokens) > served.max_model_len:
        raise bad_request(f"{label} has {len(tokens)} tokens, more than the model's context length "
                          f"({served.max_model_len} tokens; --max-model-len sets it)", "input",
                          "context_length_exceeded")
    capacity = engine.config.num_blocks * engine.config.block_size
    if len(tokens) > capacity:
        raise bad_request(f"{label} has {len(tokens)} tokens, more than the KV cache holds ({capacity} "
                          "tokens); give the cache more memory", "input", "context_length_exceeded")
    return tokens


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()

