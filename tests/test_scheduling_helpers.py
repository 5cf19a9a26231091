"""Synthetic expert formats, weights and routings for the scheduling tests (no model needed)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moeflow.config import OffloadConfig
from moeflow.kernels.formats import ExpertFormat, expert_format
from moeflow.moe import ResidentExperts, route
from moeflow.moe.resident import CpuInt4Experts
from moeflow.offload import POLICY_TABLE, REAL, Stats, create_expert_backend
from moeflow.offload.cpu_slots import CpuInt4Format

DENSE = expert_format(hidden_size=32, intermediate_size=48, kind="dense", dtype=torch.float32)
AWQ = expert_format(hidden_size=64, intermediate_size=64, kind="awq", dtype=torch.float16, group_size=32)


def random_expert(fmt: ExpertFormat, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in fmt.loader_shapes().items():
        if name.endswith(("qweight", "qzeros")):
            out[name] = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)
        else:
            scale = 0.01 if "scales" in name else 0.2
            out[name] = (torch.randn(shape, generator=gen) * scale).to(fmt.dtype)
    return out


class Synthetic:
    """L layers of E random experts, random routers, and a fixed sequence of layer calls."""

    def __init__(self, fmt: ExpertFormat = DENSE, layers: int = 3, experts: int = 6, top_k: int = 2, seed: int = 0,
                 steps: int = 8, prefill_tokens: int = 7, kernels: str = "torch"):
        """kernels: "torch" (the reference on the slot pool) or "cpu-int4" (AWQ ``fmt``: the slots and the host
        store in torch's int4 form, :mod:`moeflow.offload.cpu_slots`; resident: ``CpuInt4Experts``)."""
        self.fmt, self.L, self.E, self.k, self.kernels = fmt, layers, experts, top_k, kernels
        gen = torch.Generator().manual_seed(seed)
        self.weights = {(l, e): random_expert(fmt, gen) for l in range(layers) for e in range(experts)}
        torch.manual_seed(seed)
        self.gates = [nn.Linear(fmt.hidden_size, experts, bias=False) for _ in range(layers)]
        self.xdtype = torch.float32
        self.steps = []  # (phase, [x of each layer])
        for step in range(steps):
            t = prefill_tokens if step == 0 else 1
            xs = [torch.randn(t, fmt.hidden_size, generator=gen) for _ in range(layers)]
            self.steps.append(("prefill" if step == 0 else "decode", xs))

    def calls(self):
        """(phase, layer, x, probs, ids, weights) in model order."""
        for phase, xs in self.steps:
            for layer, x in enumerate(xs):
                with torch.no_grad():
                    probs, ids, w = route(self.gates[layer](x), self.k)
                yield phase, layer, x, probs, ids, w

    def resident(self) -> ResidentExperts:
        if self.kernels == "cpu-int4":
            backend = CpuInt4Experts(self.fmt, self.L, self.E)
        else:
            backend = ResidentExperts(self.fmt, self.L, self.E, "cpu")
        for (l, e), t in self.weights.items():
            backend.load_expert(l, e, t)
        return backend

    def offloaded(self, stats: Stats | None = None, *, transport_object=None, copy_engine=None,
                  spec_changes: dict | None = None, **config):
        """A backend filled with the experts. ``transport_object`` replaces ``config.transport`` (test transports),
        ``copy_engine`` the copy-engine class (through the Platform seam); ``spec_changes`` edits the policy's
        PolicySpec (e.g. ``{"prefill_ring": True}``) in a table of this call's own."""
        stats = stats if stats is not None else Stats()
        platform = REAL
        if transport_object is not None:
            platform = dataclasses.replace(platform, transport=lambda _config, _device: transport_object)
        if copy_engine is not None:
            platform = dataclasses.replace(platform, copy_engine=copy_engine)
        cfg = OffloadConfig(**config)
        policies = None
        if spec_changes:
            policies = {**POLICY_TABLE, cfg.policy: dataclasses.replace(POLICY_TABLE[cfg.policy], **spec_changes)}
        backend = create_expert_backend(
            cfg, fmt=CpuInt4Format.of(self.fmt) if self.kernels == "cpu-int4" else self.fmt, num_layers=self.L,
            num_experts=self.E, top_k=self.k, device=torch.device("cpu"), kernels_backend=self.kernels,
            gates=self.gates, reserved_bytes=0, stats=stats,
            platform=platform, policies=policies,
        )
        for (l, e), t in self.weights.items():
            backend.load_expert(l, e, t)
        if hasattr(backend, "finish_loading"):
            backend.finish_loading()
        return backend, stats

    def run(self, backend, stats: Stats | None = None) -> list[torch.Tensor]:
        outs = []
        for phase, layer, x, probs, ids, w in self.calls():
            if stats is not None:
                stats.set_phase(phase)
            with torch.no_grad():
                outs.append(backend.forward(layer, x, probs, ids, w))
            if hasattr(backend, "cache"):
                backend.cache.check()
                assert not any(s.in_use for s in backend.cache.slots), "slot left in use after its layer"
        return outs

    def needed_per_call(self) -> list[int]:
        return [len(torch.unique(ids)) for *_, ids, _ in self.calls()]
