"""Prometheus metrics, named like vLLM's (prefix `loramux:` instead of `vllm:`), so dashboards and
LoRA-aware routers (the Gateway API Inference Extension reads `*:lora_requests_info`) work unchanged.

Request metrics are observed in the HTTP process as outputs arrive; engine state (running/waiting,
adapter loads and evictions) is fetched from the engine at scrape time.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCounters:
    """Counters kept by the engine process, exposed as Prometheus counters."""

    def __init__(self):
        self.stats = None  # the engine's latest EngineStats

    def collect(self):
        for key, help_text in (("lora_loads", "Adapter reads from disk (first loads and reloads)"),
                               ("lora_host_evictions", "Adapters evicted from host memory"),
                               ("lora_slot_evictions", "Adapters evicted from device slots"),
                               ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (as vLLM's)"),
                               ("prefix_cache_hits", "Prompt tokens found in the prefix cache (as vLLM's)")):
            family = CounterMetricFamily(f"loramux:{key}", help_text)
            family.add_metric([], getattr(self.stats, key, 0))
            yield family
        finished = CounterMetricFamily("loramux:engine_finished_requests", "Requests the engine ended, by reason "
                                       "(abort: cancelled by a client, a stop string or an unload)", labels=["reason"])
        for reason, count in sorted(getattr(self.stats, "finished", {}).items()):
            finished.add_metric([reason], count)
        yield finished
        yield from _spec_decode(getattr(self.stats, "spec_decode", None))


def _spec_decode(spec):
    """Speculative decoding's counters, named as vLLM's (spec_decode_*), and per adapter (absent when off)."""
    if spec is None:
        return
    for key, help_text in (("num_drafts", "Proposals verified (one per request and step that speculated)"),
                           ("num_draft_tokens", "Proposed tokens verified"),
                           ("num_accepted_tokens", "Proposed tokens accepted")):
        family = CounterMetricFamily(f"loramux:spec_decode_{key}", help_text)
        family.add_metric([], getattr(spec, key))
        yield family
    per_pos = CounterMetricFamily("loramux:spec_decode_num_accepted_tokens_per_pos",
                                  "Proposed tokens accepted, by position in the proposal", labels=["position"])
    for position, count in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([str(position)], count)
    yield per_pos
    for key, index, help_text in (("draft_tokens", 0, "Proposed tokens verified, by adapter (\"\": the base model)"),
                                  ("accepted_tokens", 1, "Proposed tokens accepted, by adapter (\"\": the base model)")):
        family = CounterMetricFamily(f"loramux:spec_decode_adapter_{key}", help_text, labels=["adapter"])
        for name, counts in sorted(spec.by_adapter.items()):
            family.add_metric([name], counts[index])
        yield family


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loramux:request_success", "Finished requests", ["finished_reason", "model"], registry=r)
        self.prompt_tokens = Counter("loramux:prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("loramux:generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("loramux:time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("loramux:time_per_output_token_seconds", "Time per output token after the first",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("loramux:e2e_request_latency_seconds", "Request latency", ["model"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("loramux:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("loramux:num_requests_waiting", "Requests waiting to run", registry=r)
        self.adapters = Gauge("loramux:num_loaded_adapters", "Adapters loaded (any tier)", registry=r)
        self.pinned = Gauge("loramux:num_pinned_adapters", "Adapters pinned (never evicted until unpinned or "
                            "unloaded)", registry=r)
        self.kv_usage = Gauge("loramux:kv_cache_usage_perc", "Fraction of KV-cache blocks in use", registry=r)
        self.weight_bytes = Gauge("loramux:model_weight_bytes", "Bytes of the base model's weights (quantized ones "
                                  "as stored)", registry=r)
        self.slot_bytes = Gauge("loramux:lora_slot_bytes", "Bytes of the LoRA slot buffers (max_loras x "
                                "max_lora_rank, allocated at start)", registry=r)
        self.host_bytes = Gauge("loramux:lora_host_bytes", "Bytes of the adapters held in host memory (the tier "
                                "max_cpu_lora_bytes bounds)", registry=r)
        self.lora_info = Gauge("loramux:lora_requests_info", "Running stats on LoRA requests",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.load_seconds = Histogram("loramux:lora_load_seconds", "Time a successful adapter load took, from the "
                                      "request to the engine's answer (runtime: the admin route; resolver: a first "
                                      "request's load on demand, after the resolver found it; registered: an adapter "
                                      "given at start, or reloaded with a restarted engine, read in the engine)", ["source"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.resident = Gauge("loramux:lora_adapter_resident", "1 while the adapter is in that tier (host memory or "
                              "a device slot); a series goes when the adapter leaves it (for LoRA-aware routers)",
                              ["adapter", "tier", "pinned"], registry=r)
        self.tenant_requests = Counter("loramux:tenant_requests", "HTTP generation requests a tenant sent that were "
                                       "admitted", ["tenant"], registry=r)
        self.tenant_tokens = Counter("loramux:tenant_tokens", "Prompt + generated tokens of a tenant's finished "
                                     "requests (every choice; what tpm_limit counts)", ["tenant"], registry=r)
        self.tenant_rejected = Counter("loramux:tenant_rejected", "A tenant's requests refused with 429, by the limit "
                                       "they hit", ["tenant", "limit"], registry=r)
        self.alias_requests = Counter("loramux:lora_alias_requests", "HTTP requests for a weighted alias, by the "
                                      "target each was sent to", ["alias", "target"], registry=r)
        self.engine_restarts = Gauge("loramux:engine_restarts", "Times the engine process was restarted", registry=r)
        self.frontend_restarts = Gauge("loramux:frontend_restarts", "Times the HTTP front end process died and "
                                       "was replaced (with a new engine, and the adapters it had)", registry=r)
        self.engine_healthy = Gauge("loramux:engine_healthy", "1 when the engine answers its heartbeat", registry=r)
        self.pending_requests = Gauge("loramux:pending_requests", "Engine requests in flight (admission)", registry=r)
        self.pending_tokens = Gauge("loramux:pending_tokens", "Prompt + max_tokens in flight (admission)", registry=r)
        self._engine = _EngineCounters()
        r.register(self._engine)

    def tenant_counts(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The per-tenant counters' samples, {metric name: [(labels, value)]}: what a Ray replica reports for the
        ingress's /metrics."""
        out = {}
        for counter in (self.tenant_requests, self.tenant_tokens, self.tenant_rejected):
            for family in counter.collect():
                out[family.name] = [(dict(s.labels), s.value) for s in family.samples if s.name.endswith("_total")]
        return out

    def track(self, model: str) -> RequestTimer:
        return RequestTimer(self, model)

    def render(self, stats=None, admission=None) -> bytes:
        """The exposition text; `stats` is the engine's latest EngineStats (None when it is down)."""
        if admission is not None:
            self.pending_requests.set(admission.requests)
            self.pending_tokens.set(admission.tokens)
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.adapters.set(stats.num_adapters)
            self.pinned.set(len(stats.pinned))
            self.weight_bytes.set(stats.weight_bytes)
            self.slot_bytes.set(stats.lora_slot_bytes)
            self.host_bytes.set(stats.lora_host_bytes)
            self.kv_usage.set(1 - stats.kv_blocks_free / max(1, stats.kv_blocks_total))
            self.lora_info.clear()
            self.lora_info.labels(str(stats.max_loras), ",".join(stats.running_adapters),
                                  ",".join(stats.waiting_adapters)).set(time.time())
            self._set_resident(stats)
            self._engine.stats = stats
        return generate_latest(self.registry)

    def _set_resident(self, stats) -> None:
        """Only what is resident now has a series: cardinality stays at the tiers' sizes."""
        self.resident.clear()
        pinned = set(stats.pinned)
        for tier, names in stats.resident.items():
            for name in names:
                self.resident.labels(name, tier, str(name in pinned).lower()).set(1)


class RequestTimer:
    """Times one choice (one engine request) as its outputs arrive."""

    def __init__(self, metrics: Metrics, model: str):
        self.metrics, self.model = metrics, model
        self.start = time.monotonic()
        self.first: float | None = None

    def update(self, choice) -> None:
        """After a server.generation.Choice took an output."""
        now = time.monotonic()
        if self.first is None and choice.num_tokens:
            self.first = now
            self.metrics.ttft.labels(self.model).observe(now - self.start)
        if choice.finish_reason is None:
            return
        m, n = self.metrics, choice.num_tokens
        m.requests.labels(choice.finish_reason, self.model).inc()
        m.prompt_tokens.labels(self.model).inc(choice.prompt_tokens)
        m.generation_tokens.labels(self.model).inc(n)
        m.e2e.labels(self.model).observe(now - self.start)
        if self.first is not None and n > 1:
            m.tpot.labels(self.model).observe((now - self.first) / (n - 1))
