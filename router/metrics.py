"""The router's Prometheus metrics: requests, latencies, admission, pools, and every worker's.

Request latencies are measured where the client sees them (the router): TTFT from arrival to
the first token sent, TPOT as a request's mean gap after the first token, ITL each gap
between token batches, e2e from arrival to the last message. Worker series (worker.metrics)
are read from the pools' latest heartbeats at scrape time. Per-token series
(``pdserve_token_*``, router.admission) are labelled with the token's NAME from the tokens
file, never the token (``-`` with auth off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.cluster_view import ClusterView
from worker.metrics import serve_metrics, worker_families

log = logging.getLogger("pdserve.router")

# Seconds; fine at the low end for TPOT/ITL, wide for TTFT/e2e of long prompts.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)


class RouterMetrics:
    """Counters and histograms the router updates, plus a collector over snapshots of the
    cluster (``view``) and of the per-token stats (``token_stats``: ``Admission.stats``)."""

    def __init__(self, view: Callable[[], ClusterView], token_stats: Callable[[], dict]) -> None:
        self.view, self.token_stats = view, token_stats
        self.registry = reg = CollectorRegistry(auto_describe=False)
        self.requests = Counter("pdserve_requests", "Finished requests by outcome (stop, length, abort, "
                                "or the gRPC status of a failed one)", ["status"], registry=reg)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of admitted requests", registry=reg)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens streamed to clients", registry=reg)
        self.retries = Counter("pdserve_request_reruns", "Re-runs after a lost worker or failed transfer",
                               registry=reg)
        self.parked = Counter("pdserve_requests_parked", "Requests parked because their client stopped reading "
                              "their stream (front_door.park_unread_s): aborted on their workers until it reads",
                              registry=reg)
        self.prefix_hit_tokens = Counter("pdserve_router_prefix_hit_tokens", "Prompt tokens the worker chosen to "
                                         "prefill likely held in its prefix cache (the router's estimate, "
                                         "router.prefix_aware)", registry=reg)
        self.decode_prefix_tokens = Counter("pdserve_router_decode_prefix_tokens", "Prompt tokens whose KV the "
                                            "decode worker already held in its prefix cache, so the prefill "
                                            "worker did not send them (disaggregated mode)", registry=reg)
        self.prefill_placements = Counter("pdserve_router_prefill_placements", "Disaggregated requests by where "
                                          "their prompt was prefilled (pool, local: the decode worker) and why "
                                          "(router.placement.prefill_where)", ["where", "reason"], registry=reg)
        self.role_switches = Counter("pdserve_router_role_switches", "Adaptive workers switched to a role "
                                     "(router.roles), by the role they switched to", ["to"], registry=reg)
        self.swept_blocks = Counter("pdserve_router_swept_blocks", "KV blocks the periodic sweep freed: held by "
                                    "no live request (a path that should have freed them did not)", registry=reg)
        self.ttft = Histogram("pdserve_request_ttft_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=reg)
        self.tpot = Histogram("pdserve_request_tpot_seconds", "Mean time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("pdserve_request_inter_token_latency_seconds", "Gap between streamed token batches",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("pdserve_request_e2e_seconds", "Arrival to the last response",
                             buckets=LATENCY_BUCKETS, registry=reg)
        reg.register(self)
        self._server = None
        self.address: str | None = None

    def observe(self, job, outcome: str) -> None:
        """A request (router.jobs.Job) ended with ``outcome``: its counts and latencies, and its log line."""
        m = self
        m.requests.labels(outcome).inc()
        m.generation_tokens.inc(len(job.generated))
        m.e2e.observe(time.monotonic() - job.arrival)
        if job.ttft is not None:
            m.ttft.observe(job.ttft)
        if job.tpot is not None and not job.parks:  # (a parked one's pauses were its client's: router.parking)
            m.tpot.observe(job.tpot)
        for gap in () if job.parks else job.gaps:
            m.itl.observe(gap)
        log.info("rid=%s event=finished outcome=%s prompt_tokens=%d tokens=%d ttft_s=%s tpot_s=%s prefill=%s "
                 "decode=%s attempts=%d", job.request_id, outcome, len(job.prompt_ids), len(job.generated),
                 f"{job.ttft:.3f}" if job.ttft is not None else "-", f"{job.tpot:.4f}" if job.tpot else "-",
                 job.prefill_id or "-", job.decode_id or "-", job.attempt + 1)

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics``; returns ``host:port``."""
        self._server, bound = serve_metrics(self.registry, host, port)
        self.address = f"{host}:{bound}"
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()

    def collect(self):
        """Gauges read at scrape time (called by prometheus_client, from its HTTP thread)."""
        v = self.view()
        yield GaugeMetricFamily("pdserve_admission_queue_requests", "Requests waiting for a decode worker",
                                value=v.queued)
        yield GaugeMetricFamily("pdserve_router_active_requests", "Requests the router is streaming",
                                value=v.active)
        yield CounterMetricFamily("pdserve_router_bad_reports", "Messages on the report socket dropped: not a report, "
                                  "no valid MAC (not from this cluster's workers), or replayed",
                                  value=v.bad_reports)
        workers = v.workers
        pools = GaugeMetricFamily("pdserve_pool_workers", "Workers by role and state", labels=["role", "state"])
        counts: dict[tuple[str, str], int] = {}
        for w in workers:
            key = (str(w.role), str(w.state))  # (the enums' values: the labels as always)
            counts[key] = counts.get(key, 0) + 1
        for (role, state), n in sorted(counts.items()):
            pools.add_metric([role, state], n)
        yield pools
        yield from token_families(self.token_stats())
        yield from worker_families(({"worker": w.worker_id, "role": str(w.role)}, w.status, w.info) for w in workers)


def token_families(stats: dict) -> list:
    """Per-token families from ``Admission.stats()`` (name -> TokenStats), by token name."""
    admitted = CounterMetricFamily("pdserve_token_requests_admitted", "Requests admitted, by token name",
                                   labels=["token"])
    refused = CounterMetricFamily("pdserve_token_requests_refused", "Requests refused by the token's policy "
                                  "(429 / RESOURCE_EXHAUSTED), by token name and limit", labels=["token", "limit"])
    used = CounterMetricFamily("pdserve_token_tokens", "Prompt and generated tokens used, by token name "
                               "(what tokens_per_minute counts)", labels=["token"])
    in_flight = GaugeMetricFamily("pdserve_token_requests_in_flight", "Requests in progress, by token name",
                                  labels=["token"])
    waiting = GaugeMetricFamily("pdserve_token_requests_waiting", "Requests waiting for a placement (fair "
                                "order: router.admission), by token name", labels=["token"])
    preempted = CounterMetricFamily("pdserve_token_requests_preempted", "Running requests preempted (aborted "
                                    "on their workers and re-queued, to re-run from their prompt plus the "
                                    "tokens streamed) for a waiting request of a higher priority class "
                                    "(router.preempt), by token name", labels=["token"])
    for name, s in sorted(stats.items()):
        label = name or "-"
        admitted.add_metric([label], s.admitted)
        for limit, n in sorted(s.refused.items()):
            refused.add_metric([label, limit], n)
        used.add_metric([label], s.tokens)
        in_flight.add_metric([label], s.in_flight)
        waiting.add_metric([label], s.waiting)
        preempted.add_metric([label], s.preempted)
    return [admitted, refused, used, in_flight, waiting, preempted]
