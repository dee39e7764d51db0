"""POST /tokenize and POST /detokenize, as vLLM names them: the served tokenizer, nothing else.

/tokenize takes `prompt` text, or `messages` rendered by the chat template exactly as
/v1/chat/completions renders them, and answers `{"tokens", "count", "max_model_len"}`; /detokenize
takes `tokens` and answers `{"prompt"}` (special tokens kept, so that the text round-trips).
"""

from __future__ import annotations

from candelabra.core.engine.tokenizer import ChatTemplateError
from candelabra.core.server.errors import bad_request
from candelabra.core.server.protocol import DetokenizeRequest, TokenizeRequest
from candelabra.core.server.serving import ServedModel, check_model
from candelabra.core.server.tool_calls.shapes import message_for_template


def tokenize(served: ServedModel, request: TokenizeRequest) -> dict:
    check_model(served, request.model)
    if request.prompt is None and request.messages is None:
        raise bad_request("send prompt (text) or messages (a chat)", "prompt")
    if request.prompt is not None and request.messages is not None:
        raise bad_request("send prompt or messages, not both", "messages")
    tokenizer = served.tokenizer
    if request.prompt is not None:
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        tokens = tokenizer.encode(request.prompt, add_special_tokens=add_special)
    else:
        if not request.messages:
            raise bad_request("messages must contain at least one message", "messages")
        template_kwargs = {} if served.defaults.thinking is None else {"enable_thinking": served.defaults.thinking}
        template_kwargs.update(request.chat_template_kwargs or {})
        try:
            text = tokenizer.render_chat([message_for_template(m.for_template()) for m in request.messages],
                                         request.add_generation_prompt, tools=_tools(request), **template_kwargs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        tokens = tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))
    return {"tokens": tokens, "count": len(tokens), "max_model_len": served.max_model_len}


def _tools(request: TokenizeRequest) -> list[dict] | None:
    return [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None


def detokenize(served: ServedModel, request: DetokenizeRequest) -> dict:
    check_model(served, request.model)
    vocab = served.vocab_size
    outside = [token for token in request.tokens if token >= vocab]
    if outside:
        raise bad_request(f"token id {outside[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": served.tokenizer.decode(request.tokens, skip_special_tokens=False)}
