"""Per-replica series for /metrics, labelled `replica="i"`, in the server's own registry.

The server's vLLM-named series (`vllm:*`) hold the aggregate over replicas (ReplicaSetEngine
feeds them the summed statistics); these add what a sum hides: which replica is up, how
loaded each is, and how the router decided.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedserve.engine.llm_engine import EngineStats


class ReplicaMetrics:
    """Replica-labelled gauges and counters; a private registry when the server has none."""

    def __init__(self, num_replicas: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        label = ["replica"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=self.registry)

        self.up = gauge("pagedserve:replica_up", "1 while the replica answers, 0 while dead or restarting.")
        self.in_flight = gauge("pagedserve:replica_in_flight", "Engine requests the router has on the replica.")
        self.running = gauge("pagedserve:replica_num_requests_running", "Requests in the replica's batch.")
        self.waiting = gauge("pagedserve:replica_num_requests_waiting", "Requests waiting on the replica.")
        self.kv_usage = gauge("pagedserve:replica_kv_cache_usage_perc", "The replica's KV cache usage (1 = 100%).")
        self.prefix_hits = gauge("pagedserve:replica_prefix_cache_hits",
                                 "Prompt tokens found in the replica's prefix cache since it started.")
        self.prefix_queries = gauge("pagedserve:replica_prefix_cache_queries",
                                    "Prompt tokens looked up in the replica's prefix cache since it started.")
        self.routed = Counter("pagedserve:replica_routed_requests", "Groups routed to the replica, by reason "
                              "(prefix, adapter: affinity; balance: least loaded of two).",
                              ["replica", "reason"], registry=self.registry)
        self.failures = Counter("pagedserve:replica_failures", "Times the replica was found dead.",
                                label, registry=self.registry)
        self.retries = Counter("pagedserve:replica_retried_requests", "Groups re-sent elsewhere because "
                               "the replica failed before any output reached the client.",
                               label, registry=self.registry)
        for i in range(num_replicas):
            self.failures.labels(replica=str(i))
            self.retries.labels(replica=str(i))
            self.up.labels(replica=str(i)).set(1)

    def routed_to(self, replica: int, reason: str) -> None:
        self.routed.labels(replica=str(replica), reason=reason).inc()

    def retried(self, replica: int) -> None:
        """A group left `replica` (it failed) for another one."""
        self.retries.labels(replica=str(replica)).inc()

    def failed(self, replica: int) -> None:
        self.failures.labels(replica=str(replica)).inc()
        self.up.labels(replica=str(replica)).set(0)

    def update(self, stats: list[EngineStats | None], up: list[bool], in_flight: list[int]) -> None:
        for i, (s, is_up, load) in enumerate(zip(stats, up, in_flight, strict=True)):
            replica = str(i)
            self.up.labels(replica=replica).set(1 if is_up else 0)
            self.in_flight.labels(replica=replica).set(load)
            if s is None:
                continue
            sched = s.scheduler
            self.running.labels(replica=replica).set(sched.num_running)
            self.waiting.labels(replica=replica).set(sched.num_waiting)
            self.kv_usage.labels(replica=replica).set(sched.kv_usage)
            self.prefix_hits.labels(replica=replica).set(sched.prefix_cache_hits)
            self.prefix_queries.labels(replica=replica).set(sched.prefix_cache_queries)
