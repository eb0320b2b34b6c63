"""Prometheus metrics (prometheus_client), in the names and kinds vLLM / SGLang dashboards chart.

- `RequestMetrics` (one per EngineServer replica): per-request latency histograms observed where the
  engine's chunks arrive -- queue time (waiting for admission), time to first token, time per output
  token, end-to-end latency, and for block diffusion the tokens revealed per denoising step. Its families
  travel to the ingress as plain objects (`families()`), so one scrape of the ingress shows every replica.
- `IngressMetrics` (one per ingress replica): request counters by route and status, tokens, @serve.batch
  calls, admission control; `render(stats, families)` adds the engine replicas' gauges (running and
  waiting requests, KV usage, prefix-cache hits) and histograms, each with a `replica` label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from deployments.wire import ReplicaStats
from engine.answers import EngineSnapshot

# `_created` series double every counter and histogram; no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
TOKENS_PER_STEP_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)


class RequestTimer:
    """Times one request from its submission to the engine: feed it every chunk."""

    def __init__(self, metrics: RequestMetrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.tokens = 0
        self.last_step = 0

    def chunk(self, token_ids: list[int], step_map: list[int] | None, finished: bool,
              queue_time_s: float | None = None) -> None:
        """One chunk of the request; `queue_time_s` comes with its first (the engine's wait for admission)."""
        now = time.monotonic()
        if queue_time_s is not None:
            self.metrics.queue_time.observe(queue_time_s)
        if token_ids and self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.start)
        self.tokens += len(token_ids)
        if step_map:
            self.last_step = max(self.last_step, max(step_map))
        if not finished:
            return
        self.metrics.e2e.observe(now - self.start)
        if self.first_token is not None and self.tokens > 1:
            self.metrics.tpot.observe((now - self.first_token) / (self.tokens - 1))
        if self.last_step:
            self.metrics.tokens_per_step.observe(self.tokens / self.last_step)


class RequestMetrics:
    """Per-request histograms of one engine replica (its own registry; the ingress adds the `model`
    and `replica` labels when it shows them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram("blockserve_time_to_first_token_seconds",
                              "Time from the engine receiving a request to its first output token.", LATENCY_BUCKETS)
        self.tpot = histogram("blockserve_time_per_output_token_seconds",
                              "Per request: (finish - first token) / (output tokens - 1).", TOKEN_BUCKETS)
        self.e2e = histogram("blockserve_e2e_request_latency_seconds",
                             "Time from the engine receiving a request to its end.", LATENCY_BUCKETS)
        self.queue_time = histogram("blockserve_request_queue_time_seconds",
                                    "Time a request waited in the engine's queue before its first admission.",
                                    LATENCY_BUCKETS)
        self.tokens_per_step = histogram(
            "blockserve_request_tokens_per_step",
            "Block diffusion, per request: output tokens / denoising steps that revealed them.",
            TOKENS_PER_STEP_BUCKETS)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def families(self) -> list[Metric]:
        return list(self.registry.collect())


def _engine_gauges(model: str, stats: list[ReplicaStats]) -> Iterable[Metric]:
    """One series per engine replica for each value of its stats (`EngineServer.stats()`)."""

    def family(kind: type, name: str, doc: str, value: Callable[[EngineSnapshot], float]) -> Metric:
        fam = kind(name, doc, labels=["model", "replica"])
        for s in stats:
            fam.add_metric([model, s.replica], value(s.engine))
        return fam

    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield family(gauge, "blockserve_num_requests_running", "Requests being decoded.", lambda e: e.load.running)
    yield family(gauge, "blockserve_num_requests_waiting", "Requests queued for admission.", lambda e: e.load.waiting)
    yield family(gauge, "blockserve_kv_pages_total", "KV cache pages.", lambda e: e.load.kv_pages_total)
    yield family(gauge, "blockserve_kv_pages_free", "Free KV cache pages.", lambda e: e.load.kv_pages_free)
    yield family(gauge, "blockserve_kv_cache_usage_ratio", "Fraction of KV pages in use (0-1).",
                 lambda e: 1.0 - e.load.kv_pages_free / max(e.load.kv_pages_total, 1))
    yield family(counter, "blockserve_prefix_cache_queries",
                 "Tokens looked up in the prefix cache (a preempted request looks its tokens up again).",
                 lambda e: e.load.prefix_query_tokens)
    yield family(counter, "blockserve_prefix_cache_hits", "Tokens found in the prefix cache.",
                 lambda e: e.load.prefix_hit_tokens)
    yield family(gauge, "blockserve_prefix_cache_hit_rate", "Prefix-cache hits / queries since start (tokens).",
                 lambda e: e.load.prefix_hit_tokens / max(e.load.prefix_query_tokens, 1))
    yield family(counter, "blockserve_engine_steps", "Engine steps.", lambda e: e.steps)
    yield family(counter, "blockserve_engine_forwards", "Model forwards.", lambda e: e.forwards)
    yield family(counter, "blockserve_engine_prompt_tokens", "Prompt tokens admitted by the engine.",
                 lambda e: e.prompt_tokens)
    yield family(counter, "blockserve_engine_generated_tokens", "Tokens generated (unmasked) by the engine.",
                 lambda e: e.generated_tokens)
    yield family(counter, "blockserve_engine_step_seconds", "Time spent in engine steps.", lambda e: e.step_seconds)
    yield family(counter, "blockserve_engine_forward_seconds", "Time spent in model forwards.",
                 lambda e: e.forward_seconds)
    yield family(gauge, "blockserve_engine_tokens_per_step", "Generated tokens per engine step since start.",
                 lambda e: e.generated_tokens / max(e.steps, 1))
    yield family(counter, "blockserve_engine_preemptions", "Sequences preempted for KV space.",
                 lambda e: e.load.preemptions)


def _with_replica(model: str, families_by_replica: Mapping[str, list[Metric]]) -> Iterable[Metric]:
    """The replicas' families merged by name, every sample labelled with the model and its replica."""
    merged: dict[str, Metric] = {}
    for replica, families in families_by_replica.items():
        for fam in families:
            out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            out.samples += [s._replace(labels={"model": model, "replica": replica, **s.labels}) for s in fam.samples]
    return merged.values()


class _Snapshot:
    """A collector yielding what the last scrape fetched from the engine replicas."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return self.families


class IngressMetrics:
    """The ingress replica's own counters, plus the engine replicas' metrics at scrape time."""

    def __init__(self, model: str, in_flight: Callable[[], float]):
        self.model = model
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("blockserve_requests", "Requests received by the ingress, by route and HTTP "
                                "status (status 0: handle calls).", ["model", "route", "status"], registry=registry)
        self.prompt_tokens = Counter("blockserve_prompt_tokens", "Prompt tokens of finished requests (ingress).",
                                     ["model"], registry=registry).labels(model)
        self.generation_tokens = Counter("blockserve_generation_tokens", "Generated tokens of finished requests "
                                         "(ingress).", ["model"], registry=registry).labels(model)
        self.batches = Counter("blockserve_ingress_batches", "Engine calls made by @serve.batch for unary requests.",
                               ["model"], registry=registry).labels(model)
        self.batched = Counter("blockserve_ingress_batched_requests", "Unary requests sent in those batches.",
                               ["model"], registry=registry).labels(model)
        Gauge("blockserve_ingress_requests_in_flight", "Generation requests in flight in this ingress replica "
              "(admission control counts these).", ["model"], registry=registry).labels(model).set_function(in_flight)
        self.rejected = Counter("blockserve_ingress_rejected", "Requests refused with 429 (max_concurrent_requests).",
                                ["model"], registry=registry).labels(model)
        self._engines = _Snapshot()
        registry.register(self._engines)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(self.model, route, str(status)).inc()

    def render(self, stats: list[ReplicaStats], families: Mapping[str, list[Metric]]) -> bytes:
        """The text exposition, with the engine replicas' stats and histogram families (by replica)."""
        self._engines.families = [*_engine_gauges(self.model, stats), *_with_replica(self.model, families)]
        return generate_latest(self.registry)
