"""Which NUMA node, and which of its cores, each of a machine's ranks keeps to.

A rank whose threads run on one node and whose memory sits on another reads every weight across the
interconnect. With several nodes and several ranks, the ranks are spread over the nodes (local rank i
on node i mod nodes), or put where `--numa-bind-nodes` says (one node per device id, as candle-vllm's
MAP_NUMA_NODE), and the ranks of one node share its cores. One node, or one rank not told otherwise,
is left as it is. The backend applies the binding (for torch: backends/torch/numa_binding.py).
"""

from __future__ import annotations

import os
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a sysfs list such as "0-3,8-11"."""
    cpus = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def machine_nodes(root: Path = NODE_ROOT) -> dict[int, frozenset[int]]:
    """Each NUMA node with CPUs, and its CPUs; empty where the system does not say (not Linux)."""
    nodes = {}
    for folder in sorted(root.glob("node[0-9]*")) if root.is_dir() else ():
        try:
            cpus = parse_cpu_list((folder / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(folder.name.removeprefix("node"))] = cpus
    return nodes


def allowed_cpus() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def parse_bind_nodes(text: str | None) -> tuple[int, ...] | None:
    """--numa-bind-nodes: "0,0,1,1" (a node per device id), "none" (no binding: an empty tuple), or unset
    (None: spread the ranks where the machine has several nodes)."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    words = [word.strip() for word in text.split(",")]
    if not words or not all(word.isdigit() for word in words):
        raise ValueError(f"--numa-bind-nodes {text}: a NUMA node number per device id, comma-separated "
                         "(e.g. 0,0,1,1), or none")
    return tuple(int(word) for word in words)


def bindings(ranks: int, bind_nodes: tuple[int, ...] | None, nodes: dict[int, frozenset[int]],
             allowed: frozenset[int]) -> list[tuple[int, tuple[int, ...]] | None]:
    """For each of a machine's `ranks` local ranks: (node, cores) to keep to, or None to stay as it is.
    ValueError where --numa-bind-nodes names a node the machine lacks, or not one per rank."""
    if bind_nodes == ():
        return [None] * ranks
    if bind_nodes is None:
        if len(nodes) < 2 or ranks < 2:
            return [None] * ranks
        order = sorted(nodes)
        chosen = [order[local % len(order)] for local in range(ranks)]
    else:
        if len(bind_nodes) != ranks:
            raise ValueError(f"--numa-bind-nodes names {len(bind_nodes)} nodes for {ranks} device ids: one each")
        missing = sorted(set(bind_nodes) - set(nodes))
        if missing:
            raise ValueError(f"--numa-bind-nodes: this machine has no NUMA node {missing[0]} with CPUs "
                             f"(it has {', '.join(map(str, sorted(nodes))) or 'none listed'})")
        chosen = list(bind_nodes)
    found = []
    for local, node in enumerate(chosen):
        cores = sorted(nodes[node] & allowed) or sorted(nodes[node])
        peers = [other for other, same in enumerate(chosen) if same == node]
        share = max(1, len(cores) // len(peers))
        start = (peers.index(local) * share) % len(cores)
        found.append((node, tuple(cores[start:start + share])))
    return found
