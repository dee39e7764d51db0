"""`candelabra serve` against a peer OpenAI-compatible server (llama.cpp's llama-server on CPU) under the same
`candelabra bench` load, at growing numbers of clients.

    python bench/serve_vs_peer.py [--backend auto] [--model PATH] [--serve-arg=--dtype --serve-arg=bfloat16]
                                  [--peer-url http://127.0.0.1:8080] [--peer-name peer] [--peer-pid PID]
                                  [--clients 1 16 64] [--prompts-per-client 2] [--input-words 64]
                                  [--output-len 64] [--json FILE]

It starts `candelabra serve` on a free port of 127.0.0.1 (the default model unless --model) and sends each
server one warm-up request. Then, for each number of clients and each server in turn, max(clients *
--prompts-per-client, 8) streaming completions arrive at once with at most `clients` in flight, each of
--input-words random common words in and exactly --output-len tokens out; both servers get the same prompts.
It prints, per number of clients, output tokens per second and the median time to first token of both servers
and their ratio (candelabra/peer), then the resident memory (RSS) of our server and, with --peer-pid, of the
peer, each with its child processes: 3 s after the last load (idle), and the highest seen during any load
(sampled every 0.1 s). The server it started is stopped in every case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from candelabra.core.clients.bench import (
    ENDPOINT_PATHS,
    benchmark,
    make_prompts,
    measure_request,
    request_body,
    summarize,
)
from candelabra.core.clients.connection import (
    STREAM_TIMEOUT,
    api_headers,
    describe_failure,
    served_model,
    server_root,
)
from candelabra.core.clients.sse_client import ServerError
from candelabra.core.text_table import format_table

PEAK_SAMPLE_SECONDS = 0.1
# Resident memory "after the load" is read this long after it, once a server that gives memory back
# when idle (candelabra after 2 s) has done so; the highest during the load is reported beside it.
IDLE_SECONDS = 3.0
MIN_PROMPTS = 8  # so that a median at one client is not taken over two requests
STOP_TIMEOUT = 30.0
LOG_TAIL_LINES = 20


class BenchFailed(Exception):
    """A server could not be started, reached or warmed up; the message says which and why."""


@dataclass
class Server:
    label: str
    root: str
    model: str
    headers: dict[str, str]

    @property
    def completions_url(self) -> str:
        return self.root + ENDPOINT_PATHS["completions"]


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", help="candelabra's backend (default: %(default)s)")
    parser.add_argument("--model", metavar="PATH", help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `candelabra serve`, e.g. --serve-arg=--dtype "
                             "--serve-arg=bfloat16 (repeat for each)")
    parser.add_argument("--startup-timeout", type=float, default=600, metavar="SECONDS",
                        help="how long our server may take to answer /health (default: %(default)s)")
    parser.add_argument("--peer-url", metavar="URL", help="a running OpenAI-compatible server to compare with")
    parser.add_argument("--peer-name", default="peer", help="the peer's name in the table (default: %(default)s)")
    parser.add_argument("--peer-pid", type=int, metavar="PID", help="the peer's process, to measure its memory")
    parser.add_argument("--clients", type=positive_int, nargs="+", default=[1, 16, 64], metavar="N",
                        help="requests in flight at most, one row each (default: 1 16 64)")
    parser.add_argument("--prompts-per-client", type=positive_int, default=2, metavar="N",
                        help=f"requests per client at each row, at least {MIN_PROMPTS} in all (default: %(default)s)")
    parser.add_argument("--input-words", type=positive_int, default=64, metavar="WORDS",
                        help="words per prompt (default: %(default)s)")
    parser.add_argument("--output-len", type=positive_int, default=64, metavar="TOKENS",
                        help="tokens each request generates (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write every number as JSON")
    args = parser.parse_args(argv)
    if args.peer_pid is not None and not args.peer_url:
        parser.error("--peer-pid needs --peer-url")
    return args


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so that `finally` stops the server
    headers = api_headers(None)
    try:
        peer = connect(args.peer_name, args.peer_url, headers) if args.peer_url else None
        if args.peer_pid is not None:
            resident_memory(args.peer_pid)
        with tempfile.TemporaryDirectory(prefix="serve_vs_peer-") as folder:
            log = Path(folder) / "serve.log"
            process = start_server(args, log)
            try:
                root = wait_until_serving(process, log, args.startup_timeout)
                ours = connect("candelabra", root, headers)
                backend = started_backend(log)
                levels = measure_levels(ours, peer, process.pid, args)
            finally:
                stop_server(process)
    except BenchFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no results", file=sys.stderr)
        return 130

    print(f"candelabra: {ours.model} at {ours.root}, backend {backend}")
    if peer:
        print(f"{args.peer_name}: {peer.model} at {peer.root}")
    print(f"load: completions of {args.input_words} words in and {args.output_len} tokens out, all arriving at "
          "once, at most `clients` in flight")
    print(format_table(table_headers(args.peer_name, peer is not None), [table_row(level) for level in levels]))
    memory = memory_comparison(levels)
    print(memory_line(memory, args.peer_name))
    if args.json:
        write_json(args.json, args, ours, peer, backend, levels, memory)
    failures = report_failures(levels, args.peer_name)
    return 1 if failures else 0


def connect(label: str, url: str, headers: dict[str, str]) -> Server:
    root = server_root(url)
    try:
        with httpx.Client(headers=headers, timeout=STREAM_TIMEOUT) as client:
            return Server(label, root, served_model(client, root), headers)
    except (ServerError, httpx.HTTPError) as error:
        raise BenchFailed(f"{label}: {describe_failure(error, root)}") from None


def start_server(args: argparse.Namespace, log: Path) -> subprocess.Popen:
    """`candelabra serve` on a free port of 127.0.0.1, its output going to `log`, in a session of its own so that a
    Ctrl-C here reaches only this script, which then stops the server itself."""
    command = [sys.executable, "-m", "candelabra.core.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--backend", args.backend]
    if args.model:
        command += ["--weight-path", args.model]
    command += args.serve_arg
    print(f"Starting {' '.join(command[2:])}", file=sys.stderr)
    with open(log, "w") as output:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_until_serving(process: subprocess.Popen, log: Path, timeout: float) -> str:
    """The server's URL once its /health answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchFailed(f"candelabra serve exited with status {process.returncode}; its output ended with:\n"
                              + output_tail(log))
        url = served_url(log.read_text())
        if url and answers_health(url):
            return url
        time.sleep(0.5)
    raise BenchFailed(f"candelabra serve did not answer /health within {timeout:g} s; its output ended with:\n"
                      + output_tail(log))


def served_url(start_up: str) -> str | None:
    found = re.search(r"^serving\s+(http://\S+)", start_up, re.MULTILINE)
    return found.group(1) if found else None


def started_backend(log: Path) -> str:
    """What the start-up says of the backend, e.g. "cpu on cpu (2 cores, numpy 2.4.6)"."""
    found = re.search(r"^backend\s+(.+)$", log.read_text(), re.MULTILINE)
    return found.group(1).strip() if found else "backend unknown"


def answers_health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def output_tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return "\n".join("    " + line for line in lines) or "    (nothing)"


def stop_server(process: subprocess.Popen) -> None:
    """SIGINT as a terminal's Ctrl-C, SIGKILL after STOP_TIMEOUT seconds, then SIGKILL to whatever is left of
    its process group."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def measure_levels(ours: Server, peer: Server | None, server_pid: int, args: argparse.Namespace) -> list[dict]:
    """One warm-up request per server, then each number of clients on each server in turn."""
    counts = [max(clients * args.prompts_per_client, MIN_PROMPTS) for clients in args.clients]
    # Fresh prompts at every level, so that no server finds a prompt of an earlier level in its prefix cache.
    prompts = make_prompts(1 + sum(counts), args.input_words, args.seed)
    servers = {"candelabra": ours, "peer": peer} if peer else {"candelabra": ours}
    for server in servers.values():
        warm_up(server, prompts[0], args.output_len)
    levels, first = [], 1
    for clients, count in zip(args.clients, counts, strict=True):
        level_prompts, first = prompts[first:first + count], first + count
        level = {"clients": clients, "num_prompts": count, "peer": None, "peer_rss_bytes": None,
                 "peer_peak_rss_bytes": None}
        pids = {"candelabra": server_pid, "peer": args.peer_pid}
        for key, server in servers.items():
            print(f"{server.label}: {count} requests, at most {clients} in flight", file=sys.stderr)
            with PeakMemory(pids[key]) as peak:
                level[key] = run_load(server, level_prompts, clients, args.output_len)
            level[f"{key}_peak_rss_bytes"] = peak.bytes
        time.sleep(IDLE_SECONDS)
        level["candelabra_rss_bytes"] = resident_memory(server_pid)
        if args.peer_pid is not None:
            level["peer_rss_bytes"] = resident_memory(args.peer_pid)
        levels.append(level | ratios(level["candelabra"], level["peer"]))
    return levels


def warm_up(server: Server, prompt: str, output_len: int) -> None:
    body = request_body("completions", server.model, prompt, output_len)

    async def one_request():
        async with httpx.AsyncClient(headers=server.headers, timeout=STREAM_TIMEOUT) as client:
            return await measure_request(client, server.completions_url, body)

    print(f"Warming up {server.label} at {server.root} with one request.", file=sys.stderr)
    result = asyncio.run(one_request())
    if not result.ok:
        raise BenchFailed(f"the warm-up request to {server.label} failed: {result.error}")


def run_load(server: Server, prompts: list[str], clients: int, output_len: int) -> dict:
    """`candelabra bench`'s summary of the prompts sent all at once, at most `clients` in flight."""
    bodies = [request_body("completions", server.model, prompt, output_len) for prompt in prompts]
    arrivals = [0.0] * len(bodies)
    results, duration = asyncio.run(benchmark(server.completions_url, server.headers, bodies, arrivals, 0, clients,
                                              sys.stderr.isatty()))
    return summarize(results, duration)


class PeakMemory:
    """The most resident memory of process `pid` (with its descendants) seen while the block runs,
    sampled every PEAK_SAMPLE_SECONDS; None for no pid."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.bytes = pid, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakMemory:
        if self.pid is not None:
            self.bytes = resident_memory(self.pid)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.pid is not None:
            self._done.set()
            self._thread.join()

    def _sample(self) -> None:
        while not self._done.wait(PEAK_SAMPLE_SECONDS):
            try:
                self.bytes = max(self.bytes, resident_memory(self.pid))
            except BenchFailed:  # the process ended; the load reports why
                return


def resident_memory(pid: int) -> int:
    """Bytes resident of the process and all its descendants."""
    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)]
        return sum(member.memory_info().rss for member in family)
    except psutil.NoSuchProcess:
        raise BenchFailed(f"there is no process {pid} to measure the memory of") from None
    except psutil.AccessDenied:
        raise BenchFailed(f"no permission to read the memory of process {pid}") from None


def ratios(ours: dict, theirs: dict | None) -> dict:
    if theirs is None:
        return {"output_throughput_ratio": None, "median_ttft_ratio": None}
    return {"output_throughput_ratio": ratio(ours["output_token_throughput"], theirs["output_token_throughput"]),
            "median_ttft_ratio": ratio(ours["ttft_ms"]["median"], theirs["ttft_ms"]["median"])}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def table_headers(peer_name: str, with_peer: bool) -> list[str]:
    if not with_peer:
        return ["clients", "candelabra tok/s", "candelabra median TTFT ms"]
    return ["clients", "candelabra tok/s", f"{peer_name} tok/s", f"candelabra/{peer_name}",
            "candelabra median TTFT ms", f"{peer_name} median TTFT ms", f"candelabra/{peer_name}"]


def table_row(level: dict) -> list[str]:
    ours, theirs = level["candelabra"], level["peer"]
    if theirs is None:
        return [level["clients"], number(ours["output_token_throughput"]), number(ours["ttft_ms"]["median"])]
    return [level["clients"], number(ours["output_token_throughput"]), number(theirs["output_token_throughput"]),
            number(level["output_throughput_ratio"], 2), number(ours["ttft_ms"]["median"]),
            number(theirs["ttft_ms"]["median"]), number(level["median_ttft_ratio"], 2)]


def number(value: float | None, decimals: int = 1) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def memory_comparison(levels: list[dict]) -> dict:
    ours, theirs = levels[-1]["candelabra_rss_bytes"], levels[-1]["peer_rss_bytes"]
    our_peak = max(level["candelabra_peak_rss_bytes"] for level in levels)
    peer_peaks = [level["peer_peak_rss_bytes"] for level in levels if level["peer_peak_rss_bytes"] is not None]
    their_peak = max(peer_peaks) if peer_peaks else None
    return {"candelabra_rss_bytes": ours, "peer_rss_bytes": theirs, "ratio": ratio(ours, theirs),
            "candelabra_peak_rss_bytes": our_peak, "peer_peak_rss_bytes": their_peak,
            "peak_ratio": ratio(our_peak, their_peak)}


def memory_line(memory: dict, peer_name: str) -> str:
    after = f"candelabra {mebibytes(memory['candelabra_rss_bytes'])}"
    peak = f"candelabra {mebibytes(memory['candelabra_peak_rss_bytes'])}"
    if memory["peer_rss_bytes"] is not None:
        after += (f", {peer_name} {mebibytes(memory['peer_rss_bytes'])}, "
                  f"candelabra/{peer_name} {number(memory['ratio'], 2)}")
        peak += (f", {peer_name} {mebibytes(memory['peer_peak_rss_bytes'])}, "
                 f"candelabra/{peer_name} {number(memory['peak_ratio'], 2)}")
    return f"resident memory 3 s after the load: {after}\nat its highest during the load: {peak}"


def mebibytes(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def report_failures(levels: list[dict], peer_name: str) -> int:
    """Says on stderr which levels had failed requests, and why; how many failed in all."""
    failed = 0
    for level in levels:
        for key, name in (("candelabra", "candelabra"), ("peer", peer_name)):
            summary = level[key]
            if summary and summary["failed_requests"]:
                failed += summary["failed_requests"]
                reasons = "; ".join(f"{e['message']} ({e['count']})" for e in summary["errors"])
                print(f"warning: {name} failed {summary['failed_requests']} of {level['num_prompts']} requests "
                      f"at {level['clients']} clients: {reasons}", file=sys.stderr)
    return failed


def write_json(path: str, args: argparse.Namespace, ours: Server, peer: Server | None, backend: str,
               levels: list[dict], memory: dict) -> None:
    config = {name: getattr(args, name) for name in ("backend", "model", "serve_arg", "peer_url", "peer_name",
                                                     "peer_pid", "clients", "prompts_per_client", "input_words",
                                                     "output_len", "seed")}
    servers = {"candelabra": {"url": ours.root, "model": ours.model, "backend": backend},
               "peer": {"url": peer.root, "model": peer.model} if peer else None}
    with open(path, "w") as file:
        json.dump({"config": config, "servers": servers, "levels": levels, "memory": memory}, file, indent=2)


if __name__ == "__main__":
    sys.exit(main())
