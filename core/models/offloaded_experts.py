"""Experts in host memory (`--num-experts-offload-per-rank N`): N of each MoE layer's experts on this
rank live in host memory, pinned where the device has it, and are copied into a few device slots
when the router picks them.

Which, and how much stays on the device. The last N experts of the rank's weights go to host memory
(`Backend.host_experts`). The layer's EXPERTS weights on the device hold the first E - N experts in
rows 0 .. E - N - 1, then S slot rows for experts brought in: S is `ExpertOffload.slots`, given
(`--expert-cache-slots`) or a quarter of N rounded up. The device so holds E - N + S experts a layer
instead of E, and keeps the S most recently used of the others (`expert_slots`).

A step. Once the router has chosen (`route_experts`), its choice is read on the host: a wait for the
device once per MoE layer and step, which is why such a model's steps are never captured in a graph.
The layer's slots say which picked experts are already in and which to copy in; the copies are
issued together (`Backend.write_expert`, asynchronous where the device allows) before any expert
runs, and `moe_experts` then runs on device rows, read from a table [E, 1] of expert id -> row with
`gather_rows`. When a step picks more experts from host memory than there are slots, the experts on
the device run first, then one slotful at a time, each turn's copies issued after the turn before it
(whose slots they overwrite); the picks of other turns are weighted 0 and sent to a row no expert of
the turn uses, so every expert multiplies exactly the tokens it multiplies without offloading, and
the turns' outputs add up. In float32, with two experts a token (Mixtral), the logits are bit for bit
those of the model kept whole on the device; with more a token the order of the sum may differ.

Under tensor parallelism the rank's weights are its share of the layer's experts (from its first
expert on, `Experts.first`): the N are the last of its share, and the picks of other ranks' experts go
to a row past the device weights' last, which `moe_experts` leaves out.

On a backend whose tensors are in host memory already (`Backend.shares_host_memory`) nothing moves,
and the model loads as without the flag.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from candelabra.core.contract.backend import Backend, cannot_offload_experts
from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.kv_cache import BYTES_PER_ELEMENT
from candelabra.core.contract.ops import Tensor
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.models.expert_slots import ExpertSlots, SlotTurn

log = logging.getLogger("candelabra")


@dataclass(frozen=True)
class ExpertOffload:
    """How many of each MoE layer's experts (on each rank) live in host memory, and how many device slots
    each layer keeps for them (`cache_slots`; None: a quarter of them, rounded up)."""

    num_offloaded: int
    cache_slots: int | None = None

    def __post_init__(self) -> None:
        if self.num_offloaded < 1:
            raise ValueError(f"--num-experts-offload-per-rank must be at least 1 to keep experts in host memory, "
                             f"not {self.num_offloaded}")
        if self.cache_slots is not None and not 1 <= self.cache_slots <= self.num_offloaded:
            raise ValueError(f"--expert-cache-slots must be between 1 and --num-experts-offload-per-rank "
                             f"({self.num_offloaded}), not {self.cache_slots}")

    @property
    def slots(self) -> int:
        return self.cache_slots if self.cache_slots is not None else math.ceil(self.num_offloaded / 4)

    def check_model(self, config: ModelConfig) -> None:
        """ConfigError for a dense model, or one whose layers have no more experts than would be offloaded."""
        if config.moe is None:
            raise ConfigError(f"--num-experts-offload-per-rank {self.num_offloaded}: a {config.architecture} is a "
                              "dense model, with no experts to keep in host memory")
        self.check_experts(config.moe.num_experts, config.architecture)

    def check_experts(self, num_experts: int, architecture: str) -> None:
        if self.num_offloaded >= num_experts:
            raise ConfigError(f"--num-experts-offload-per-rank {self.num_offloaded}: a {architecture} layer holds "
                              f"{num_experts} experts on this rank, so at most {num_experts - 1} can live in host "
                              "memory (one at least stays on the device)")

    def on(self, backend: Backend) -> ExpertOffload | None:
        """This offload on `backend`: None, logged, where its tensors are in host memory already;
        NotImplementedError where it cannot copy experts in from host memory."""
        if backend.shares_host_memory():
            log.info("--num-experts-offload-per-rank %d changes nothing on backend %r: its tensors are in host "
                     "memory already", self.num_offloaded, backend.name)
            return None
        implemented = (type(backend).host_experts is not Backend.host_experts
                       and type(backend).write_expert is not Backend.write_expert)
        if not implemented:
            raise NotImplementedError(cannot_offload_experts(backend))
        return self


@dataclass
class ExpertCacheCounts:
    """Since loading, over a model's MoE layers: picked experts from host memory found in a slot (hits)
    or copied in (misses), counted once per layer and step, and the bytes those copies moved."""

    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0

    def add(self, other: ExpertCacheCounts) -> None:
        self.hits, self.misses = self.hits + other.hits, self.misses + other.misses
        self.bytes_copied += other.bytes_copied


@dataclass(frozen=True)
class ExpertTurn:
    """One `moe_experts` call of a layer's step: `rows` [E, 1] int32, the device row of each expert id,
    and `mask` [T, K] float32, 1 for the picks this turn runs and 0 for the others (None: it runs all)."""

    rows: Tensor
    mask: Tensor | None


class OffloadedExperts:
    """One MoE layer's experts (this rank's `num_experts`, the layer's from `first_expert` on, of
    `layer_experts`) with the last `num_offloaded` in host memory: the device weights (`gate_up`, `down`:
    the resident experts, then the slots), and the turns of each step."""

    def __init__(self, backend: Backend, gate_up: Tensor, down: Tensor, host_gate_up: Any, host_down: Any,
                 num_experts: int, num_offloaded: int, num_slots: int, bytes_per_expert: int,
                 first_expert: int = 0, layer_experts: int | None = None) -> None:
        self.backend, self.gate_up, self.down = backend, gate_up, down
        self._host_gate_up, self._host_down = host_gate_up, host_down
        self.num_experts, self.num_offloaded = num_experts, num_offloaded
        self.first_expert, self.layer_experts = first_expert, layer_experts or num_experts
        self.num_resident = num_experts - num_offloaded
        self.slots = ExpertSlots(num_slots)
        self.bytes_per_expert = bytes_per_expert
        self.counts = ExpertCacheCounts()

    @classmethod
    def place(cls, backend: Backend, offload: ExpertOffload, architecture: str, names: tuple[str, str],
              gate_up: np.ndarray, down: np.ndarray, dtype: DType, upload: Callable[[str, np.ndarray], Tensor],
              first_expert: int = 0, layer_experts: int | None = None) -> OffloadedExperts:
        """A layer's stacked experts, float32 gate_up [E, 2I, H] and down [E, H, I] named `names` (the
        rank's share from the layer's expert `first_expert` on, of `layer_experts`: all by default): the
        last `offload.num_offloaded` to host memory, the others and zeroed slots through `upload`."""
        num_experts = gate_up.shape[0]
        offload.check_experts(num_experts, architecture)
        resident, slots = num_experts - offload.num_offloaded, offload.slots
        device, host = [], []
        for name, weight in zip(names, (gate_up, down)):
            empty_slots = np.zeros((slots, *weight.shape[1:]), np.float32)
            device.append(upload(name, np.concatenate([weight[:resident], empty_slots])))
            host.append(backend.host_experts(name, weight[resident:].copy(), dtype))  # a view would keep all E
        bytes_per_expert = (gate_up[0].size + down[0].size) * BYTES_PER_ELEMENT[dtype]
        return cls(backend, *device, *host, num_experts, offload.num_offloaded, slots, bytes_per_expert,
                   first_expert, layer_experts)

    def turns(self, expert_ids: Tensor) -> Iterator[ExpertTurn]:
        """The `moe_experts` calls that run the step's picks `expert_ids` [T, K] (int32), each turn's
        experts from host memory copied in before it is yielded. Read to the end: the slots have
        already been given to every turn when the first is yielded."""
        picks = self.backend.to_host(expert_ids).astype(np.int64) - self.first_expert  # this rank's: 0 .. E - 1
        routed = [e for e in np.unique(picks).tolist() if 0 <= e < self.num_experts]
        resident = [e for e in routed if e < self.num_resident]
        slot_turns = self.slots.turns(e for e in routed if e >= self.num_resident)
        self._count(slot_turns)
        first_copies = slot_turns[0].copies if slot_turns else ()
        self._copy_in(first_copies)
        if len(slot_turns) <= 1:
            yield self._turn({**self._resident_rows(resident), **self._slot_rows(slot_turns)}, picks, masked=False)
            return
        if resident:  # any slot row may stand for the other picks: no resident expert is in one
            yield self._turn(self._resident_rows(resident), picks, masked=True, filler=self.num_resident)
        for index, turn in enumerate(slot_turns):
            if index:
                self._copy_in(turn.copies)
            yield self._turn(self._slot_rows([turn]), picks, masked=True, filler=0)  # row 0: a resident expert

    def _resident_rows(self, experts: list[int]) -> dict[int, int]:
        return {expert: expert for expert in experts}

    def _slot_rows(self, turns: list[SlotTurn]) -> dict[int, int]:
        return {expert: self.num_resident + slot for turn in turns for expert, slot in turn.slots.items()}

    def _copy_in(self, copies: tuple[tuple[int, int], ...]) -> None:
        for expert, slot in copies:
            for device, host in ((self.gate_up, self._host_gate_up), (self.down, self._host_down)):
                self.backend.write_expert(device, self.num_resident + slot, host, expert - self.num_resident)

    def _count(self, turns: list[SlotTurn]) -> None:
        misses = sum(len(turn.copies) for turn in turns)
        self.counts.add(ExpertCacheCounts(sum(turn.hits for turn in turns), misses, misses * self.bytes_per_expert))

    def _turn(self, rows: dict[int, int], picks: np.ndarray, masked: bool, filler: int = 0) -> ExpertTurn:
        """The turn running the experts `rows` (expert -> device row); this rank's other experts go to
        `filler`, other ranks' past the device rows."""
        table = np.full((self.layer_experts, 1), self.num_resident + self.slots.num_slots, np.int32)
        table[self.first_expert : self.first_expert + self.num_experts, 0] = filler
        table[[self.first_expert + expert for expert in rows], 0] = list(rows.values())
        mask = np.isin(picks, list(rows)).astype(np.float32) if masked else None
        return ExpertTurn(self.backend.to_device(table),
                          None if mask is None else self.backend.to_device(mask, "float32"))


def offloaded_layers(layers: list) -> list[OffloadedExperts]:
    """The experts of those of `layers` (a model's) that keep some in host memory."""
    return [layer.experts.offloaded for layer in layers
            if layer.experts is not None and layer.experts.offloaded is not None]


def describe_offload(layers: list) -> str | None:
    """How many of `layers`' (a model's) experts live in host memory, in words; None where none do."""
    offloaded = offloaded_layers(layers)
    if not offloaded:
        return None
    first = offloaded[0]
    return (f"{first.num_offloaded} of {first.num_experts} per MoE layer in host memory, {first.slots.num_slots} "
            "device slots a layer for them")


def expert_cache_counts(layers: list) -> ExpertCacheCounts:
    """The counts summed over `layers` (a model's)."""
    total = ExpertCacheCounts()
    for experts in offloaded_layers(layers):
        total.add(experts.counts)
    return total
