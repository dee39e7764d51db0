"""Ranks kept to NUMA nodes: which node and cores each rank of a machine gets (core/worker/numa_nodes.py), on
faked topologies, and the torch backend keeping to them (backends/torch/numa_binding.py) on this machine."""

import json
import subprocess
import sys

import pytest

from candelabra.core.contract.device import Device
from candelabra.core.worker import numa_nodes
from candelabra.core.worker.numa_nodes import bindings, machine_nodes, parse_bind_nodes, parse_cpu_list
from candelabra.core.worker.topology import Topology

TWO_NODES = {0: frozenset(range(0, 4)), 1: frozenset(range(4, 8))}
EIGHT = frozenset(range(8))


def fake_sysfs(root, cpulists: dict[int, str]):
    for node, cpus in cpulists.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (root / "possible").write_text("0-1\n")
    return root


def test_cpu_lists_and_nodes_are_read_as_sysfs_writes_them(tmp_path):
    assert parse_cpu_list("0-3,8-11") == frozenset({0, 1, 2, 3, 8, 9, 10, 11})
    assert parse_cpu_list("5") == frozenset({5})
    root = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7", 2: ""})  # a node of memory alone has no CPUs
    assert machine_nodes(root) == TWO_NODES
    assert machine_nodes(tmp_path / "missing") == {}


def test_ranks_are_spread_over_two_nodes_and_share_each_nodes_cores():
    assert bindings(2, None, TWO_NODES, EIGHT) == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    assert bindings(4, None, TWO_NODES, EIGHT) == [(0, (0, 1)), (1, (4, 5)), (0, (2, 3)), (1, (6, 7))]


def test_the_flag_puts_ranks_where_it_says():
    assert bindings(2, (1, 1), TWO_NODES, EIGHT) == [(1, (4, 5)), (1, (6, 7))]
    assert bindings(1, (1,), TWO_NODES, EIGHT) == [(1, (4, 5, 6, 7))]
    assert bindings(2, (0, 1), TWO_NODES, frozenset({0, 1, 4})) == [(0, (0, 1)), (1, (4,))]  # within the mask


def test_one_node_one_rank_or_none_changes_nothing():
    assert bindings(2, None, {0: EIGHT}, EIGHT) == [None, None]
    assert bindings(1, None, TWO_NODES, EIGHT) == [None]
    assert bindings(2, (), TWO_NODES, EIGHT) == [None, None]


@pytest.mark.parametrize("nodes, problem", [((0,), "names 1 nodes for 2 device ids"),
                                            ((0, 2), "no NUMA node 2 with CPUs (it has 0, 1)")])
def test_a_flag_that_cannot_be_kept_is_refused(nodes, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        bindings(2, nodes, TWO_NODES, EIGHT)


def test_the_flag_is_parsed():
    assert parse_bind_nodes(None) is None
    assert parse_bind_nodes("none") == ()
    assert parse_bind_nodes("0, 0,1") == (0, 0, 1)
    with pytest.raises(ValueError, match="a NUMA node number per device id"):
        parse_bind_nodes("0,x")


def test_each_ranks_device_names_its_node_and_cores(monkeypatch):
    monkeypatch.setattr("candelabra.core.worker.topology.machine_nodes", lambda: TWO_NODES)
    monkeypatch.setattr("candelabra.core.worker.topology.allowed_cpus", lambda: EIGHT)
    topology = Topology((0, 1), master_port=29511)
    assert topology.device(1) == Device(1, 1, 2, numa_node=1, cores=(4, 5, 6, 7))
    alone = Topology((0,), master_port=29511, numa_bind_nodes=(1,))
    assert alone.device(0) == Device(0, 0, 1, numa_node=1, cores=(4, 5, 6, 7))
    assert Topology((0, 1), master_port=29511, numa_bind_nodes=()).device(0) == Device(0, 0, 2)


def test_on_this_machine_the_nodes_are_what_sysfs_says():
    nodes = machine_nodes()
    if not numa_nodes.NODE_ROOT.is_dir():
        pytest.skip("no /sys/devices/system/node here")
    assert nodes and all(cpus for cpus in nodes.values())


# In a child process, so that the test process keeps its cores: the torch backend bound as the Device says.
BIND = """
import json, logging, os, sys
import torch
from candelabra.backends.torch.backend import TorchBackend
from candelabra.core.contract.device import Device
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
node, cores = json.loads(sys.argv[1])
TorchBackend(Device(0, 0, 1, numa_node=node, cores=tuple(cores)))  # configures its device
print(json.dumps({"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}))
"""


def bound(node: int, cores: list[int]) -> tuple[dict, str]:
    run = subprocess.run([sys.executable, "-c", BIND, json.dumps([node, cores])], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1]), run.stderr


def test_the_torch_backend_keeps_a_rank_to_its_nodes_cores():
    nodes = machine_nodes()
    if not nodes:
        pytest.skip("no NUMA nodes listed here")
    node = min(nodes)
    core = max(nodes[node] & numa_nodes.allowed_cpus())
    state, log = bound(node, [core])
    assert state == {"cores": [core], "threads": 1}
    assert f"NUMA node {node}" in log  # kept to it, or, in a container that refuses, warned once
    assert log.count("WARNING") <= 1


def test_a_node_the_system_refuses_is_one_warning_and_the_rank_still_runs():
    nodes = machine_nodes()
    if not nodes:
        pytest.skip("no NUMA nodes listed here")
    core = min(numa_nodes.allowed_cpus())
    state, log = bound(max(nodes) + 7, [core])  # no such node: set_mempolicy refuses it
    assert state["cores"] == [core]
    assert log.count("WARNING") == 1 and "could not keep to NUMA node" in log and "set_mempolicy" in log
