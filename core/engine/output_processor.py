"""From the engine core's tokens to a request's text: incremental detokenizing and stop strings.

It runs wherever the caller consumes outputs (the offline loop, or the asyncio side of the async
engine), off the engine's step loop. A sample whose stop string appears is ended here at once (its
text is final); the caller tells the core to finish it, which may already have drawn a token or
two more for it: those are dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from candelabra.core.engine.core import EngineOutput, SampleUpdate
from candelabra.core.engine.detokenizer import IncrementalDetokenizer
from candelabra.core.engine.prompt_logprobs import Logprob, prompt_logprobs
from candelabra.core.engine.stop_strings import StopStringMatcher
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.tokens import SampledToken

Item = TypeVar("Item")


class Prefix(Sequence, Generic[Item]):
    """The first `length` items of a list that only grows: a read-only snapshot that copies nothing.

    A sample's outputs before it finishes hold their tokens and logprobs so, since copying every token so
    far at every step costs a long answer's stream time in its length squared; the finished output holds
    plain lists."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[Item], length: int) -> None:
        self._items, self._length = items, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step > 0:
                return self._items[start:stop:step]
            return [self._items[i] for i in range(start, stop, step)]
        if not -self._length <= index < self._length:
            raise IndexError(f"index {index} out of a prefix of {self._length}")
        return self._items[index % self._length]

    def __iter__(self) -> Iterator[Item]:
        return itertools.islice(self._items, self._length)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Prefix | list | tuple):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other, strict=False))

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]  # a list once the sample finished; a Prefix of the tokens so far before that
    finish_reason: str | None
    logprobs: Sequence[SampledToken] | None = None  # one per token, when asked for; a Prefix before the end
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With prompt_logprobs asked for, once the prompt is scored: None for the first prompt token,
    # then {token id: Logprob} for each later one (the token itself and the most likely ones).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class _Sample:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                  skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[SampledToken] = []
        self.finish_reason: str | None = None
        self.reported = (0, 0)  # text length and tokens already returned

    def take(self, update: SampleUpdate) -> bool:
        """Add the token; whether a stop string ended the sample with it."""
        self.token_ids.append(update.token_id)
        if update.logprob is not None:
            self.logprobs.append(update.logprob)
        if update.end_token:  # not part of the text
            self.text += self.stops.feed(self.detokenizer.flush())[0] + self.stops.finish()
            self.finish_reason = update.finish_reason
            return False
        emitted, stopped = self.stops.feed(self.detokenizer.add(update.token_id))
        self.text += emitted
        if stopped:
            self.finish_reason = "stop"
            return update.finish_reason is None
        if update.finish_reason is not None:  # its length, or a completed structured output
            self.text += self.stops.feed(self.detokenizer.flush())[0] + self.stops.finish()
            self.finish_reason = update.finish_reason
        return False

    def output(self, index: int, with_logprobs: bool) -> CompletionOutput:
        text_done, tokens_done = self.reported
        self.reported = (len(self.text), len(self.token_ids))
        snapshot = list if self.finish_reason else lambda items: Prefix(items, len(items))
        return CompletionOutput(index=index, text=self.text, token_ids=snapshot(self.token_ids),
                                finish_reason=self.finish_reason,
                                logprobs=snapshot(self.logprobs) if with_logprobs else None,
                                delta_text=self.text[text_done:], delta_token_ids=self.token_ids[tokens_done:])


class OutputProcessor:
    """One request's outputs: `process` takes each of the core's outputs for it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer) -> None:
        self.request_id, self.prompt_token_ids, self.params = request_id, prompt_token_ids, params
        self._tokenizer = tokenizer
        self._samples: dict[int, _Sample] = {}
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        samples = self._samples.values()
        return len(self._samples) == self.params.n and all(s.finish_reason for s in samples)

    def process(self, output: EngineOutput) -> tuple[RequestOutput, list[int]]:
        """The request's output so far, and the samples a stop string ended just now, which the
        core must finish."""
        stopped = []
        if output.prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs(self._tokenizer, self.prompt_token_ids, output.prompt_logprobs)
        for update in output.updates:
            sample = self._samples.get(update.index)
            if sample is None:
                sample = self._samples[update.index] = _Sample(self._tokenizer, self.prompt_token_ids, self.params)
            if sample.finish_reason is None and sample.take(update):
                stopped.append(update.index)
        outputs = [self._samples[i].output(i, self.params.logprobs is not None) for i in sorted(self._samples)]
        finished = self.finished or output.finished
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, finished,
                             output.num_cached_tokens, self._prompt_logprobs), stopped
