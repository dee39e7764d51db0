"""One generated sequence: its tokens, where its computation stands, and how it ended."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import numpy as np

from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.requests.tokens import ScoredToken

if TYPE_CHECKING:
    from candelabra.core.requests.structured_output import GrammarMatcher

_next_id = itertools.count()

# Stands for a token sampled by a step still running (scheduling ahead of the device): never a token id.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    """A prompt and its generated tokens. `num_computed_tokens` of them have their K/V in the
    cache; the rest are computed by the coming steps (a whole or chunked prefill, or a decode)."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int, rng: np.random.Generator, *, seed: int = 0, max_tokens: int | None = None,
                 end_token_ids: frozenset[int] = frozenset()) -> None:
        self.seq_id = next(_next_id)
        self.request_id, self.index = request_id, index
        self.token_ids = list(prompt_token_ids)  # the prompt's, then the output's, as they come
        self.num_prompt_tokens = len(self.token_ids)
        self.params, self.arrival, self.rng = params, arrival, rng
        self.seed = seed  # the request's: sample i draws from a generator seeded with (seed, i)
        self.max_tokens = max_tokens
        self.end_token_ids = end_token_ids  # tokens that end it (stop_token_ids, and EOS unless ignored)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.finish_reason: str | None = None
        self.forked = False  # the n - 1 siblings of sample 0 exist
        self.grammar: GrammarMatcher | None = None  # where its structured output stands
        # The scores of prompt tokens 1, 2, ... so far, when params.prompt_logprobs asks.
        self.prompt_logprobs: list[ScoredToken] = []
        self._pending = 0

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[:self.num_prompt_tokens])

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_prompt_tokens:])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_output(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def num_pending_tokens(self) -> int:
        """Output tokens a running step samples, not yet known (the last ones, PENDING_TOKEN)."""
        return self._pending

    def append_pending(self) -> None:
        """A step that samples this sequence was launched: its token comes later (`resolve_pending`)."""
        self.token_ids.append(PENDING_TOKEN)
        self._pending += 1

    def resolve_pending(self, token_id: int) -> None:
        """The earliest pending token is `token_id`."""
        self.token_ids[len(self.token_ids) - self._pending] = token_id
        self._pending -= 1

    def drop_pending(self) -> None:
        """Forget the pending tokens (the sequence ended before them)."""
        if self._pending:
            del self.token_ids[-self._pending:]
            self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))
            self._pending = 0

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_scoring(self) -> bool:
        """Whether prompt tokens are still to be scored (every one but the first, which has no context)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def num_scored_prompt_tokens(self) -> int:
        """The prompt positions whose logits have been scored: those before the first one still to score."""
        return len(self.prompt_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int) -> Sequence:
        """Sample `index` of the same request, from the same point, drawing from its own generator."""
        child = Sequence(self.request_id, index, self.token_ids, self.params, self.arrival,
                         sample_rng(self.seed, index), seed=self.seed, max_tokens=self.max_tokens,
                         end_token_ids=self.end_token_ids)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.status, child.num_computed_tokens = self.status, self.num_computed_tokens
        child.num_cached_prompt_tokens = self.num_cached_prompt_tokens
        child.grammar = None if self.grammar is None else self.grammar.copy()
        child.prompt_logprobs = self.prompt_logprobs  # one prompt, scored once for all samples
        return child

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, {self.status.value}, "
                f"{self.num_computed_tokens}/{self.num_tokens} computed)")


def sample_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of sample `index` of a request seeded with `seed`: sample 0 of an n > 1
    request draws as an n = 1 request with that seed does."""
    return np.random.default_rng([seed, index])
