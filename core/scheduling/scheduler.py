"""Chooses each step's batch: continuous batching under a token budget, with chunked prefill.

Per step: running sequences first, oldest first (a decode is one token, an unfinished prefill
continues with its next chunk); then the tokens reserved for work run beside the step (an
embeddings request's next slice) come out of what is left; then swapped-out requests come back
when there is room; then waiting requests are admitted first come, first served, while the token
budget, the sequence limit and the KV blocks allow. When a running sequence needs a block and none is left, the
newest running request is preempted: swapped out to host memory if there is room there (and
`preemption` allows it), else freed to be recomputed later.
"""

from __future__ import annotations

import logging
from collections import deque

from candelabra.core.requests.sequence import Sequence, SequenceStatus
from candelabra.core.requests.tokens import SampledToken, ScoredToken
from candelabra.core.scheduling.block_manager import BlockManager
from candelabra.core.scheduling.output import ScheduledSequence, SchedulerOutput

log = logging.getLogger("candelabra")

PREEMPTION_MODES = ("auto", "swap", "recompute")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_size: int = 0, preemption: str = "auto") -> None:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {preemption!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefill_chunk_size, self.preemption = prefill_chunk_size, preemption
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.swapped: deque[list[Sequence]] = deque()  # whole requests, oldest first
        self.num_preemptions = {"swap": 0, "recompute": 0}

    # queue management

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (n > 1) runs beside its parent."""
        seq.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(self._request_members(seq.request_id)[-1]) + 1, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(group) for group in self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` wherever it is (a step sampling it may still run: its pending tokens are dropped)."""
        status, seq.status, seq.finish_reason = seq.status, SequenceStatus.FINISHED, reason
        seq.drop_pending()
        if status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif status is SequenceStatus.SWAPPED:
            for group in self.swapped:
                if seq in group:
                    group.remove(seq)
            self.swapped = deque(group for group in self.swapped if group)
        if self.blocks.has(seq.seq_id):
            self.blocks.free(seq.seq_id)

    def abort(self, request_id: str) -> list[Sequence]:
        """Stop every sequence of the request, wherever it is, and free its blocks."""
        aborted = [s for s in self.waiting if s.request_id == request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        for group in [g for g in self.swapped if g[0].request_id == request_id]:
            self.swapped.remove(group)
            aborted += group
        aborted += self._request_members(request_id)
        for seq in aborted:
            self.finish(seq, "abort")
        return aborted

    # scheduling

    def schedule(self, reserve: int = 0) -> SchedulerOutput:
        """The next step's plan; up to `reserve` tokens of the budget the running sequences leave are kept
        out of it for work beside the step (`out.reserved` says how many)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue = deque(self._running_requests())
        kept: list[list[Sequence]] = []
        while queue:
            group = queue.popleft()
            plan = self._plan(group, budget)
            # Room is made for a whole request before any of it is appended, and only requests not
            # yet visited in this step are preempted for it, so no half-scheduled request is swapped.
            while plan and not self._append(plan, out):
                victim = queue.pop() if queue else group
                self._preempt(victim, out)
                if victim is group:
                    plan = None
            if plan is None:
                continue
            for seq, tokens in plan:
                out.scheduled.append(ScheduledSequence(seq, tokens))
                budget -= tokens
            kept.append(group)
        self.running = [seq for group in kept for seq in group]
        out.reserved = min(max(reserve, 0), budget)
        budget -= out.reserved
        if not out.preempted:
            self._swap_in(out)
            self._admit(out, budget)
        self._plan_sampling(out)
        out.block_tables = [self.blocks.block_table_array(item.seq.seq_id) for item in out.scheduled]
        return out

    def _plan_sampling(self, out: SchedulerOutput) -> None:
        """Every sequence whose step reaches its end gets a token; an n > 1 request forks into its
        n samples at its first, all drawing from the prompt's last logits."""
        for item_index, item in enumerate(out.scheduled):
            seq = item.seq
            if seq.num_computed_tokens + item.num_tokens < seq.num_tokens:
                continue  # a prefill chunk short of the prompt's end
            out.sampled.append((item_index, seq))
            if seq.params.n > 1 and not seq.forked and not seq.num_output_tokens:
                seq.forked = True
                for index in range(1, seq.params.n):
                    child = seq.fork(index)
                    self.blocks.fork(seq.seq_id, child.seq_id)
                    self.add_running(child)
                    out.forked.append(child)
                    out.sampled.append((item_index, child))

    def update_from_output(self, out: SchedulerOutput, sampled: list[SampledToken],
                           scored: dict[int, list[ScoredToken]] | None = None) -> list[tuple[Sequence, SampledToken]]:
        """After the model ran `out`: `commit` it, then `resolve` its tokens."""
        self.commit(out)
        return self.resolve(out, sampled, scored)

    def commit(self, out: SchedulerOutput) -> None:
        """The step `out` was launched: its tokens count as computed, and each sequence it samples holds a
        pending token, so that the next step can be scheduled before this one's tokens are known."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.blocks.mark_computed(item.seq.seq_id, item.seq.num_computed_tokens)
        for item_index, seq in out.sampled:
            parent = out.scheduled[item_index].seq
            if seq is not parent:  # forked before the step: it computed what its parent did
                seq.num_computed_tokens = parent.num_computed_tokens
                self.blocks.mark_computed(seq.seq_id, seq.num_computed_tokens)
            seq.append_pending()

    def resolve(self, out: SchedulerOutput, sampled: list[SampledToken],
                scored: dict[int, list[ScoredToken]] | None = None) -> list[tuple[Sequence, SampledToken]]:
        """The committed step `out` gave its tokens: record the prompt tokens scored (by index into
        `out.scheduled`, continuing each sequence's `prompt_logprobs`) and each sampled token (one per entry of
        `out.sampled`) in place of its pending one, and finish the sequences a token ends (an end token:
        "stop"; their max_tokens: "length"). A sequence that ended while the step ran takes nothing. Returns
        the (sequence, token) pairs taken, in order."""
        if len(sampled) != len(out.sampled):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(out.sampled)} sampled sequences")
        for item_index, tokens in (scored or {}).items():
            out.scheduled[item_index].seq.prompt_logprobs.extend(tokens)
        taken = []
        for (_, seq), token in zip(out.sampled, sampled):
            if seq.is_finished:
                continue
            position = seq.num_tokens - seq.num_pending_tokens
            seq.resolve_pending(token.token_id)
            if self.blocks.has(seq.seq_id) and self.blocks.num_tokens(seq.seq_id) > position:
                self.blocks.resolve_pending(seq.seq_id, token.token_id)  # already grown by the next step
            taken.append((seq, token))
            if token.token_id in seq.end_token_ids:
                self.finish(seq, "stop")
            elif seq.grammar is not None and not seq.grammar.accept(token.token_id):
                log.error("%r: its structured output refused token %d, which sampling should have masked: %s",
                          seq, token.token_id, seq.grammar.error)
                self.finish(seq, "stop")
            elif seq.grammar is not None and seq.grammar.finished:  # the text is complete
                self.finish(seq, "stop")
            elif seq.max_tokens is not None and seq.num_output_tokens - seq.num_pending_tokens >= seq.max_tokens:
                self.finish(seq, "length")
        return taken

    def _plan(self, group: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """(sequence, tokens) for the members that fit in `budget` this step."""
        plan = []
        for seq in group:
            if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
                continue  # its last token is pending: nothing more to compute
            wanted = seq.num_uncomputed_tokens
            tokens = min(wanted, budget, self.prefill_chunk_size or wanted)
            if tokens == 0 or (not self.prefill_chunk_size and tokens < wanted):
                break  # out of budget (an unchunked prefill waits for room for all of it)
            plan.append((seq, tokens))
            budget -= tokens
        return plan

    def _append(self, plan: list[tuple[Sequence, int]], out: SchedulerOutput) -> bool:
        """Grow the planned sequences' blocks for their new tokens, all of them or none; whether they fit."""
        blocks = self.blocks
        if len(plan) == 1:  # checked and grown in one call: a decode step's usual request
            seq = plan[0][0]
            copies = blocks.append_if_room(seq.seq_id, seq.token_ids[blocks.num_tokens(seq.seq_id):])
            if copies is None:
                return False
            out.block_copies += copies
            return True
        if not self._fits(plan):
            return False
        for seq, _ in plan:
            out.block_copies += blocks.append(seq.seq_id, seq.token_ids[blocks.num_tokens(seq.seq_id):])
        return True

    def _fits(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Whether the planned sequences, two or more, can all hold their new tokens."""
        missing = [(seq, seq.num_tokens - self.blocks.num_tokens(seq.seq_id)) for seq, _ in plan]
        if not all(self.blocks.can_append(seq.seq_id, count) for seq, count in missing):
            return False
        # Each growing member may need one fresh block (new or copy-on-write) of its own.
        growing = sum(1 for _, count in missing if count)
        return self.blocks.num_free_blocks >= growing

    def _preempt(self, group: list[Sequence], out: SchedulerOutput) -> None:
        ids = [s.seq_id for s in group]
        out.preempted += group
        if self.preemption != "recompute" and self.blocks.can_swap_out(ids):
            out.swap_out += self.blocks.swap_out(ids)
            for seq in group:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.num_preemptions["swap"] += 1
            return
        if self.preemption == "swap":
            raise RuntimeError("preemption by swap was required but the host swap space is full")
        for seq in reversed(group):
            self.blocks.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.num_preemptions["recompute"] += 1

    def _swap_in(self, out: SchedulerOutput) -> None:
        while self.swapped:
            group = self.swapped[0]
            ids = [s.seq_id for s in group]
            if len(self.running) + len(group) > self.max_num_seqs or not self.blocks.can_swap_in(ids):
                return
            self.swapped.popleft()
            out.swap_in += self.blocks.swap_in(ids)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A prompt token is scored only where it is computed: the cache may not skip past the
            # first one still unscored.
            limit = seq.num_scored_prompt_tokens if seq.needs_prompt_scoring else None
            if not self.blocks.can_allocate(seq.token_ids, limit):
                return
            cached = self.blocks.allocate(seq.seq_id, seq.token_ids, limit)
            wanted = seq.num_tokens - cached
            tokens = min(wanted, budget, self.prefill_chunk_size or wanted)
            if not self.prefill_chunk_size and tokens < wanted:
                self.blocks.free(seq.seq_id)  # wait for a step with room for the whole prompt
                return
            self.waiting.popleft()
            seq.num_computed_tokens = cached
            seq.num_cached_prompt_tokens = max(seq.num_cached_prompt_tokens, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, tokens))
            budget -= tokens

    def _request_members(self, request_id: str) -> list[Sequence]:
        return [s for s in self.running if s.request_id == request_id]

    def _running_requests(self) -> list[list[Sequence]]:
        """Running sequences grouped by request, oldest request first."""
        groups: dict[str, list[Sequence]] = {}
        for seq in self.running:
            groups.setdefault(seq.request_id, []).append(seq)
        return list(groups.values())
