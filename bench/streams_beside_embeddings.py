"""Streams beside a large embeddings request: the gaps between one stream's tokens with and without it.

    python bench/streams_beside_embeddings.py --url http://127.0.0.1:2000 [--streams 16] [--inputs 2048]
                                              [--output-tokens 64] [--text "a few words"]
                                              [--encoding-format float|base64] [--json FILE]

Against a server already running. First --streams streaming completions run alone; then the same
streams again, and once each has its first token, one embeddings request of --inputs inputs ("TEXT 0",
"TEXT 1", ...) comes. The
server splits the embeddings request into slices that share each step's token budget with the
streams, so the streams' gaps grow by a slice's time at most, instead of stalling until the whole
request is done. The table gives the distribution of the gaps between successive tokens of every
stream (the first token, the time to first token, is left out) both ways, the time the embeddings
request took, and how many stream tokens came while it ran; then whether every stream finished and
the KV cache blocks still held afterwards (from /metrics), which should be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from candelabra.core.clients.bench import percentile, request_body
from candelabra.core.clients.sse_client import ServerError, acheck_status, aiter_events
from candelabra.core.text_table import format_table

DEFAULT_TEXT = "the quick brown fox jumps over the lazy dog"


@dataclass
class Run:
    """One round of streams, beside an embeddings request or not; times in seconds."""

    gaps: list[float] = field(default_factory=list)  # between successive tokens, every stream's
    finished: int = 0  # streams that ended well
    errors: list[str] = field(default_factory=list)
    embeddings_seconds: float | None = None  # from sending the embeddings request to its answer
    embeddings_status: int | None = None
    tokens_while_embedding: int = 0  # stream tokens that came while the embeddings request ran

    def gap(self, q: float) -> float | None:
        return percentile(self.gaps, q) if self.gaps else None


async def run_streams(url: str, model: str, streams: int, output_tokens: int, text: str,
                      embedding_inputs: int = 0, encoding_format: str = "float") -> Run:
    """`streams` streaming completions at once and, once each has its first token, one embeddings request of
    `embedding_inputs` inputs (none for 0)."""
    run = Run()
    limits = httpx.Limits(max_connections=streams + 2, max_keepalive_connections=streams + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        first_tokens = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(_stream(client, f"{url}/v1/completions", {
            **request_body("completion", model, f"{text} {i}", output_tokens), "temperature": 0}, first_tokens[i]))
            for i in range(streams)]
        if embedding_inputs:
            await asyncio.wait([asyncio.create_task(event.wait()) for event in first_tokens])
            body = {"model": model, "input": [f"{text} {i}" for i in range(embedding_inputs)],
                    "encoding_format": encoding_format}
            sent = time.perf_counter()
            response = await client.post(f"{url}/v1/embeddings", json=body)
            answered = time.perf_counter()
            run.embeddings_seconds, run.embeddings_status = answered - sent, response.status_code
        results = await asyncio.gather(*tasks)
    for times, error in results:
        if error:
            run.errors.append(error)
            continue
        run.finished += 1
        run.gaps += [later - earlier for earlier, later in zip(times, times[1:])]
        if embedding_inputs:
            run.tokens_while_embedding += sum(sent <= at <= answered for at in times)
    return run


async def _stream(client: httpx.AsyncClient, url: str, body: dict, first_token: asyncio.Event
                  ) -> tuple[list[float], str]:
    """When each chunk with text came, and what went wrong, if anything ("" for nothing)."""
    times = []
    try:
        async with client.stream("POST", url, json=body) as response:
            await acheck_status(response)
            async for event in aiter_events(response):
                if any(choice.get("text") for choice in event.get("choices") or []):
                    times.append(time.perf_counter())
                    first_token.set()
    except (ServerError, httpx.HTTPError) as error:
        return times, str(error) or type(error).__name__
    finally:
        first_token.set()  # a stream that failed first does not hold the embeddings request back
    if len(times) < 2:
        return times, f"the stream ended after {len(times)} token(s)"
    return times, ""


def kv_blocks_held(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("candelabra_kv_cache_used_blocks"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError("candelabra_kv_cache_used_blocks is not in /metrics")


def measure(url: str, streams: int = 16, inputs: int = 2048, output_tokens: int = 64,
            text: str = DEFAULT_TEXT, encoding_format: str = "float") -> dict:
    """Both rounds, alone first; a dict of the two Runs and the blocks held after them."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    alone = asyncio.run(run_streams(url, model, streams, output_tokens, text))
    beside = asyncio.run(run_streams(url, model, streams, output_tokens, text, inputs, encoding_format))
    deadline = time.monotonic() + 5
    while (held := kv_blocks_held(url)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"alone": alone, "beside": beside, "kv_blocks_held_after": held, "streams": streams, "inputs": inputs}


def format_report(measured: dict) -> str:
    alone, beside = measured["alone"], measured["beside"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    rows = []
    for name, run in (("alone", alone), (f"beside {measured['inputs']} embedding inputs", beside)):
        rows.append([name, f"{run.finished}/{measured['streams']}", ms(run.gap(50)), ms(run.gap(99)),
                     ms(run.gap(100)), "-" if run.embeddings_seconds is None else f"{run.embeddings_seconds:.2f}",
                     run.tokens_while_embedding if run.embeddings_seconds is not None else "-"])
    table = format_table(["streams", "finished", "gap p50 ms", "gap p99 ms", "gap max ms", "embeddings s",
                          "tokens meanwhile"], rows)
    ratio = (beside.gap(100) / alone.gap(100)) if alone.gaps and beside.gaps else None
    lines = [table, f"largest gap beside the embeddings request: {'-' if ratio is None else f'{ratio:.1f}'}x "
                    f"the largest alone; KV blocks held afterwards: {measured['kv_blocks_held_after']:.0f}"]
    for run in (alone, beside):
        lines += [f"error: {error}" for error in run.errors]
    if beside.embeddings_status not in (None, 200):
        lines.append(f"error: the embeddings request answered HTTP {beside.embeddings_status}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:2000", help="a running candelabra serve")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--inputs", type=int, default=2048, help="inputs of the embeddings request")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens each stream generates")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="the prompts' and the embedding inputs' words")
    parser.add_argument("--encoding-format", choices=("float", "base64"), default="float",
                        help="of the embeddings' answer: float is a larger body to write than base64")
    parser.add_argument("--json", type=Path, help="write the measurements here too")
    args = parser.parse_args()
    measured = measure(args.url.rstrip("/"), args.streams, args.inputs, args.output_tokens, args.text,
                       args.encoding_format)
    print(format_report(measured))
    if args.json:
        args.json.write_text(json.dumps({k: asdict(v) if isinstance(v, Run) else v for k, v in measured.items()},
                                        indent=1))


if __name__ == "__main__":
    main()
