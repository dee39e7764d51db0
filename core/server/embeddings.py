"""POST /v1/embeddings, as OpenAI serves it: the served model's pooled, final-normed hidden states.

Texts are tokenized here, on the event loop, and every input is checked before any work is queued;
the forwards run on the engine thread between two steps (see core/engine/pooling.py), so they never
race generation. `encoding_format` "base64" sends each vector as its little-endian float32 bytes,
as OpenAI does (the `openai` client asks for it by default). `dimensions` is accepted only when it
equals the model's hidden size: a decoder's hidden states are not trained for truncation, so
cutting them shorter is refused rather than done quietly. Under tensor parallelism the route
answers 501.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse

from candelabra.core.engine.async_engine import EngineStopping
from candelabra.core.engine.pooling import CacheBusy, PoolingUnsupported, embed_with_engine
from candelabra.core.server.errors import APIError, bad_request
from candelabra.core.server.protocol import EmbeddingRequest
from candelabra.core.server.serving import ServedModel, check_model


async def create_embeddings(served: ServedModel, request: EmbeddingRequest, default_pooling: str = "mean"):
    """The response body of one embeddings request; APIError for a bad one."""
    check_model(served, request.model)
    engine = served.engine.llm_engine
    if engine.model.communicator is not None:
        raise APIError(501, "embeddings are not supported under tensor parallelism (more than one of --device-ids)"
                            " yet",
                       code="not_implemented")
    hidden_size = engine.model.config.hidden_size
    if request.dimensions is not None and request.dimensions != hidden_size:
        raise bad_request(f"dimensions must be the model's hidden size ({hidden_size}) or left out; this server "
                          f"does not shorten embeddings (got {request.dimensions})", "dimensions")
    items = request.inputs()
    inputs = [_token_ids(served, item, "input" if len(items) == 1 else f"input[{position}]")
              for position, item in enumerate(items)]
    pooling = request.pooling or default_pooling
    try:
        vectors = await served.engine.run_between_steps(
            lambda engine: embed_with_engine(engine, inputs, pooling, request.normalize))
    except CacheBusy as exc:
        raise APIError(503, str(exc), code="server_busy", headers={"Retry-After": "1"}) from exc
    except PoolingUnsupported as exc:
        raise APIError(501, str(exc), code="not_implemented") from exc
    except EngineStopping as exc:
        raise APIError(503, str(exc)) from exc
    num_tokens = sum(len(tokens) for tokens in inputs)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, request.encoding_format)}
            for i, vector in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": served.name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


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
                          f"({served.max_model_len} tokens)", "input", "context_length_exceeded")
    capacity = engine.config.num_blocks * engine.config.block_size
    if len(tokens) > capacity:
        raise bad_request(f"{label} has {len(tokens)} tokens, more than the KV cache holds ({capacity} "
                          "tokens); give the cache more memory", "input", "context_length_exceeded")
    return tokens


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()

