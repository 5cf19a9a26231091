"""Prometheus metrics of a server: requests, tokens, latencies, batch sizes, queue, and the expert scheduler.

One :class:`CollectorRegistry` per app (several apps in one process do not collide). The engine reports
through :class:`ServeMetrics` (an :class:`~moeflow.engine.continuous.EngineListener`); the expert counters
are read from ``model.stats`` when ``/metrics`` is scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moeflow.engine.continuous import EngineListener, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _StatsCollector:
    """Expert-scheduler counters from ``model.stats`` (both phases summed), read at scrape time."""

    def __init__(self, stats, cache) -> None:
        self.stats, self.cache = stats, cache

    def collect(self):
        s = self.stats
        total = {f: getattr(s.prefill, f) + getattr(s.decode, f) for f in ("hits", "misses", "bytes_h2d")}
        for name, value, doc in (("moeflow_expert_hits", total["hits"], "Needed experts found resident"),
                                 ("moeflow_expert_misses", total["misses"], "Needed experts loaded after the gate"),
                                 ("moeflow_expert_bytes_host_to_device", total["bytes_h2d"],
                                  "Expert bytes copied host to device")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("moeflow_expert_hit_rate", "Expert hit rate since start (0 when nothing ran)")
        g.add_metric([], s.hit_rate)
        yield g
        g = GaugeMetricFamily("moeflow_kv_cache_rows", "KV cache rows (sequences that can run at once)",
                              labels=["state"])
        g.add_metric(["free"], self.cache.free_rows)
        g.add_metric(["total"], self.cache.rows)
        yield g


class _GraphsCollector:
    """The engine's captured decode passes (its ``CudaGraphDecode``), read at scrape time."""

    def __init__(self, graphs) -> None:
        self.graphs = graphs

    def collect(self):
        g = self.graphs
        c = CounterMetricFamily("moeflow_decode_graph_captures", "Decode steps captured as CUDA graphs")
        c.add_metric([], g.captures if g is not None else 0)
        yield c
        state = "off" if g is None else "refused" if g.refused is not None else "on"
        s = GaugeMetricFamily("moeflow_decode_graphs", "Decode passes as CUDA graphs: 1 for the current state",
                              labels=["state"])
        for name in ("on", "off", "refused"):
            s.add_metric([name], float(name == state))
        yield s


class _PrefixCollector:
    """Whether the prefix cache is on, and the idle rows whose keys it keeps, read at scrape time."""

    def __init__(self, prefix) -> None:
        self.prefix = prefix

    def collect(self):
        g = GaugeMetricFamily("moeflow_prefix_cache_rows", "Free KV rows whose keys the prefix cache keeps")
        g.add_metric([], self.prefix.rows if self.prefix is not None else 0)
        yield g
        g = GaugeMetricFamily("moeflow_prefix_cache_enabled", "1 when the prefix cache is on (--prefix-cache)")
        g.add_metric([], float(self.prefix is not None))
        yield g


class ServeMetrics(EngineListener):
    def __init__(self, stats, cache) -> None:
        self.registry = CollectorRegistry()
        self._prefix_on = False
        r = self.registry
        self.requests = Counter("moeflow_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.finished = Counter("moeflow_sequences_finished", "Sequences that left the engine", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("moeflow_prompt_tokens", "Prompt tokens of the requests admitted", registry=r)
        self.prefill_tokens = Counter("moeflow_prefill_tokens", "Prompt tokens computed by prefill passes",
                                      registry=r)
        self.prefix_lookups = Counter("moeflow_prefix_cache_lookups", "Requests admitted with the prefix cache on",
                                      registry=r)
        self.prefix_hits = Counter("moeflow_prefix_cache_hits", "Requests that reused cached prompt tokens",
                                   registry=r)
        self.prefix_tokens = Counter("moeflow_prefix_cache_reused_tokens",
                                     "Prompt tokens taken from the prefix cache instead of prefilled", registry=r)
        self.generation_tokens = Counter("moeflow_generation_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("moeflow_prompt_lookup_draft_tokens",
                                    "Tokens drafted by prompt lookup (--prompt-lookup)", registry=r)
        self.accepted_tokens = Counter("moeflow_prompt_lookup_accepted_tokens",
                                       "Drafted tokens kept (each saved a decode pass)", registry=r)
        self.mtp_draft_tokens = Counter("moeflow_mtp_draft_tokens", "Tokens drafted by the model's MTP layers "
                                        "(--speculative mtp)", registry=r)
        self.mtp_accepted_tokens = Counter("moeflow_mtp_accepted_tokens",
                                           "MTP-drafted tokens kept (each saved a decode pass)", registry=r)
        self._drafts = (self.draft_tokens, self.accepted_tokens)  # where a sequence's drafts count
        self.ttft = Histogram("moeflow_time_to_first_token_seconds", "Submission to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("moeflow_time_per_output_token_seconds",
                              "Mean time between a request's tokens after the first", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("moeflow_request_seconds", "Submission to last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.batch = Histogram("moeflow_batch_size", "Sequences in one forward pass", ["phase"], registry=r,
                               buckets=BATCH_BUCKETS)
        self.pass_seconds = Histogram("moeflow_pass_seconds", "Duration of one forward pass", ["phase"],
                                      registry=r, buckets=LATENCY_BUCKETS)
        self.queue = Gauge("moeflow_queue_depth", "Requests waiting for a KV row", registry=r)
        self.running = Gauge("moeflow_running_sequences", "Sequences holding a KV row", registry=r)
        r.register(_StatsCollector(stats, cache))

    def watch_prefix(self, prefix) -> None:
        """Report the engine's prefix cache (``ContinuousEngine.prefix``: a PrefixCache, or None: off)."""
        self._prefix_on = prefix is not None
        self.registry.register(_PrefixCollector(prefix))

    def count_drafts_as(self, kind: str) -> None:
        """Count the sequences' drafted / kept tokens as ``kind``'s: "prompt_lookup" (the default) or "mtp"."""
        if kind not in ("prompt_lookup", "mtp"):
            raise ValueError(f"drafts are counted as 'prompt_lookup' or 'mtp', got {kind!r}")
        self._drafts = (self.mtp_draft_tokens, self.mtp_accepted_tokens) if kind == "mtp" else \
            (self.draft_tokens, self.accepted_tokens)

    def watch_graphs(self, graphs) -> None:
        """Report the engine's captured decode (``ContinuousEngine.graphs``: a CudaGraphDecode, or None: off)."""
        self.registry.register(_GraphsCollector(graphs))

    # EngineListener: called on the engine thread
    def on_pass(self, phase: str, batch: int, tokens: int, seconds: float) -> None:
        self.batch.labels(phase).observe(batch)
        self.pass_seconds.labels(phase).observe(seconds)
        if phase == "prefill":
            self.prefill_tokens.inc(tokens)

    def on_admit(self, seq: Sequence) -> None:
        self.prompt_tokens.inc(len(seq.prompt_ids))
        if self._prefix_on:
            self.prefix_lookups.inc()
        if seq.cached_tokens:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(seq.cached_tokens)

    def on_queue(self, waiting: int, running: int) -> None:
        self.queue.set(waiting)
        self.running.set(running)

    def on_finish(self, seq: Sequence) -> None:
        self.finished.labels(seq.finish_reason).inc()
        self.generation_tokens.inc(len(seq.generated))
        self._drafts[0].inc(seq.draft_tokens)
        self._drafts[1].inc(seq.accepted_tokens)
        if seq.t_first is not None:
            self.ttft.observe(seq.t_first - seq.t_submit)
            self.e2e.observe(seq.t_last - seq.t_submit)
            if len(seq.generated) > 1:
                self.tpot.observe((seq.t_last - seq.t_first) / (len(seq.generated) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
