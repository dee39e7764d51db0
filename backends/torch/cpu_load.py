"""How busy the rest of the machine is: the CPUs that other processes kept busy over an interval.

Kernel timings taken while another process competes for the cores describe that contention more
than the kernels: a two-thread kernel whose second thread waits for a core can take a whole
scheduler slice (4 to 16 ms) for a 0.4 ms product, while a one-thread kernel barely slows, so the
wrong kernel wins. Linux counts every CPU's busy time in /proc/stat and this process's own in
times(2); over an interval, their difference is the other processes' share.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# Both counters advance in clock ticks; over a short interval each may be off by a tick per reading.
_TICK_SLACK = 4


def watch_others(stat: Path = PROC_STAT) -> Callable[[], float | None]:
    """Start watching. The function returned gives the average number of CPUs that processes other than
    this one kept busy since the start, or None where the system does not say (no /proc/stat)."""
    first = _machine_busy_ticks(stat)
    if first is None:
        return lambda: None
    own, started = _own_ticks(), time.perf_counter()

    def busy_elsewhere() -> float | None:
        now, elapsed = _machine_busy_ticks(stat), time.perf_counter() - started
        if now is None or elapsed <= 0:
            return None
        others = (now - first) - (_own_ticks() - own) - _TICK_SLACK
        return max(0.0, others) / _ticks_per_second() / elapsed

    return busy_elsewhere


def machine_cpus(stat: Path = PROC_STAT) -> int:
    """The CPUs /proc/stat counts (every CPU of the machine, not only this process's), else os.cpu_count()."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return os.cpu_count() or 1
    return sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit()) or os.cpu_count() or 1


def _machine_busy_ticks(stat: Path) -> int | None:
    """All CPUs' busy ticks: user, nice, system, irq, softirq and steal (a hypervisor's other guests)."""
    try:
        with stat.open() as file:
            fields = file.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> float:
    times = os.times()
    return (times.user + times.system) * _ticks_per_second()


def _ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
