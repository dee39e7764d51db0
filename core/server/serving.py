"""Turning OpenAI requests into engine requests, and engine outputs into OpenAI responses:
whole JSON bodies, or server-sent event streams of chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from candelabra.core.engine.async_engine import AsyncEngine, EngineStopping, RequestStream
from candelabra.core.engine.engine import CompletionOutput, RequestOutput
from candelabra.core.engine.prompt_logprobs import PIECE_CONTEXT, Logprob, token_piece
from candelabra.core.engine.tokenizer import ChatTemplateError
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.structured_output import StructuredOutputError
from candelabra.core.requests.tokens import SampledToken
from candelabra.core.server.disconnect import ClientGone, unless_disconnected
from candelabra.core.server.errors import APIError, bad_request, error_body
from candelabra.core.server.limits import RequestLimits
from candelabra.core.server.metrics import RequestTimer, ServerMetrics
from candelabra.core.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ConstraintError,
    GenerationRequest,
)
from candelabra.core.server.reasoning import ReasoningSplitter, opens_thinking, split_reasoning
from candelabra.core.server.tool_calls import ToolCallStream, parser_for_template
from candelabra.core.server.tool_calls.plan import NoToolFormat, ToolPlan, decoding_drops_markers, plan_tools
from candelabra.core.server.tool_calls.shapes import call_delta, message_call, message_for_template

log = logging.getLogger("candelabra")

# JSON has no infinities; OpenAI reports impossible tokens at this log probability.
LOWEST_LOGPROB = -9999.0


@dataclass
class ServerDefaults:
    """Sampling defaults set by `candelabra serve`'s flags, used where a request names none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    thinking: bool | None = None  # enable_thinking passed to the chat template


@dataclass
class ServedModel:
    """What the handlers need: the model's name and tokenizer, the engine, limits and metrics."""

    name: str
    engine: AsyncEngine
    metrics: ServerMetrics
    defaults: ServerDefaults = field(default_factory=ServerDefaults)
    max_waiting: int | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    created: int = field(default_factory=lambda: int(time.time()))
    llm: object | None = None  # the LLM the engine came from, for start-up details

    @property
    def tokenizer(self):
        return self.engine.llm_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.llm_engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.llm_engine.model.config.vocab_size

    @functools.cached_property
    def thinks(self) -> bool:
        """Whether the model has thinking tags as tokens of their own (a reasoning model)."""
        encode = self.tokenizer.encode
        return len(encode("<think>", add_special_tokens=False)) == 1 and \
            len(encode("</think>", add_special_tokens=False)) == 1


class Generation:
    """One API request in flight: its engine requests (one per prompt), timers, and choices."""

    def __init__(self, served: ServedModel, kind: str, request: GenerationRequest, prompts: list[list[int]],
                 params: SamplingParams, keeps_output: bool = True) -> None:
        self.served, self.request = served, request
        self.keeps_output = keeps_output  # False: the request only scores its prompts; what is sampled is dropped
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        engine = served.engine
        if served.max_waiting is not None and len(prompts) > served.max_waiting:  # never, not only now
            raise bad_request(f"prompt has {len(prompts)} prompts; this server queues at most {served.max_waiting} "
                              "requests (--max-waiting sets it)", "prompt")
        if served.max_waiting is not None and engine.num_waiting + len(prompts) > served.max_waiting:
            raise APIError(503, f"the server is at capacity: {engine.num_waiting} requests are waiting "
                                f"(--max-waiting {served.max_waiting}); retry later", code="server_busy",
                           headers={"Retry-After": "1"})
        self.streams: list[RequestStream] = []
        self.timers: list[RequestTimer] = []
        try:
            for i, prompt in enumerate(prompts):
                self.streams.append(engine.add_request(f"{self.id}-{i}", prompt, params))
        except StructuredOutputError as exc:
            self.close()
            raise bad_request(str(exc), constraint_field(request)) from exc
        except ValueError as exc:
            self.close()
            code = "context_length_exceeded" if "context length" in str(exc) else None
            raise bad_request(str(exc), code=code) from exc
        self.timers = [RequestTimer(served.metrics, len(s.prompt_token_ids)) for s in self.streams]
        self.finals: list[RequestOutput | None] = [None] * len(prompts)

    def close(self, reason: str = "abort") -> None:
        for stream in self.streams:
            stream.close()
        for timer in self.timers:
            timer.end(reason)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all prompts as they come."""
        if len(self.streams) == 1:
            async for output in self.streams[0]:
                yield 0, self._seen(0, output)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    await queue.put((i, output))
            except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(self.streams)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                remaining -= item.finished
                yield i, self._seen(i, item)
        finally:
            for task in tasks:
                task.cancel()

    def _seen(self, i: int, output: RequestOutput) -> RequestOutput:
        if not self.keeps_output:
            output = _nothing_generated(output)
        self.timers[i].tokens(sum(len(o.delta_token_ids) for o in output.outputs))
        if output.finished:
            self.finals[i] = output
            reasons = {o.finish_reason for o in output.outputs}
            self.timers[i].end("length" if reasons == {"length"} else "stop")
            log.debug("%s: %d prompt tokens (%d cached), %d generated in %.2f s, finished by %s", output.request_id,
                      len(output.prompt_token_ids), output.num_cached_tokens,
                      sum(len(o.token_ids) for o in output.outputs), time.perf_counter() - self.timers[i].arrival,
                      "/".join(sorted(reasons)))
        return output

    def chunk(self, object_name: str, choices: list[dict], final: bool = False) -> dict:
        """One streamed chunk. With include_usage every chunk carries usage: null until the final,
        choice-less one that counts the whole request."""
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.served.name,
                "choices": choices}
        if final:
            body["usage"] = self.usage()
        elif self.request.include_usage:
            body["usage"] = None
        return body

    def usage(self) -> dict:
        finals = [f for f in self.finals if f is not None]
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def choice_index(self, prompt_index: int, output: CompletionOutput) -> int:
        return prompt_index * self.request.n + output.index


def _nothing_generated(output: RequestOutput) -> RequestOutput:
    """The output of a request run only to score its prompt: its sampled token dropped, each
    sample ended by its length of 0."""
    samples = [CompletionOutput(index=o.index, text="", token_ids=[], logprobs=None if o.logprobs is None else [],
                                finish_reason=None if o.finish_reason is None else "length") for o in output.outputs]
    return dataclasses.replace(output, outputs=samples)


def sampling_params(request: GenerationRequest, served: ServedModel, max_tokens: int | None,
                    num_logprobs: int | None, num_prompt_logprobs: int | None = None) -> SamplingParams:
    defaults = served.defaults
    vocab = served.vocab_size

    def pick(value, default, fallback):
        return value if value is not None else (default if default is not None else fallback)

    logit_bias = {}
    for key, value in (request.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})", "logit_bias")
        logit_bias[token] = value
    try:
        structured_output, _ = request.structured_output()
    except ConstraintError as exc:
        raise bad_request(str(exc), exc.field_name) from exc
    for token in request.stop_token_ids or []:
        if token >= vocab:
            raise bad_request(f"stop_token_ids entry {token} is outside the vocabulary [0, {vocab})",
                              "stop_token_ids")
    try:
        return SamplingParams(
            n=request.n,
            temperature=pick(request.temperature, defaults.temperature, 1.0),
            top_p=pick(request.top_p, defaults.top_p, 1.0),
            top_k=pick(request.top_k, defaults.top_k, 0),
            min_p=pick(request.min_p, defaults.min_p, 0.0),
            repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty, 1.0),
            repeat_last_n=pick(request.repeat_last_n, defaults.repeat_last_n, None),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            seed=None if request.seed is None else request.seed % 2**64,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=list(request.stop or []),
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            logit_bias=logit_bias,
            logprobs=num_logprobs,
            prompt_logprobs=num_prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            structured_output=structured_output,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


def constraint_field(request: GenerationRequest) -> str:
    """The request field that constrains its output; else the constraint came from a forcing
    tool_choice, built from the tools' parameter schemas."""
    try:
        return request.structured_output()[1] or "tools"
    except ConstraintError as exc:
        return exc.field_name


def check_model(served: ServedModel, name: str | None) -> None:
    if name is not None and name != served.name:
        raise APIError(400, f"model {name!r} is not served here; this server serves {served.name!r}", "model",
                       "model_not_found")


# ---- chat completions


async def chat_completion(served: ServedModel, request: ChatCompletionRequest, http: Request):
    check_model(served, request.model)
    served.limits.check_generation(request)
    template_kwargs = {} if served.defaults.thinking is None else {"enable_thinking": served.defaults.thinking}
    template_kwargs.update(request.chat_template_kwargs or {})
    tokenizer = served.tokenizer
    plan = _tool_plan(request, tokenizer)
    messages = [message_for_template(m.for_template()) for m in request.messages]
    try:
        prompt_text = tokenizer.render_chat(messages, request.add_generation_prompt, tools=plan.template_tools,
                                            **template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    served.limits.token_counter("messages").add(len(prompt_ids))
    params = sampling_params(request, served, request.max_new_tokens, request.num_logprobs,
                             request.num_prompt_logprobs)
    if plan.structured_output is not None:
        if params.structured_output is not None:
            raise bad_request(f"a tool_choice that forces calls constrains the output itself and cannot be combined "
                              f"with {constraint_field(request)}", "tool_choice")
        params.structured_output = plan.structured_output
    if plan.parser is not None and decoding_drops_markers(tokenizer, plan.parser.markers):
        params.skip_special_tokens = False
    generation = Generation(served, "chat", request, [prompt_ids], params)
    # Output constrained to a call's JSON holds no thinking, even after a prompt that opens some.
    in_thought = opens_thinking(prompt_text) if served.thinks and plan.structured_output is None else None
    if request.stream:
        return _event_stream(_chat_chunks(generation, in_thought, plan), generation)
    await _until_done_or_disconnected(generation, http)
    final = generation.finals[0]
    choices = []
    for output in final.outputs:
        reasoning, content = split_reasoning(output.text, in_thought) if in_thought is not None else (None, output.text)
        message = {"role": "assistant", "content": content}
        finish_reason = output.finish_reason
        if plan.parser is not None:
            parsed = plan.parser.parse(content)
            calls = plan.kept(parsed.calls)
            message["content"] = parsed.content if parsed.content or not calls else None
            if calls:
                message["tool_calls"] = [message_call(call, plan.parser.new_call_id()) for call in calls]
                finish_reason = _finish_with_calls(finish_reason)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append({"index": output.index, "message": message, "finish_reason": finish_reason,
                        "logprobs": _chat_logprobs(tokenizer, final.prompt_token_ids, output.logprobs)
                        if request.logprobs else None})
    body = {"id": generation.id, "object": "chat.completion", "created": generation.created,
            "model": served.name, "choices": choices, "usage": generation.usage()}
    if request.prompt_logprobs is not None:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(final, request.prompt_logprobs)
    return JSONResponse(body)


def _tool_plan(request: ChatCompletionRequest, tokenizer) -> ToolPlan:
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    choice = request.tool_choice_or_default
    if not isinstance(choice, str):
        choice = choice.model_dump()
    try:
        return plan_tools(tools, choice, request.parallel_tool_calls, parser_for_template(tokenizer.chat_template_text))
    except NoToolFormat as exc:
        raise bad_request(str(exc), "tools") from exc


def _finish_with_calls(finish_reason: str | None) -> str | None:
    """A sample that ended by itself after calling tools finished "tool_calls"; one cut short by
    max_tokens still says "length"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


async def _chat_chunks(generation: Generation, in_thought: bool | None, plan: ToolPlan) -> AsyncIterator[dict]:
    tokenizer, request = generation.served.tokenizer, generation.request
    splitters: dict[int, ReasoningSplitter] = {}
    call_streams: dict[int, ToolCallStream] = {}
    calls_sent: dict[int, int] = {}
    reported_logprobs: dict[int, int] = {}
    finished: set[int] = set()
    prompt_reported = request.prompt_logprobs is None

    def chunk(choices: list[dict]) -> dict:
        return generation.chunk("chat.completion.chunk", choices)

    async for _, output in generation.outputs():
        for out in output.outputs:
            index = out.index
            if index not in splitters:
                splitters[index] = ReasoningSplitter(bool(in_thought))
                if plan.parser is not None:
                    call_streams[index] = ToolCallStream(plan.parser)
                calls_sent[index] = 0
                reported_logprobs[index] = 0
                first = chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
                if not prompt_reported:  # with the stream's first chunk
                    first["prompt_logprobs"] = _vllm_prompt_logprobs(output, request.prompt_logprobs)
                    prompt_reported = True
                yield first
            ends = out.finish_reason is not None
            if in_thought is not None:
                reasoning, content = splitters[index].feed(out.delta_text)
                if ends:
                    more_reasoning, more_content = splitters[index].finish()
                    reasoning, content = reasoning + more_reasoning, content + more_content
            else:
                reasoning, content = "", out.delta_text
            calls = []
            if index in call_streams:
                content, calls = call_streams[index].feed(content)
                if ends:
                    more_content, more_calls = call_streams[index].finish()
                    content, calls = content + more_content, calls + more_calls
                calls = plan.kept(calls, calls_sent[index])
            logprobs = None
            if request.logprobs and out.logprobs is not None:
                start = reported_logprobs[index]
                logprobs = _chat_logprobs(tokenizer, output.prompt_token_ids + out.token_ids[:start],
                                          out.logprobs[start:])
                reported_logprobs[index] = len(out.logprobs)
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [call_delta(calls_sent[index] + i, call, plan.parser.new_call_id())
                                       for i, call in enumerate(calls)]
                calls_sent[index] += len(calls)
            if delta or (logprobs and logprobs["content"]):
                yield chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
            if ends and index not in finished:
                finished.add(index)
                finish_reason = _finish_with_calls(out.finish_reason) if calls_sent[index] else out.finish_reason
                yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
    if request.include_usage:
        yield generation.chunk("chat.completion.chunk", [], final=True)


def _logprob_rows(tokenizer, preceding: list[int], entries: list[SampledToken] | None) -> list[tuple]:
    """(text, logprob, [(text, logprob) of the top alternatives]) per sampled token, each text being
    what the token adds after the tokens before it, so that the texts join into the output."""
    rows, history = [], list(preceding[-PIECE_CONTEXT:])
    for entry in entries or []:
        context = history[-PIECE_CONTEXT:]
        top = [(token_piece(tokenizer, context, t), max(lp, LOWEST_LOGPROB)) for t, lp in entry.top]
        rows.append((token_piece(tokenizer, context, entry.token_id), max(entry.logprob, LOWEST_LOGPROB), top))
        history.append(entry.token_id)
    return rows


def _vllm_prompt_logprobs(output: RequestOutput, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token its own logprob and
    the k most likely, keyed by token id as a string."""
    entries = [None]
    for token, scores in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        entries.append({str(t): _logprob_json(lp) for t, lp in scores.items() if t == token or lp.rank <= k})
    return entries


def _logprob_json(lp: Logprob) -> dict:
    return {"logprob": max(lp.logprob, LOWEST_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}


def _chat_logprobs(tokenizer, preceding: list[int], entries: list[SampledToken] | None) -> dict:
    def item(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(text, logprob), "top_logprobs": [item(*alt) for alt in top]}
                        for text, logprob, top in _logprob_rows(tokenizer, preceding, entries)]}


# ---- completions


async def completion(served: ServedModel, request: CompletionRequest, http: Request):
    check_model(served, request.model)
    served.limits.check_generation(request)
    tokenizer = served.tokenizer
    given = request.prompts()
    served.limits.check_count(len(given), "max_inputs", "prompt", "prompts")
    counter, prompts = served.limits.token_counter("prompt"), []
    for position, prompt in enumerate(given):
        prompts.append(tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        counter.add(len(prompts[-1]), f"prompt[{position}]" if len(given) > 1 else None)
    # The engine samples at least one token per request: a prompt only to score runs with one, dropped.
    max_tokens = 1 if request.only_echoes else request.max_new_tokens
    params = sampling_params(request, served, max_tokens, request.num_logprobs, request.num_prompt_logprobs)
    generation = Generation(served, "completion", request, prompts, params, keeps_output=not request.only_echoes)
    echoes = [_echo_text(tokenizer, p) for p in request.prompts()] if request.echo else None
    if request.stream:
        return _event_stream(_completion_chunks(generation, echoes), generation)
    await _until_done_or_disconnected(generation, http)
    choices = []
    for i, final in enumerate(generation.finals):
        echo = echoes[i] if echoes else ""
        for out in final.outputs:
            choice = {"index": generation.choice_index(i, out), "text": echo + out.text, "logprobs": None,
                      "finish_reason": out.finish_reason}
            if request.logprobs is not None:
                logprobs = _completion_logprobs(tokenizer, final.prompt_token_ids, out.logprobs, len(echo))
                if echoes:
                    logprobs = _joined(_echo_logprobs(tokenizer, final, request.logprobs), logprobs)
                choice["logprobs"] = logprobs
            if request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(final, request.prompt_logprobs)
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return JSONResponse({"id": generation.id, "object": "text_completion", "created": generation.created,
                         "model": served.name, "choices": choices, "usage": generation.usage()})


def _echo_text(tokenizer, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)


async def _completion_chunks(generation: Generation, echoes: list[str] | None) -> AsyncIterator[dict]:
    tokenizer, request = generation.served.tokenizer, generation.request
    started: set[int] = set()
    finished: set[int] = set()
    text_offsets: dict[int, int] = {}
    reported_logprobs: dict[int, int] = {}

    def chunk(index: int, text: str, logprobs, finish_reason, **extra) -> dict:
        return generation.chunk("text_completion", [{"index": index, "text": text, "logprobs": logprobs,
                                                     "finish_reason": finish_reason, **extra}])

    async for i, output in generation.outputs():
        for out in output.outputs:
            index = generation.choice_index(i, out)
            text, echo_logprobs, extra = out.delta_text, None, {}
            if index not in started:  # the prompt's part goes with the first chunk
                started.add(index)
                text_offsets[index], reported_logprobs[index] = 0, 0
                if echoes:
                    text = echoes[i] + text
                    text_offsets[index] = len(echoes[i])
                    if request.logprobs is not None:
                        echo_logprobs = _echo_logprobs(tokenizer, output, request.logprobs)
                if request.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = _vllm_prompt_logprobs(output, request.prompt_logprobs)
            logprobs = None
            if request.logprobs is not None and out.logprobs is not None:
                start, reported_logprobs[index] = reported_logprobs[index], len(out.logprobs)
                logprobs = _completion_logprobs(tokenizer, output.prompt_token_ids + out.token_ids[:start],
                                                out.logprobs[start:], text_offsets[index])
                if echo_logprobs is not None:
                    logprobs = _joined(echo_logprobs, logprobs)
            text_offsets[index] += len(out.delta_text)
            ends = out.finish_reason is not None and index not in finished
            if ends:
                finished.add(index)
            if text or ends or extra or (logprobs and logprobs["tokens"]):
                yield chunk(index, text, logprobs, out.finish_reason if ends else None, **extra)
    if request.include_usage:
        yield generation.chunk("text_completion", [], final=True)


def _echo_logprobs(tokenizer, output: RequestOutput, k: int) -> dict:
    """OpenAI's legacy logprobs of an echoed prompt: its tokens' texts, each one's logprob given the
    ones before (none for the first) and its k most likely alternatives, with their text offsets."""
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token, scores in zip(output.prompt_token_ids, output.prompt_logprobs):
        if scores is None:  # the first token: nothing came before it to score it
            text, logprob, top = token_piece(tokenizer, [], token), None, None
        else:
            text, logprob = scores[token].decoded_token, max(scores[token].logprob, LOWEST_LOGPROB)
            ranked = sorted(scores.values(), key=lambda lp: lp.rank)[:k]
            top = {lp.decoded_token: max(lp.logprob, LOWEST_LOGPROB) for lp in ranked}
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def _completion_logprobs(tokenizer, preceding: list[int], entries: list[SampledToken] | None, offset: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for text, logprob, top in _logprob_rows(tokenizer, preceding, entries):
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(dict(top))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


# ---- delivery


async def _until_done_or_disconnected(generation: Generation, http: Request) -> None:
    """Run the generation to its end; abort it as soon as the client goes away first."""

    async def drain() -> None:
        async for _ in generation.outputs():
            pass

    try:
        await unless_disconnected(drain(), http)
    except ClientGone:
        generation.close()
        raise APIError(499, "the client disconnected") from None
    except EngineStopping as exc:
        generation.close()
        raise APIError(503, str(exc)) from exc
    except RuntimeError as exc:  # the engine failed this request
        generation.close("error")
        raise APIError(500, str(exc)) from exc


def _event_stream(chunks: AsyncIterator[dict], generation: Generation) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        ended = "abort"
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            ended = None
        except EngineStopping as exc:
            yield f"data: {json.dumps(error_body(str(exc), 'service_unavailable'))}\n\n"
        except RuntimeError as exc:  # the engine failed this request; tell the client in the stream
            ended = "error"
            yield f"data: {json.dumps(error_body(str(exc), 'internal_error'))}\n\n"
        finally:
            if ended:
                generation.close(ended)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
