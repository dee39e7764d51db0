"""Where tensor-parallel ranks run: devices, nodes, and where they meet."""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.contract.device import Device
from candelabra.core.worker.numa_nodes import allowed_cpus, bindings, machine_nodes

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Topology:
    """Where the ranks run: `device_ids` on each of `num_nodes` nodes (the same number on every node),
    this process on node `node_rank`; rank = node_rank * len(device_ids) + the device's place in
    `device_ids`. Ranks meet at `master_addr`:`master_port`, on node 0."""

    device_ids: tuple[int, ...]
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    # --numa-bind-nodes: a NUMA node per device id, () for none, None to spread ranks over the nodes
    numa_bind_nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.device_ids:
            raise ValueError("tensor parallelism needs at least one device id")
        if len(set(self.device_ids)) != len(self.device_ids):
            raise ValueError(f"--device-ids lists a device twice: {','.join(map(str, self.device_ids))}")
        if self.num_nodes < 1:
            raise ValueError(f"--num-nodes must be at least 1, not {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"--node-rank must be in 0 to {self.num_nodes - 1} (--num-nodes {self.num_nodes}), "
                             f"not {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be in 1 to 65535, not {self.master_port}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * len(self.device_ids)

    def device(self, local: int) -> Device:
        """The Device of this node's `local`-th rank, with the NUMA node and cores it keeps to on this machine."""
        binding = bindings(len(self.device_ids), self.numa_bind_nodes, machine_nodes(), allowed_cpus())[local]
        node, cores = binding if binding else (None, None)
        return Device(self.device_ids[local], self.node_rank * len(self.device_ids) + local, self.world_size,
                      numa_node=node, cores=cores)
