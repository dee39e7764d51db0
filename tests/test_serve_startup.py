"""`candelabra serve` before and after serving: which mistakes it reports and in what order, what it
refuses, and what it says when it stops."""

import socket

import httpx
import pytest
import torch

from candelabra.core import cli
from candelabra.core.server.launch import check_arguments
from live_server import LiveServer, write_chat_checkpoint
from support import run_candelabra


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture
def busy_port():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        yield str(taken.getsockname()[1])


def serve_args(*argv: str):
    parser = cli._parser(chosen="serve")
    return parser.parse_args(["serve", *argv])


def test_a_wrong_backend_or_path_is_reported_before_a_busy_port(checkpoint, busy_port):
    wrong_backend = run_candelabra("serve", "--weight-path", str(checkpoint), "--backend", "nosuch",
                                   "--port", busy_port)
    assert wrong_backend.returncode == 1 and "no backend named 'nosuch'" in wrong_backend.stderr
    no_gcu = run_candelabra("serve", "--weight-path", str(checkpoint), "--backend", "gcu", "--port", busy_port)
    assert no_gcu.returncode == 1 and "backend 'gcu' is not available: torch_gcu is not installed" in no_gcu.stderr
    unavailable = run_candelabra("serve", "--weight-path", str(checkpoint), "--backend", "cuda", "--port", busy_port)
    wrong_path = run_candelabra("serve", "--weight-path", str(checkpoint / "missing"), "--port", busy_port)
    assert wrong_path.returncode == 1 and "does not exist" in wrong_path.stderr
    wrong_type = run_candelabra("serve", "llama3", "--weight-path", str(checkpoint), "--backend", "cpu",
                                "--port", busy_port)
    assert wrong_type.returncode == 1 and "model type 'llama3' does not match" in wrong_type.stderr
    refused = [wrong_backend, no_gcu, wrong_path, wrong_type]
    if not torch.cuda.is_available():
        assert unavailable.returncode == 1 and "backend 'cuda' is not available: " in unavailable.stderr
        refused.append(unavailable)
    for result in refused:
        assert "in use" not in result.stderr and result.stderr.count("error:") == 1
        assert result.stderr.splitlines()[-1].startswith("error: ")


def test_a_busy_port_says_what_to_do(checkpoint, busy_port):
    result = run_candelabra("serve", "--weight-path", str(checkpoint), "--backend", "cpu", "--port", busy_port)
    assert result.returncode == 1 and result.stderr.count("error:") == 1
    message = result.stderr.splitlines()[-1]
    assert f"cannot listen on 127.0.0.1:{busy_port}" in message and "already in use" in message
    assert "server that is already running" in message and "--port N" in message and "--port 0" in message
    assert "loading weights" not in message  # refused before the weights load


@pytest.mark.parametrize("flags, problem", [
    (["--max-model-len", "1"], "--max-model-len must be at least 2 (a prompt token and a generated one), not 1"),
    (["--max-model-len", "0"], "--max-model-len must be at least 2"),
    (["--max-gen-tokens", "0"], "--max-gen-tokens must be at least 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1"),
    (["--prefill-chunk-size", "-1"], "--prefill-chunk-size must be at least 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["--port", "70000"], "--port must be in 0 to 65535"),
    (["--device-ids", "0,0"], "--device-ids 0,0: a device is named twice"),
    (["--num-nodes", "2", "--node-rank", "2"], "--node-rank must be in 0 to 1 (--num-nodes 2), not 2"),
    (["--device-ids", "0,1", "--master-port", "70000"], "--master-port must be in 1 to 65535, not 70000"),
    (["--device-ids", "gpu"], "--device-ids gpu: a device is a number"),
    (["--device-ids", "0,1", "--numa-bind-nodes", "0"], "--numa-bind-nodes names 1 nodes for 2 device ids: one each"),
    (["--numa-bind-nodes", "99"], "--numa-bind-nodes: this machine has no NUMA node 99 with CPUs"),
    (["--numa-bind-nodes", "zero"], "--numa-bind-nodes zero: a NUMA node number per device id"),
    (["--kvcache-mem-gpu", "0"], "--kvcache-mem-gpu must be more than 0 MB"),
    (["--kv-fraction", "0"], "--kv-fraction is a share of the free memory, more than 0 and at most 1, not 0"),
    (["--kv-fraction", "1.5"], "--kv-fraction is a share of the free memory, more than 0 and at most 1, not 1.5"),
    (["--kvcache-mem-cpu", "-1"], "--kvcache-mem-cpu must be 0 MB (no swap space) or more"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be 0 seconds or more"),
    (["--temperature", "-0.5"], "--temperature: temperature must be >= 0"),
    (["--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p: top_p must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k: top_k must be >= 0"),
    (["--penalty", "0"], "--penalty: repetition_penalty must be > 0"),
    (["--repeat-last-n", "-1"], "--repeat-last-n: repeat_last_n must be >= 0"),
    (["--num-experts-offload-per-rank", "-1"], "--num-experts-offload-per-rank must be at least 1 to keep experts"),
    (["--num-experts-offload-per-rank", "4", "--expert-cache-slots", "5"],
     "--expert-cache-slots must be between 1 and --num-experts-offload-per-rank (4), not 5"),
    (["--expert-cache-slots", "2"], "--expert-cache-slots sizes the device's cache of experts kept in host memory: "
                                    "give --num-experts-offload-per-rank too"),
])
def test_values_that_cannot_serve_a_request_are_refused(flags, problem):
    with pytest.raises(ValueError) as caught:
        check_arguments(serve_args(*flags))
    assert problem in str(caught.value)


def test_good_values_pass_the_checks():
    check_arguments(serve_args("--max-model-len", "2", "--temperature", "0", "--top-p", "1", "--top-k", "-1",
                               "--kvcache-mem-cpu", "0", "--prefill-chunk-size", "0", "--shutdown-grace", "0",
                               "--kv-fraction", "1", "--device-ids", "0", "--async-scheduling"))
    check_arguments(serve_args("--numa-bind-nodes", "none"))


def test_async_scheduling_is_the_engine_default_unless_a_flag_says_otherwise():
    assert serve_args().async_scheduling is None  # the engine's: ahead where the device runs apart
    assert serve_args("--async-scheduling").async_scheduling is True
    assert serve_args("--no-async-scheduling").async_scheduling is False
    check_arguments(serve_args("--async-scheduling", "--device-ids", "0,1"))  # tensor parallelism too


def test_candle_vllm_gcu_short_flags_are_the_long_ones():
    short = serve_args("--w", "/models/qwq", "--f", "qwq.gguf", "--m", "org/name", "--p", "2001", "--d", "0",
                       "--mem", "8192")
    long = serve_args("--weight-path", "/models/qwq", "--weight-file", "qwq.gguf", "--model-id", "org/name",
                      "--port", "2001", "--device-ids", "0", "--kvcache-mem-gpu", "8192")
    assert vars(short) == vars(long)


def test_a_refused_value_exits_2_in_one_line_before_anything_loads(checkpoint, capsys):
    assert cli.main(["serve", "--weight-path", str(checkpoint / "missing"), "--max-model-len", "1"]) == 2
    error = capsys.readouterr().err
    assert error == "error: --max-model-len must be at least 2 (a prompt token and a generated one), not 1\n"


def test_a_kv_cache_too_small_for_one_block_says_how_big_a_block_is(checkpoint):
    result = run_candelabra("serve", "--weight-path", str(checkpoint), "--backend", "cpu", "--port", "0",
                            "--kvcache-mem-gpu", "0.0001")
    assert result.returncode == 1
    assert "kvcache_mem_gpu (0.0001 MB) holds no KV cache block: one block of 16 tokens takes" in result.stderr


def test_the_version_flag_prints_the_name_and_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == "candelabra 0.1.0"


def test_serve_help_explains_the_backend_default_and_the_sampling_flags():
    help_text = " ".join(cli._parser(chosen="serve")._subparsers._group_actions[0].choices["serve"]
                         .format_help().split())
    assert "--backend BACKEND an installed backend" in help_text and "(default: auto)" in help_text
    for flag, words in (("--temperature", "0 always takes the likeliest token"),
                        ("--top-k", "the K likeliest tokens"), ("--top-p", "add up to P")):
        assert f"{flag} {flag[2:].upper().replace('-', '_')} " in help_text and words in help_text


def test_stopping_an_idle_server_says_so(checkpoint):
    with LiveServer("--weight-path", str(checkpoint), "--backend", "cpu", "--kvcache-mem-gpu", "2") as server:
        output = server.stop()
    # A clean stop, whether the shell that started it left Ctrl-C to it or ignored it for background jobs.
    assert server.process.returncode == 0
    assert "Traceback" not in output
    assert output.splitlines()[-1] == "stopped; no request was in flight"


def test_stopping_ends_a_request_in_flight_and_counts_it(checkpoint):
    args = ("--weight-path", str(checkpoint), "--backend", "cpu", "--kvcache-mem-gpu", "2", "--shutdown-grace", "0")
    with LiveServer(*args) as server:
        body = {"prompt": "w10 w11 w12", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # it is running
            output = server.stop()
            rest = [line for line in lines if line]
    assert '"the server is shutting down"' in rest[-2] and rest[-1] == "data: [DONE]"
    assert "Traceback" not in output
    assert output.splitlines()[-1] == "stopped; 1 request in flight aborted"
