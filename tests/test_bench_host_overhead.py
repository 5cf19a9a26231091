"""benchmarks/host/overhead.py times what it says (issue 14's CPU numbers come from it): every measurement
times real calls of the backend. Once, after the model's entry moved to ``forward_logits``, its ``real`` rows timed
nothing and printed 0 us."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.kernels.cpu.int4 import int4_cpu_available

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")


def test_every_measurement_times_calls_of_the_backend():
    from benchmarks.host import overhead as bench

    path = embedded_model_path()
    model = MoEOffloadedMixtral.from_pretrained(path, kernels="cpu-int4",
                                                offload=OffloadConfig(policy="lru", transport="sync"))
    try:
        ids = torch.tensor([model.tokenizer.encode(bench.PROMPT)])
        slots = model.experts.num_layers * model.experts.num_experts
        noop = bench.noop_us_per_layer(model, "lru", slots, steps=4, repeats=1)
        real = bench.real_us_per_layer(model, ids, "lru", slots, new_tokens=4, repeats=1)
    finally:
        model.close()
    resident = bench.resident_us_per_layer(path, ids, new_tokens=4, repeats=1)
    for r in (noop, real, resident):
        assert r["us"] > 0 and r["mean_us"] > 0
    assert real["hit_rate"] == 1.0  # every expert fits: the decode only hits


def test_an_empty_timing_is_an_error():
    from benchmarks.host import overhead as bench

    class Stats:
        phase = "decode"

    class Backend:
        stats = Stats()

        def forward(self, *a): ...
        def begin_step(self, step): ...
        def forward_logits(self, *a, **k): ...

    with pytest.raises(RuntimeError, match="no decode call"):
        bench._Timed(Backend()).us_per_layer()
