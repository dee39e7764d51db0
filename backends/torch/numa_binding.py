"""A rank kept to the NUMA node its Device names (core/worker/numa_nodes.py chooses it): its threads to
the node's cores, its allocations to the node's memory, with the system calls numactl makes
(sched_setaffinity, and set_mempolicy with MPOL_PREFERRED, which falls back to another node when this one
is full rather than failing). Where the system refuses (a container without the right), one warning,
and the rank runs unbound."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform

from candelabra.core.contract.device import Device

log = logging.getLogger("candelabra")

MPOL_DEFAULT, MPOL_PREFERRED = 0, 1
# set_mempolicy's system call number (asm/unistd.h); other machines keep their memory policy.
SET_MEMPOLICY = {"x86_64": 238, "amd64": 238, "aarch64": 237, "arm64": 237}


def bind_to_node(device: Device) -> bool:
    """Keep this thread and those it starts to `device.cores` and its allocations to `device.numa_node`.
    True where both took, False (after one warning) where the system refused either; nothing to do where
    the device names no node."""
    if device.numa_node is None:
        return True
    refused = []
    if device.cores:
        try:
            os.sched_setaffinity(0, device.cores)
        except (OSError, AttributeError) as exc:
            refused.append(f"cores {list(device.cores)}: {exc}")
    error = _prefer_node_memory(device.numa_node)
    if error:
        refused.append(f"memory: {error}")
    if refused:
        log.warning("rank %d: could not keep to NUMA node %d (%s); it runs without what was refused", device.rank,
                    device.numa_node, "; ".join(refused))
        return False
    log.info("rank %d keeps to NUMA node %d, cores %s", device.rank, device.numa_node, list(device.cores or ()))
    return True


def forget_node_memory() -> None:
    """This thread's allocations from any node again (MPOL_DEFAULT), as before `bind_to_node`."""
    _set_memory_policy(MPOL_DEFAULT, None)


def _prefer_node_memory(node: int) -> str | None:
    """Ask the kernel to allocate this thread's memory on `node`; the error, or None."""
    return _set_memory_policy(MPOL_PREFERRED, node)


def _set_memory_policy(mode: int, node: int | None) -> str | None:
    number = SET_MEMPOLICY.get(platform.machine().lower())
    if number is None or platform.system() != "Linux":
        return f"no set_mempolicy on {platform.system()} {platform.machine()}"
    words = 1 if node is None else node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    if node is not None:
        mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, mode, mask if node is not None else None, ctypes.c_ulong(words * 64 + 1)) != 0:
        code = ctypes.get_errno()
        return f"set_mempolicy: {errno.errorcode.get(code, code)} ({os.strerror(code)})"
    return None
