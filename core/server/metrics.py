"""Prometheus metrics of one server, in a registry of its own.

Gauges are read from the engine when scraped; counters and latency histograms are fed by each
request as its outputs arrive (`RequestTimer`), except the expert cache's of a model keeping experts in
host memory, which the model counts and a scrape reads.
"""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from candelabra.core.engine.async_engine import AsyncEngine
from candelabra.core.models.offloaded_experts import expert_cache_counts, offloaded_layers

disable_created_metrics()  # the *_created series only repeat the start-up time

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        blocks = engine.llm_engine.blocks
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, list(labels), registry=self.registry).labels(**labels).set_function(read)

        gauge("candelabra_requests_running", "Requests with sequences in the running batch.",
              lambda: engine.num_running)
        gauge("candelabra_requests_waiting", "Requests waiting to run, or swapped out.", lambda: engine.num_waiting)
        gauge("candelabra_kv_cache_usage_ratio", "Fraction of KV cache blocks held by sequences (0 to 1).",
              lambda: blocks.usage)
        gauge("candelabra_kv_cache_used_blocks", "KV cache blocks held by sequences.",
              lambda: blocks.num_blocks - blocks.num_free_blocks)
        gauge("candelabra_kv_cache_total_blocks", "KV cache blocks in all.", lambda: blocks.num_blocks)
        gauge("candelabra_pooled_tokens", "Tokens of embeddings inputs run so far.",
              lambda: engine.core.stats["pooled_tokens"])
        gauge("candelabra_kv_cache_prefix_cached_blocks", "Free blocks still holding a reusable prompt prefix.",
              lambda: blocks.num_cached_blocks)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS, registry=self.registry).labels(**labels)

        self._labels = labels
        self.prompt_tokens = counter("candelabra_prompt_tokens", "Prompt tokens admitted.").labels(**labels)
        self.generation_tokens = counter("candelabra_generation_tokens", "Tokens generated.").labels(**labels)
        self._finished = counter("candelabra_requests_finished", "Requests that ended, by how.", ("finish_reason",))
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.ttft = histogram("candelabra_time_to_first_token_seconds", "From arrival to the first generated token.")
        self.itl = histogram("candelabra_inter_token_latency_seconds", "Between successive outputs of a request.")
        self.e2e = histogram("candelabra_e2e_request_latency_seconds", "From arrival to the last output.")
        layers = getattr(engine.llm_engine.model, "layers", [])
        if offloaded_layers(layers):
            self.registry.register(_ExpertCacheCollector(layers, labels))

    def finished(self, reason: str) -> None:
        """Count a request that ended: stop, length, abort (client gone) or error."""
        self._finished.labels(**self._labels, finish_reason=reason).inc()
        self.finished_by_reason[reason] += 1

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ExpertCacheCollector:
    """The counts of a model whose experts are partly in host memory (this rank's, under tensor
    parallelism), read when scraped: the model counts them as it steps."""

    def __init__(self, layers: list, labels: dict[str, str]) -> None:
        self.layers, self.labels = layers, labels

    def collect(self):
        counts = expert_cache_counts(self.layers)
        for name, doc, value in (
            ("candelabra_expert_cache_hits", "Routed experts from host memory found in a device slot, per layer "
                                             "and step.", counts.hits),
            ("candelabra_expert_cache_misses", "Routed experts from host memory copied into a device slot, per "
                                               "layer and step.", counts.misses),
            ("candelabra_expert_bytes_copied", "Bytes of experts copied from host memory to the device.",
             counts.bytes_copied),
        ):
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family


class RequestTimer:
    """Feeds one request's latencies and token counts into the metrics."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self._last: float | None = None
        self._ended = False
        metrics.prompt_tokens.inc(prompt_tokens)

    def tokens(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self._last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self._last)
        self._last = now
        self.metrics.generation_tokens.inc(count)

    def end(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.finished(reason)
