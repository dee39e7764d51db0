"""Which of a MoE layer's experts kept in host memory sit in its device slots, and what to copy in.

A layer keeps some of its experts in host memory and a few device slots for them. Each step the
router picks experts; every picked one from host memory must sit in a slot while its tokens run.
One already there is a hit; one that is not is a miss, copied into a free slot, else over the least
recently used expert. When a step picks more of them than there are slots, they run in turns of at
most a slotful, and a later turn evicts the earlier ones' experts; the hits run in the first turn,
before anything is evicted. This is bookkeeping only, in expert ids: the copies and the turns are
made by `offloaded_experts`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotTurn:
    """One turn's experts from host memory: each in its slot (expert -> slot), and the copies to make
    before the turn runs, (expert, slot) in order; the other experts of `slots` were there already."""

    slots: dict[int, int]
    copies: tuple[tuple[int, int], ...]

    @property
    def hits(self) -> int:
        return len(self.slots) - len(self.copies)


class ExpertSlots:
    """`num_slots` device slots holding the most recently used of one layer's experts from host memory."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a layer needs at least one slot for experts from host memory, not {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def held(self) -> dict[int, int]:
        """The experts in slots (expert -> slot), least recently used first."""
        return dict(self._slot_of)

    def turns(self, experts: Iterable[int]) -> list[SlotTurn]:
        """Bring in `experts` (repeats count once): the turns they run in, hits first; none for none."""
        wanted = list(dict.fromkeys(experts))
        ordered = [e for e in wanted if e in self._slot_of] + [e for e in wanted if e not in self._slot_of]
        return [self._admit(ordered[start:start + self.num_slots]) for start in range(0, len(ordered), self.num_slots)]

    def _admit(self, experts: list[int]) -> SlotTurn:
        """Slots for `experts` (a slotful at most, those already in slots first): the LRU entry evicted
        for each miss is never one of them, since they were all touched or added before it."""
        copies = []
        for expert in experts:
            if expert in self._slot_of:
                self._slot_of.move_to_end(expert)
                continue
            slot = self._free.pop() if self._free else self._slot_of.popitem(last=False)[1]
            self._slot_of[expert] = slot
            copies.append((expert, slot))
        return SlotTurn({expert: self._slot_of[expert] for expert in experts}, tuple(copies))
