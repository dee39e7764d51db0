"""What the scheduler hands the model runner for one step: the sequences to run, the block moves to make
first, and which sequences get a token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from candelabra.core.requests.sequence import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens fed to the model for this sequence in this step


@dataclass
class SchedulerOutput:
    """One step's plan: the sequences to run and how many tokens each feeds the model, the block
    moves to make first, and the sequences that get a token sampled at the end of the step."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (index into `scheduled` whose last token's logits are sampled, the sequence that gets the
    # token): one row per sampled sequence, the n samples of a prompt sharing its item.
    sampled: list[tuple[int, Sequence]] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)  # samples 1 .. n-1 born in this step
    block_tables: list[np.ndarray] = field(default_factory=list)  # int32, of each scheduled sequence
    reserved: int = 0  # tokens of the step's budget kept for work beside it (pooling), not scheduled here
