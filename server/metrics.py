"""Prometheus metrics of one server, in a registry of its own.

Two sources: the engine's latest `EngineStats` (KV blocks, prefix-cache tokens, queue
lengths), read at scrape time by a collector, and what the server measures itself (time to
first token, inter-token latency, token and request counters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixkv.ipc.protocol import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0,
)

# EngineStats field -> (metric name, help). Gauges are snapshots; counters are cumulative.
_GAUGES = {
    "num_running_requests": ("radixkv_num_requests_running", "Requests the scheduler is running"),
    "num_waiting_requests": ("radixkv_num_requests_waiting", "Requests waiting for admission"),
    "num_blocks": ("radixkv_kv_blocks", "KV blocks in the pool"),
    "num_free_blocks": ("radixkv_kv_blocks_free", "KV blocks on the free list"),
    "num_cached_blocks": ("radixkv_kv_blocks_cached", "KV blocks held by the radix tree"),
    "num_referenced_blocks": (
        "radixkv_kv_blocks_referenced", "KV blocks referenced by running sequences",
    ),
    "kv_waste_tokens": (
        "radixkv_kv_waste_tokens", "Allocated KV token slots holding no token (block tails)",
    ),
    "allocated_slots": ("radixkv_kv_allocated_slots", "KV token slots in allocated blocks"),
}
_COUNTERS = {
    "prefix_queried_tokens": (
        "radixkv_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_hit_tokens": (
        "radixkv_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
    ),
    "num_preemptions": ("radixkv_preemptions", "Sequences preempted for lack of KV blocks"),
    "evicted_blocks": ("radixkv_kv_evicted_blocks", "Cached KV blocks evicted from the tree"),
}


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], serving: Callable[[], bool]):
        self._stats = stats
        self._serving = serving

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "radixkv_engine_serving", "1 while the engine serves requests, else 0",
            value=1.0 if self._serving() else 0.0,
        )
        stats = self._stats()
        if stats is None:
            return
        for field, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(getattr(stats, field)))
        for field, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(getattr(stats, field)))


class ServerMetrics:
    """Counters and histograms the request handlers update, plus the engine's own stats."""

    def __init__(self, stats: Callable[[], EngineStats | None], serving: Callable[[], bool]):
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "radixkv_prompt_tokens", "Prompt tokens of submitted requests",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "radixkv_generation_tokens", "Tokens generated and returned to clients",
            registry=self.registry,
        )
        self.requests = Counter(
            "radixkv_requests",
            "Engine requests by outcome: finished, aborted (client gone), failed",
            ["outcome"], registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "radixkv_time_to_first_token_seconds",
            "From the HTTP request's arrival to its first generated token",
            buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "radixkv_inter_token_latency_seconds",
            "Time between successive outputs of one request",
            buckets=_ITL_BUCKETS, registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(stats, serving))

    def render(self) -> bytes:
        return generate_latest(self.registry)
