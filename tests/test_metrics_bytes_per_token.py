"""/metrics' decode bytes per generated token (issue 40): the decode phase's expert bytes over the tokens of the
finished sequences, beside the decode bytes counter and the MTP draft counters. < 1 s."""

from __future__ import annotations

from types import SimpleNamespace

from serve_helpers import metric

from moeflow.offload.stats import Stats
from moeflow.serve.metrics import ServeMetrics


def finished(tokens: int, drafted: int, kept: int) -> SimpleNamespace:
    return SimpleNamespace(finish_reason="length", generated=list(range(tokens)), draft_tokens=drafted,
                           accepted_tokens=kept, t_first=None, t_last=None, t_submit=0.0)


def test_decode_bytes_per_generated_token():
    stats = Stats()
    metrics = ServeMetrics(stats, SimpleNamespace(free_rows=1, rows=2))
    metrics.count_drafts_as("mtp")
    text = metrics.render().decode()
    assert metric(text, "moeflow_expert_decode_bytes_per_generated_token") == 0.0
    stats.prefill.bytes_h2d, stats.decode.bytes_h2d = 7_000, 3_000
    metrics.on_finish(finished(10, 6, 5))
    metrics.on_finish(finished(5, 4, 1))
    text = metrics.render().decode()
    assert metric(text, "moeflow_expert_decode_bytes_host_to_device_total") == 3_000
    assert metric(text, "moeflow_expert_bytes_host_to_device_total") == 10_000
    assert metric(text, "moeflow_expert_decode_bytes_per_generated_token") == 3_000 / 15
    drafts = (metric(text, "moeflow_mtp_draft_tokens_total"), metric(text, "moeflow_mtp_accepted_tokens_total"))
    assert drafts == (10, 6)
