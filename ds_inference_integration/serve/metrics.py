"""`GET /metrics`: Prometheus text (prometheus_client, its own registry): requests by route and status, prompt and
generated tokens, batch sizes (rows per admission), rows per decoding step, queue depth, rows held and slots free per
replica, latency and time to first token."""

from __future__ import annotations

import time

from ..extras import optional_import

prometheus = optional_import("prometheus_client", "ds-inference serve's /metrics")
prometheus.disable_created_metrics()  # no *_created series: one timestamp per label set that no dashboard reads

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        r = self.registry = prometheus.CollectorRegistry()
        p = "ds_inference_"
        self.requests = prometheus.Counter(p + "requests", "HTTP requests by route and status", ["route", "status"],
                                           registry=r)
        self.prompt_tokens = prometheus.Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = prometheus.Counter(p + "generation_tokens", "Tokens generated for finished requests",
                                                    registry=r)
        self.batch_size = prometheus.Histogram(p + "batch_size", "Rows per batch", registry=r,
                                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.batches = prometheus.Counter(p + "batches", "Batches run, by replica", ["replica"], registry=r)
        self.step_rows = prometheus.Histogram(p + "step_rows", "Rows given a token by one decoding step", registry=r,
                                              buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.queue = prometheus.Gauge(p + "queue_depth", "Requests waiting for a batch", registry=r)
        self.latency = prometheus.Histogram(p + "request_latency_seconds", "From arrival to the last row's end",
                                            registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = prometheus.Histogram(p + "time_to_first_token_seconds", "From arrival to the first new token",
                                         registry=r, buckets=LATENCY_BUCKETS)
        self.queue_full = prometheus.Counter(p + "queue_full", "Requests refused with 429", registry=r)
        # read from the front's record of each replica when /metrics is asked (vLLM's num_requests_running and its
        # cache's room): rows a replica holds (admitted and not yet answered: running, or starting at its next step)
        # and the rows it would take now (its slots free; the batch engine takes none while it runs a batch)
        self.rows_running = prometheus.Gauge(p + "rows_running", "Rows a replica holds (admitted, not yet answered)",
                                             ["replica"], registry=r)
        self.slots_free = prometheus.Gauge(p + "slots_free", "Rows a replica would take now", ["replica"], registry=r)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def rejected(self) -> None:
        self.queue_full.inc()

    def queue_depth(self, n: int) -> None:
        self.queue.set(n)

    def batch(self, rows: int, waiting: int, replica: int) -> None:
        self.batch_size.observe(rows)
        self.batches.labels(str(replica)).inc()
        self.queue.set(waiting)

    def finished(self, job) -> None:
        now = time.monotonic()
        self.latency.observe(now - job.arrived)
        if job.first_token_at is not None:
            self.ttft.observe(job.first_token_at - job.arrived)
        self.prompt_tokens.inc(sum(len(r.prompt_ids) for r in job.rows))
        self.generation_tokens.inc(sum(len(s) for r in job.rows for s in (r.sequences or [])))

    def held(self, replicas) -> None:
        """The gauges of rows held and slots free, from the front's `replicas.Replica` records."""
        for replica in replicas:
            self.rows_running.labels(str(replica.index)).set(len(replica.rows))
            self.slots_free.labels(str(replica.index)).set(replica.free())

    def text(self) -> bytes:
        return prometheus.generate_latest(self.registry)
