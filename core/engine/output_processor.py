"""From the engine core's tokens to a request's text: incremental detokenizing and stop strings.

It runs wherever the caller consumes outputs (the offline loop, or the asyncio side of the async
engine), off the engine's step loop. A sample whose stop string appears is ended here at once (its
text is final); the caller tells the core to finish it, which may already have drawn a token or
two more for it: those are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from candelabra.core.engine.core import EngineOutput, SampleUpdate
from candelabra.core.engine.detokenizer import IncrementalDetokenizer
from candelabra.core.engine.prompt_logprobs import Logprob, prompt_logprobs
from candelabra.core.engine.stop_strings import StopStringMatcher
from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.tokens import SampledToken


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SampledToken] | None = None  # one per token, when asked for
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
        return CompletionOutput(index=index, text=self.text, token_ids=list(self.token_ids),
                                finish_reason=self.finish_reason,
                                logprobs=list(self.logprobs) if with_logprobs else None,
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
