"""What a step gives a sequence back: a sampled token, or a score for each prompt token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SampledToken:
    """What the model runner drew for one sampled sequence."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; empty without logprobs


@dataclass
class ScoredToken:
    """A prompt token as the model scored it, given the tokens before it."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
