"""The CPUs other processes keep busy, read from the real /proc/stat: a spinning child is seen, and this
process's own work is not counted as another's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from candelabra.backends.torch.cpu_load import machine_cpus, watch_others

linux_only = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc/stat")


@linux_only
def test_a_child_spinning_a_cpu_is_seen_as_busy_elsewhere():
    """The CPU time the child spins through while watched (a second of it, however long that takes on a
    loaded machine) is counted as busy elsewhere, with whatever else the machine ran."""
    spin = ("import sys, time\nsys.stdin.readline()\nstart = time.process_time()\n"
            "while time.process_time() - start < 1.0: pass\nprint('spun', flush=True)\nwhile True: pass")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        busy_elsewhere, started = watch_others(), time.perf_counter()
        child_start = _cpu_seconds(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "spun"  # a CPU-second of its own spent since "go"
        child_seconds = _cpu_seconds(child.pid) - child_start
        elapsed = time.perf_counter() - started
        assert busy_elsewhere() >= 0.9 * child_seconds / elapsed
    finally:
        child.kill()
        child.wait()


def _cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time, from /proc/PID/stat (fields 14 and 15, after its name)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_this_processs_own_cpu_time_is_taken_off_the_machines(tmp_path):
    """The machine's counters (a stand-in file) advance by one and a half CPU-seconds while this process
    spins for one of them: the others used about half a CPU."""
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text("cpu  1000 0 500 9000 0 0 0 0 0 0\n")
    busy_elsewhere = watch_others(stat)
    started_cpu, started = time.process_time(), time.perf_counter()
    while time.process_time() - started_cpu < 1.0:
        pass
    elapsed = time.perf_counter() - started
    stat.write_text(f"cpu  {1000 + int(1.0 * hz)} 0 {500 + int(0.5 * hz)} 9000 0 0 0 0 0 0\n")
    assert busy_elsewhere() == pytest.approx(0.5 / elapsed, abs=0.1)


def test_without_proc_stat_the_load_is_unknown(tmp_path):
    missing = tmp_path / "stat"
    assert watch_others(missing)() is None
    missing.write_text("not a stat line\n")
    assert watch_others(missing)() is None
    assert machine_cpus(tmp_path / "absent") >= 1


def test_the_machines_cpus_are_counted_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 100 0 0 0 0 0 0\ncpu0 5 0 2 50 0 0 0 0 0 0\ncpu1 5 0 3 50 0 0 0 0 0 0\nintr 1\n")
    assert machine_cpus(stat) == 2
