"""Tensor parallelism's processes: `candelabra serve --device-ids 0,1` on the CPU (two torch ranks over
Gloo), one machine as two nodes over loopback, stopping, and a rank that dies."""

from __future__ import annotations

import subprocess
import sys

import httpx
import psutil
import pytest

from candelabra.core.worker.rank_process import WorkerSpec
from candelabra.core.worker.topology import Topology
from live_server import LiveServer, write_chat_checkpoint
from support import free_port

PROMPT = "w10 w11 w12 w13 w14 w15"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("tp"))


def greedy(server: LiveServer, max_tokens: int = 12) -> list[int]:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    return reply["choices"][0]["logprobs"]["tokens"]


def serve_args(checkpoint, *extra: str) -> tuple[str, ...]:
    return ("--backend", "torch", "--dtype", "float32", "--weight-path", str(checkpoint), "--kvcache-mem-gpu", "8",
            "--kvcache-mem-cpu", "1", *extra)


def ranks_of(server: LiveServer) -> list[psutil.Process]:
    return psutil.Process(server.process.pid).children(recursive=True)


def test_a_topology_names_each_ranks_device_and_refuses_what_cannot_be():
    two_nodes = Topology((0, 1), num_nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29555)
    assert two_nodes.world_size == 4
    assert [(d.index, d.rank, d.world_size) for d in map(two_nodes.device, range(2))] == [(0, 2, 4), (1, 3, 4)]
    for kwargs, problem in (({"device_ids": (0, 0)}, "lists a device twice"),
                            ({"device_ids": (0,), "num_nodes": 2, "node_rank": 2}, "--node-rank must be in 0 to 1"),
                            ({"device_ids": (0,), "master_port": 0}, "--master-port must be in 1 to 65535")):
        with pytest.raises(ValueError, match=problem):
            Topology(**kwargs)
    spec = WorkerSpec("torch", "/m", None, None, None, "auto", None, "float32", None, two_nodes, 1)
    assert WorkerSpec.from_json(spec.to_json()) == spec


def test_two_ranks_answer_as_one_does_and_leave_nothing_behind_when_stopped(checkpoint):
    with LiveServer(*serve_args(checkpoint)) as alone:
        expected = greedy(alone)
        alone.stop()
    with LiveServer(*serve_args(checkpoint, "--device-ids", "0,1")) as parallel:
        ranks = ranks_of(parallel)
        assert len(ranks) == 1, "rank 1 runs as a child process of the server"
        assert greedy(parallel) == expected
        assert httpx.get(f"{parallel.url}/health").json() == {"status": "ok"}
        said = parallel.stop()
        assert parallel.process.returncode == 0 and "could not tell" not in said, said
    gone, alive = psutil.wait_procs(ranks, timeout=20)
    assert not alive, f"ranks left behind: {alive}"


def test_a_rank_that_dies_fails_the_requests_in_flight_and_stops_the_server(checkpoint):
    with LiveServer(*serve_args(checkpoint, "--device-ids", "0,1")) as parallel:
        rank = ranks_of(parallel)[0]
        body = {"model": parallel.model, "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{parallel.url}/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                events.append(line)
                if len(events) == 4:
                    rank.kill()
        errors = [event for event in events if "\"error\"" in event]
        assert len(errors) == 1 and "tensor-parallel" in errors[0], events[-6:]
        health = None
        try:
            health = httpx.get(f"{parallel.url}/health", timeout=5)
        except httpx.TransportError:
            pass  # the server may already have stopped
        if health is not None:
            assert health.status_code == 503 and "tensor-parallel rank 1" in health.json()["reason"]
        assert parallel.process.wait(timeout=60) == 1
        assert "the engine failed, so the server stopped" in "".join(parallel.output)


def test_one_machine_as_two_nodes_over_loopback(checkpoint, tmp_path):
    port = str(free_port())
    nodes = ("--num-nodes", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    second = subprocess.Popen([sys.executable, "-m", "candelabra.core.cli", "serve",
                               *serve_args(checkpoint, *nodes, "--node-rank", "1", "--device-ids", "1")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with LiveServer(*serve_args(checkpoint)) as alone:
            expected = greedy(alone)
            alone.stop()
        with LiveServer(*serve_args(checkpoint, *nodes, "--node-rank", "0", "--device-ids", "0")) as first:
            assert greedy(first) == expected
            first.stop()
        output, _ = second.communicate(timeout=60)
        assert second.returncode == 0, output
        assert "node 1: ranks 1 to 1 of 2" in output and "node 1: stopped" in output
    finally:
        if second.poll() is None:
            second.kill()


def test_the_parallel_conformance_level_is_green_on_torch_and_skipped_without_a_communicator(tmp_path):
    from support import run_candelabra

    report = tmp_path / "parallel.json"
    # Of the model cases, which tests/test_tensor_parallel_model.py runs at TP=2 itself, two: `-k` leaves
    # the others out of the one group of processes that runs them.
    two_models = "not test_parallel_model or test_parallel_model[qwen2-yarn] or test_parallel_model[gguf-qwen2-q4_0]"
    torch_run = run_candelabra("conformance", "--backend", "torch", "--level", "parallel", "--json", str(report),
                               "--", "-k", two_models)
    assert torch_run.returncode == 0, torch_run.stdout[-3000:] + torch_run.stderr[-3000:]
    import json

    parallel = json.loads(report.read_text())["parallel"]
    kinds = {entry["case"].split()[0] for entry in parallel}
    assert kinds == {"collective", "model", "engine"} and all(entry["status"] == "passed" for entry in parallel)
    assert sorted(entry["case"] for entry in parallel if entry["case"].startswith("model")) == [
        "model gguf-qwen2-q4_0", "model qwen2-yarn"]
    cpu_run = run_candelabra("conformance", "--backend", "cpu", "--level", "parallel", "--", "-rs")
    assert cpu_run.returncode == 5 or "skipped" in cpu_run.stdout, cpu_run.stdout[-2000:]
    assert "offers no communicator" in cpu_run.stdout
