"""`candelabra bench`: concurrent streaming load on a running server, measuring time to first token,
time per output token, inter-token latency, end-to-end latency and throughput.

Every request streams with usage included and ignore_eos, so each produces exactly --output-len tokens.
Times are taken when a chunk arrives; a chunk may carry more than one token, so TPOT divides the time after
the first token by the usage's token count, while ITL records the raw gaps between chunks."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from candelabra.core.clients.connection import (
    STREAM_TIMEOUT,
    add_server_arguments,
    api_headers,
    describe_failure,
    served_model,
    server_root,
)
from candelabra.core.clients.sse_client import ServerError, aiter_events
from candelabra.core.text_table import format_table

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ERRORS_SHOWN = 5

# Prompts are random draws from these, so that most tokenizers give about one token per word.
COMMON_WORDS = tuple("""
the of and to in is that it was for on are as with his they at be this from have or by one had not but what
all were when we there can an your which their said if do will each about how up out them then she many some
so these would other into has more her two like him see time could no make than first been its who now people
my made over did down only way find use may water long little very after words called just where most know
get through back much before go good new write our used me man too any day same right look think also around
another came come work three word must because does part even place well such here take why things help put
years different away again off went old number great tell men say small every found still between name should
home big give air line set own under read last never us left end along while might next sound below saw
something thought both few those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals life enough took sometimes
four head above kind began almost live page got earth need far hand high year mother light country father let
night picture being study second soon story since white ever paper hard near sentence better best across during
today however sure knew try told young sun thing whole hear example heard several change answer room sea against
""".split())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--endpoint", choices=tuple(ENDPOINT_PATHS), default="completions",
                        help="which API to load (default: %(default)s)")
    parser.add_argument("--num-prompts", type=_positive_int, metavar="N", default=32,
                        help="requests measured (default: %(default)s)")
    parser.add_argument("--concurrency", type=_positive_int, metavar="N", default=16,
                        help="most requests in flight at once (default: %(default)s)")
    parser.add_argument("--request-rate", type=_positive_float, metavar="RATE", default=math.inf,
                        help="requests per second, arriving as a Poisson process (default: inf, all at once)")
    parser.add_argument("--input-len", type=_positive_int, metavar="WORDS", default=64,
                        help="words per prompt, random common English words (default: %(default)s)")
    parser.add_argument("--output-len", type=_positive_int, metavar="TOKENS", default=64,
                        help="tokens each request generates (max_tokens with ignore_eos; default: %(default)s)")
    parser.add_argument("--seed", type=int, metavar="N", default=0,
                        help="seed of the prompts and arrival times (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--warmup", type=_at_least_zero, metavar="N", default=1,
                        help="requests sent first and not measured (default: %(default)s)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="show no progress bar of the finished requests on stderr")


def run(args: argparse.Namespace) -> int:
    root = server_root(args.url)
    headers = api_headers(args.api_key)
    try:
        with httpx.Client(headers=headers, timeout=STREAM_TIMEOUT) as client:
            model = args.model or served_model(client, root)
    except (ServerError, httpx.HTTPError) as error:
        print(f"error: {describe_failure(error, root)}", file=sys.stderr)
        return 1
    url = root + ENDPOINT_PATHS[args.endpoint]
    prompts = make_prompts(args.warmup + args.num_prompts, args.input_len, args.seed)
    bodies = [request_body(args.endpoint, model, prompt, args.output_len) for prompt in prompts]
    arrivals = arrival_times(args.num_prompts, args.request_rate, args.seed)
    pace = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} per second"
    print(f"Benchmarking {model} at {url}: {args.num_prompts} requests of {args.input_len} words in and "
          f"{args.output_len} tokens out, arriving {pace}, at most {args.concurrency} in flight.", file=sys.stderr)

    try:
        outcome = asyncio.run(benchmark(url, headers, bodies, arrivals, args.warmup, args.concurrency,
                                        args.progress))
    except KeyboardInterrupt:
        print("interrupted; no results", file=sys.stderr)
        return 130
    if isinstance(outcome, str):
        print(f"error: the warmup request failed: {outcome}", file=sys.stderr)
        return 1
    results, duration = outcome
    summary = summarize(results, duration)
    print(format_report(summary))
    if args.json:
        config = {name: getattr(args, name) for name in
                  ("endpoint", "num_prompts", "concurrency", "input_len", "output_len", "seed", "warmup")}
        config |= {"url": url, "model": model,
                   "request_rate": None if math.isinf(args.request_rate) else args.request_rate}
        requests = [{**asdict(result), "tpot": result.tpot} for result in results]
        with open(args.json, "w") as file:
            json.dump({"config": config, "summary": summary, "requests": requests}, file, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1


async def benchmark(url: str, headers: dict[str, str], bodies: Sequence[dict], arrivals: Sequence[float],
                    warmup: int, concurrency: int, progress: bool) -> tuple[list[RequestResult], float] | str:
    """The first `warmup` bodies one after another, unmeasured, then the load, with a progress bar of the
    finished requests on stderr; or the warmup's error."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=STREAM_TIMEOUT, limits=limits) as client:
        if warmup:
            print(f"Warming up with {warmup} request(s).", file=sys.stderr)
        for body in bodies[:warmup]:
            result = await measure_request(client, url, body)
            if not result.ok:
                return result.error
        with tqdm(total=len(arrivals), desc="benchmarking", unit="request", disable=not progress) as bar:
            return await run_load(client, url, bodies[warmup:], arrivals, concurrency, bar)


def make_prompts(count: int, words_per_prompt: int, seed: int) -> list[str]:
    """`count` different prompts, each of `words_per_prompt` random common words, the same for the same seed."""
    rng = random.Random(f"prompts-{seed}")
    return [" ".join(rng.choices(COMMON_WORDS, k=words_per_prompt)) for _ in range(count)]


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: a Poisson process of `rate` per second (gaps
    drawn from an exponential distribution), or all at once for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{seed}")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def request_body(endpoint: str, model: str, prompt: str, output_len: int) -> dict:
    body = {"model": model, "max_tokens": output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


@dataclass
class RequestResult:
    """One request's measurements, in seconds."""

    ok: bool = False
    error: str = ""
    ttft: float | None = None
    latency: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


async def measure_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """Streams one request, timing each chunk that carries text; any failure is kept in the result."""
    result = RequestResult()
    usage = None
    start = time.perf_counter()
    last_text_at = None
    try:
        async with client.stream("POST", url, json=body) as response:
            async for event in aiter_events(response):
                now = time.perf_counter()
                if event.get("usage"):
                    usage = event["usage"]
                if any(_generated_text(choice) for choice in event.get("choices") or []):
                    if last_text_at is None:
                        result.ttft = now - start
                    else:
                        result.chunk_gaps.append(now - last_text_at)
                    last_text_at = now
        result.latency = time.perf_counter() - start
    except (ServerError, httpx.HTTPError) as error:
        result.error = describe_failure(error, url)
        return result
    if usage is None:
        result.error = f"{url} sent no usage chunk although stream_options.include_usage was set"
        return result
    result.prompt_tokens = usage.get("prompt_tokens") or 0
    result.completion_tokens = usage.get("completion_tokens") or 0
    result.ok = True
    return result


def _generated_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    return choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""


async def run_load(client: httpx.AsyncClient, url: str, bodies: Sequence[dict], arrivals: Sequence[float],
                   concurrency: int, bar: tqdm) -> tuple[list[RequestResult], float]:
    """Sends each body at its arrival time (waiting further while `concurrency` requests are in flight),
    counting each finished request on `bar` and the failed ones in its postfix; the results in the order of
    `bodies`, and the wall time of the whole run."""
    in_flight = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    failed = 0

    async def send(body: dict, arrival: float) -> RequestResult:
        nonlocal failed
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        async with in_flight:
            result = await measure_request(client, url, body)
        if not result.ok:
            failed += 1
            bar.set_postfix(failed=failed, refresh=False)
        bar.update()
        return result

    results = await asyncio.gather(*(send(body, arrival) for body, arrival in zip(bodies, arrivals, strict=True)))
    return list(results), time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 to 100), interpolating linearly between the two nearest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, 90th and 99th percentiles; all None for no values."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    return {"mean": math.fsum(values) / len(values), "median": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def summarize(results: Sequence[RequestResult], duration: float) -> dict:
    """The whole run's statistics: counts, throughputs over the wall time `duration`, and latency
    distributions in milliseconds over the successful requests."""
    done = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    completion_tokens = sum(r.completion_tokens for r in done)
    per_second = (lambda amount: amount / duration) if duration > 0 else (lambda amount: None)
    milliseconds = lambda seconds: [1000 * s for s in seconds if s is not None]
    return {
        "successful_requests": len(done),
        "failed_requests": len(results) - len(done),
        "errors": [{"message": message, "count": count} for message, count in errors.most_common(ERRORS_SHOWN)],
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_completion_tokens": completion_tokens,
        "request_throughput": per_second(len(done)),
        "output_token_throughput": per_second(completion_tokens),
        "total_token_throughput": per_second(prompt_tokens + completion_tokens),
        "ttft_ms": distribution(milliseconds(r.ttft for r in done)),
        "tpot_ms": distribution(milliseconds(r.tpot for r in done)),
        "itl_ms": distribution(milliseconds(gap for r in done for gap in r.chunk_gaps)),
        "e2e_latency_ms": distribution(milliseconds(r.latency for r in done)),
    }


def format_report(summary: dict) -> str:
    totals = [
        ("successful requests", summary["successful_requests"]),
        ("failed requests", summary["failed_requests"]),
        ("wall time (s)", _number(summary["duration_s"])),
        ("prompt tokens", summary["total_prompt_tokens"]),
        ("completion tokens", summary["total_completion_tokens"]),
        ("request throughput (req/s)", _number(summary["request_throughput"])),
        ("output throughput (tok/s)", _number(summary["output_token_throughput"])),
        ("total throughput (tok/s)", _number(summary["total_token_throughput"])),
    ]
    statistics = ("mean", "median", "p90", "p99")
    latencies = [
        (name, *(_number(summary[key][statistic]) for statistic in statistics))
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_latency_ms"))
    ]
    lines = [format_table(("metric", "value"), totals), "", format_table(("latency (ms)", *statistics), latencies)]
    lines += [f"error ({e['count']} requests): {e['message']}" for e in summary["errors"]]
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value
