"""Which device a backend instance runs on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """`index` picks one of the backend's devices (`--device-ids`). `rank` and `world_size` are
    reserved for tensor parallelism: one process per device, `rank` of `world_size`. Only one
    device per engine is supported so far, so they stay 0 and 1."""

    index: int = 0
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"a device index is 0 or more, not {self.index}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not one of world size {self.world_size} (0 to world_size - 1)")

    @classmethod
    def parse_ids(cls, device_ids: str | None) -> Device | None:
        """The device `--device-ids` names ("0", "1", ...; None when it names none). ValueError
        for several devices or a word that is not a device index."""
        ids = [part.strip() for part in (device_ids or "").split(",") if part.strip()]
        if len(ids) > 1:
            raise ValueError(f"--device-ids {device_ids}: serving on several devices (tensor parallelism) is not "
                             "supported yet; pass one device")
        if not ids:
            return None
        if not ids[0].isdigit():
            raise ValueError(f"--device-ids {device_ids}: a device is a number, 0 or more (e.g. --device-ids 0)")
        return cls(int(ids[0]))
