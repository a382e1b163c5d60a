"""Prometheus metrics under vLLM's names, in a registry of their own (not the global one).

Counters and histograms are fed from the engine thread through the EngineObserver hooks;
gauges are set from the statistics snapshot taken after every step. prometheus_client's
metrics are thread-safe, so /metrics renders on the event loop without locking.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedserve.engine.async_engine import EngineObserver
from pagedserve.engine.llm_engine import EngineStats
from pagedserve.outputs import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for vLLM read the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics(EngineObserver):
    """The server's metrics; `render()` gives the Prometheus text format."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage by requests (1 = 100%); adapter pages "
                                                          "are pagedserve:lora_kv_blocks_used.")
        self.blocks_used = gauge("pagedserve:kv_blocks_used", "KV cache blocks requests hold.")
        self.lora_blocks = gauge("pagedserve:lora_kv_blocks_used", "KV cache blocks holding resident LoRA adapters.")
        self.blocks_total = gauge("pagedserve:kv_blocks_total", "KV cache blocks in the pool.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative runs verified (one per request and step).")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.request_success = counter(
            "vllm:request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E_BUCKETS)
        # vLLM's request phases: waiting for the first schedule, from then to the first token, and
        # from the first token to the last.
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    _E2E_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Time from first scheduled to first token.", _E2E_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Time from first token to last token.",
                                     _E2E_BUCKETS)
        self._label = {"model_name": model_name}
        for metric in (self.preemptions, self.prompt_tokens, self.generation_tokens,
                       self.prefix_queries, self.prefix_hits, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted_tokens, self.ttft, self.itl, self.e2e,
                       self.queue_time, self.prefill_time, self.decode_time):
            metric.labels(**self._label)  # expose zero-valued series from the start
        self._preemptions_seen = 0
        self._queries_seen = 0
        self._hits_seen = 0
        self._spec_drafts_seen = 0
        self._spec_draft_tokens_seen = 0
        self._spec_accepted_seen = 0

    # ---- EngineObserver (engine thread) ----------------------------------------------------

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.labels(**self._label).observe(ttft_s)
        self.prompt_tokens.labels(**self._label).inc(num_prompt_tokens)

    def on_tokens(self, itl_s: float | None, num_tokens: int) -> None:
        if num_tokens:
            self.generation_tokens.labels(**self._label).inc(num_tokens)
        if itl_s is not None:
            self.itl.labels(**self._label).observe(itl_s)

    def on_finished(self, e2e_s: float, finish_reason: str) -> None:
        self.request_success.labels(finished_reason=finish_reason, **self._label).inc()
        if finish_reason != "abort":
            self.e2e.labels(**self._label).observe(e2e_s)

    def on_request_metrics(self, metrics: RequestMetrics) -> None:
        if metrics.first_scheduled_time is None or metrics.first_token_time is None:
            return
        self.queue_time.labels(**self._label).observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
        self.prefill_time.labels(**self._label).observe(max(0.0, metrics.first_token_time - metrics.first_scheduled_time))
        last = metrics.last_token_time or metrics.first_token_time
        self.decode_time.labels(**self._label).observe(max(0.0, last - metrics.first_token_time))

    def on_stats(self, stats: EngineStats) -> None:
        sched = stats.scheduler
        # The scheduler keeps a running total; a Counter can only be incremented.
        new = sched.num_preemptions_total - self._preemptions_seen
        if new > 0:
            self.preemptions.labels(**self._label).inc(new)
            self._preemptions_seen = sched.num_preemptions_total
        for counter, total, attr in (
            (self.prefix_queries, sched.prefix_cache_queries, "_queries_seen"),
            (self.prefix_hits, sched.prefix_cache_hits, "_hits_seen"),
            (self.spec_drafts, sched.spec_num_drafts, "_spec_drafts_seen"),
            (self.spec_draft_tokens, sched.spec_num_draft_tokens, "_spec_draft_tokens_seen"),
            (self.spec_accepted_tokens, sched.spec_num_accepted_tokens, "_spec_accepted_seen"),
        ):
            if total > getattr(self, attr):
                counter.labels(**self._label).inc(total - getattr(self, attr))
                setattr(self, attr, total)

    # ---- event loop ------------------------------------------------------------------------

    def render(self, stats: EngineStats, num_waiting: int) -> bytes:
        """The Prometheus text format, with gauges taken from the latest stats snapshot."""
        sched = stats.scheduler
        self.running.labels(**self._label).set(sched.num_running)
        self.waiting.labels(**self._label).set(num_waiting)
        self.kv_usage.labels(**self._label).set(sched.kv_usage)
        self.blocks_used.labels(**self._label).set(sched.kv_blocks_used)
        self.lora_blocks.labels(**self._label).set(sched.lora_blocks_used)
        self.blocks_total.labels(**self._label).set(sched.kv_blocks_total)
        return generate_latest(self.registry)
