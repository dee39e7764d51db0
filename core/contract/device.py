"""Which device a backend instance runs on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """`index` picks one of the backend's devices (`--device-ids`). Under tensor parallelism there is
    one process per device, this one `rank` of `world_size`; alone, 0 of 1. On a machine of several
    NUMA nodes a rank may be given one (`numa_node`, whose memory it allocates from) and `cores` of it
    to run its threads on (`--numa-bind-nodes`)."""

    index: int = 0
    rank: int = 0
    world_size: int = 1
    numa_node: int | None = None
    cores: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"a device index is 0 or more, not {self.index}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not one of world size {self.world_size} (0 to world_size - 1)")

    @classmethod
    def parse_ids(cls, device_ids: str | None) -> tuple[int, ...]:
        """The device indices `--device-ids` names ("0", "0,1", ...; empty when it names none).
        ValueError for a word that is not a device index, or an index named twice."""
        ids = [part.strip() for part in (device_ids or "").split(",") if part.strip()]
        for word in ids:
            if not word.isdigit():
                raise ValueError(f"--device-ids {device_ids}: a device is a number, 0 or more (e.g. --device-ids 0 "
                                 "or 0,1)")
        indices = tuple(int(word) for word in ids)
        if len(set(indices)) != len(indices):
            raise ValueError(f"--device-ids {device_ids}: a device is named twice")
        return indices
