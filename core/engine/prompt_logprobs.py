"""A prompt's scores as vLLM's users read them: per prompt token, its logprob given the tokens
before it and the most likely alternatives there, each with its rank and text."""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.engine.tokenizer import Tokenizer
from candelabra.core.requests.tokens import ScoredToken

# Tokens of context a piece of text is decoded after: enough for a tokenizer to place the spaces
# and merge the bytes a token continues, without decoding the whole prompt for every token.
PIECE_CONTEXT = 4


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str


def token_piece(tokenizer: Tokenizer, context: list[int], token: int) -> str:
    """The text `token` adds after `context`: its piece as it reads in place."""
    window = context[-PIECE_CONTEXT:]
    before = tokenizer.decode(window, skip_special_tokens=False)
    after = tokenizer.decode([*window, token], skip_special_tokens=False)
    return after[len(before):] if after.startswith(before) else tokenizer.decode([token], skip_special_tokens=False)


def prompt_logprobs(tokenizer: Tokenizer, prompt_token_ids: list[int],
                    scored: list[ScoredToken]) -> list[dict[int, Logprob] | None]:
    """One entry per prompt token: None for the first (it has no context), then for each later
    token a map from token id to its Logprob, holding the token itself and the alternatives.
    `scored` holds the engine's scores of prompt tokens 1, 2, ... in order."""
    entries: list[dict[int, Logprob] | None] = [None]
    for position, score in enumerate(scored, start=1):
        context = prompt_token_ids[max(0, position - PIECE_CONTEXT):position]
        entry = {token: Logprob(logprob, rank, token_piece(tokenizer, context, token))
                 for rank, (token, logprob) in enumerate(score.top, start=1)}
        entry[score.token_id] = Logprob(score.logprob, score.rank, token_piece(tokenizer, context, score.token_id))
        entries.append(entry)
    return entries
