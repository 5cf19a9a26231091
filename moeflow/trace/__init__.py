"""Routing traces: their file format (:mod:`.format`) and recording them from a model (:mod:`.record`)."""

from moeflow.trace.format import DECODE, PREFILL, Trace, TraceError, split_sequence_ids

__all__ = ["Trace", "TraceError", "DECODE", "PREFILL", "split_sequence_ids"]
