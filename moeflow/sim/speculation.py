"""Pricing speculative decoding with the model's own MTP layers on the simulator (issue 40).

A speculative run is a different sequence of forward passes than plain decoding: per round, MTP passes (only the
MTP layer's MoE layer, one token each after the first round) then one verify pass of the main model over 1 + k
tokens that yields 1 + (accepted drafts) tokens. :func:`record_passes` runs ``generate`` on a real model (any
policy: the routing is the same) and records every pass as the expert backend sees it: the engine's
:class:`StepInfo`, and for each MoE layer the pass ran, its routing and inputs. The passes become a
:class:`~moeflow.trace.Trace` over all MoE layers (the MTP layers last; a layer a pass did not run holds a
placeholder no pass reads) and :class:`~moeflow.sim.passes.Pass` objects that name their layers and yielded tokens,
which :func:`moeflow.sim.simulator.simulate` replays through the real scheduler on virtual time. So the simulator
prices speculation at the acceptance the model really has, and a plain run recorded the same way is its baseline:
``SimResult.bytes_per_generated_token`` / ``time_per_generated_token_s`` of the two, per policy, budget and profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from moeflow.moe.backend import StepInfo
from moeflow.sim.passes import Pass
from moeflow.sim.profile import HardwareProfile
from moeflow.trace import DECODE, PREFILL, Trace

if TYPE_CHECKING:
    from moeflow.api import MoEModel


@dataclass
class RecordedRun:
    """One ``generate`` per prompt, recorded pass by pass: ``trace`` (rows of every pass, in order), ``passes`` (per
    sequence), ``outputs`` (each prompt's generated ids [1, T + n]), the drafts proposed / accepted and ``gates``
    (the routers of every MoE layer, MTP layers last, for policies that apply them); ``main_layers``: the decoder's
    MoE layers (the trace's first)."""

    trace: Trace
    passes: list[list[Pass]]
    outputs: list[torch.Tensor]
    drafted: int
    accepted: int
    gates: list[nn.Module]
    main_layers: int

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class _PassRecorder:
    """Wraps the model's expert backend ``begin_step`` and ``prefetch`` and hooks every MoE block (the decoder's and
    the MTP layers'): one record per pass with its StepInfo (host copies), the prefetches asked for just before it
    and per layer (x, probs, topk)."""

    def __init__(self, model: MoEModel) -> None:
        self.model, self.backend = model, model.experts
        self.blocks = list(model.model.moe_blocks) + (list(model.mtp.moe_blocks) if model.mtp is not None else [])
        self.passes: list[dict] = []
        self._pending: int | None = None
        self._handles: list = []
        self._generated0 = 0
        self._prefetch: list[tuple[int, tuple[int, ...]]] = []

    def __enter__(self) -> _PassRecorder:
        original = self.backend.begin_step

        def begin_step(step: StepInfo) -> None:
            self._close_pass()
            cpu = (lambda t: None if t is None else t.detach().to("cpu"))  # noqa: E731
            info = replace(step, input_ids=cpu(step.input_ids), positions=cpu(step.positions),
                           token_mask=cpu(step.token_mask), rows=cpu(step.rows), embeds=cpu(step.embeds),
                           history_ids=cpu(step.history_ids), history_mask=cpu(step.history_mask),
                           path_scores=cpu(step.path_scores))
            self.passes.append({"info": info, "layers": {}, "yields": 0, "prefetch": tuple(self._prefetch)})
            self._prefetch.clear()
            self._generated0 = self.model.stats.generated_tokens
            original(step)

        self.backend.begin_step = begin_step
        prefetch = self.backend.prefetch

        def record_prefetch(target: int, experts: list[int], layer_now: int = 0) -> list[int]:
            self._prefetch.append((target, tuple(experts)))
            return prefetch(target, experts, layer_now)

        self.backend.prefetch = record_prefetch
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(block.layer_idx)))
            self._handles.append(block.gate.register_forward_hook(self._gate_hook(block.layer_idx, block.route)))
        return self

    def _close_pass(self) -> None:
        if self.passes:
            self.passes[-1]["yields"] = self.model.stats.generated_tokens - self._generated0

    def __exit__(self, *exc) -> None:
        self._close_pass()
        del self.backend.begin_step  # the class's methods again
        del self.backend.prefetch
        for h in self._handles:
            h.remove()

    def _pre_hook(self, idx: int):
        def hook(module, args) -> None:
            self._pending = idx
            x = args[0]
            self.passes[-1]["layers"][idx] = {"x": x.reshape(-1, x.shape[-1]).detach().to("cpu", torch.float16)}
        return hook

    def _gate_hook(self, idx: int, route):
        def hook(module, inputs, output) -> None:
            if self._pending != idx:  # a speculative call of this router (a policy's prefetch), not the routing
                return
            self._pending = None
            probs, ids, _ = route(output.detach())
            self.passes[-1]["layers"][idx].update(probs=probs.to("cpu", torch.float32), topk=ids.to("cpu", torch.int32))
        return hook


def record_passes(model: MoEModel, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                  num_speculative_tokens: int | None = None, mtp_prefetch: str | None = None) -> RecordedRun:
    """Greedy ``generate`` of each prompt (ids [T] or [1, T]) on ``model`` (a :class:`~moeflow.api.MoEModel`;
    with ``num_speculative_tokens``, loaded with ``mtp=True``), every forward pass recorded (see the module
    docstring). A plain pass yields one token; a speculative run's passes yield what ``stats.generated_tokens``
    counted after them (a verify pass: 1 + its accepted drafts; an MTP pass: 0). ``mtp_prefetch``: the draft-informed
    prefetch (``generate(mtp_prefetch=...)``), whose requests each verify pass records for the simulator to replay."""
    family = model.family
    n_main = len(family.moe_layers)
    n_mtp = len(model.mtp.moe_blocks) if model.mtp is not None else 0
    L, E, k = n_main + n_mtp, family.num_experts, family.router_spec().top_k
    H = model.config.hidden_size
    cols: dict[str, list] = {n: [] for n in ("topk", "probs", "hidden", "ids", "seq", "pos", "phase")}
    passes: list[list[Pass]] = []
    outputs, drafted, accepted, row = [], 0, 0, 0
    for seq, prompt in enumerate(prompts):
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1)
        model.stats.reset()
        with _PassRecorder(model) as rec:
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[],
                                 num_speculative_tokens=num_speculative_tokens, mtp_prefetch=mtp_prefetch)
        outputs.append(out)
        drafted += model.stats.draft_tokens
        accepted += model.stats.accepted_tokens
        steps = []
        for p in rec.passes:
            info: StepInfo = p["info"]
            t = info.input_ids.shape[1]
            topk = torch.arange(k, dtype=torch.int32).expand(t, L, k).clone()  # placeholders: layers not run
            probs = torch.zeros(t, L, E, dtype=torch.float16)
            hidden = torch.zeros(t, L, H, dtype=torch.float16)
            for layer, rec_l in p["layers"].items():
                topk[:, layer] = rec_l["topk"]
                probs[:, layer] = rec_l["probs"].to(torch.float16)
                hidden[:, layer] = rec_l["x"]
            phase = PREFILL if info.phase == "prefill" else DECODE
            yields = p["yields"] if num_speculative_tokens is not None else 1
            steps.append(Pass(seq, phase, slice(row, row + t), tuple(sorted(p["layers"])), info, yields,
                              p["prefetch"]))
            cols["topk"].append(topk)
            cols["probs"].append(probs)
            cols["hidden"].append(hidden)
            cols["ids"].append(info.input_ids[0].to(torch.int32))
            cols["seq"].append(torch.full((t,), seq, dtype=torch.int32))
            cols["pos"].append(info.positions[0].to(torch.int32))
            cols["phase"].append(torch.full((t,), phase, dtype=torch.int8))
            row += t
        passes.append(steps)
    trace = Trace(topk_ids=torch.cat(cols["topk"]), probs=torch.cat(cols["probs"]), token_ids=torch.cat(cols["ids"]),
                  seq_id=torch.cat(cols["seq"]), pos=torch.cat(cols["pos"]), phase=torch.cat(cols["phase"]),
                  hidden=torch.cat(cols["hidden"]), num_layers=L, num_experts=E, top_k=k, hidden_size=H,
                  model=str(getattr(model, "name_or_path", "")), source="recorded passes")
    blocks = list(model.model.moe_blocks) + (list(model.mtp.moe_blocks) if model.mtp is not None else [])
    return RecordedRun(trace, passes, outputs, drafted, accepted, [b.gate for b in blocks], n_main)


def any_shape(profile: HardwareProfile) -> HardwareProfile:
    """``profile``'s hardware costs (copy rate, expert size, compute times) for a model of any shape: a preset's
    layer / expert / top-k counts cleared, so a small model's routing is priced as if its experts were the preset's."""
    return replace(profile, num_layers=None, num_experts=None, top_k=None,
                   name=profile.name if profile.num_layers is None else f"{profile.name} (costs; any shape)")


def without_mtp_passes(run: RecordedRun) -> list[list[Pass]]:
    """``run``'s passes less those that ran only MTP layers (the drafts as if free: the MTP layers' experts never
    moved): the verify passes' share of the price, which a model with many more MoE layers than MTP layers (58 to 1
    in DeepSeek-V3) approaches."""
    mtp_layers = set(range(run.main_layers, run.trace.num_layers))
    return [[p for p in steps if not (p.layers and set(p.layers) <= mtp_layers)] for steps in run.passes]


def price(run: RecordedRun, policy: str, slots: int, profile: HardwareProfile, mtp_passes: bool = True,
          needs_gates: bool | None = None, **options) -> dict:
    """Simulate ``run`` under ``policy`` with ``slots`` expert slots on ``profile`` (shape checks lifted:
    :func:`any_shape`) -> bytes and time per generated token while decoding, hit rate, passes. ``mtp_passes``
    False: without the passes that ran only MTP layers (:func:`without_mtp_passes`). ``needs_gates``: give the
    policy the model's routers (None: for mixtral-offloading, which applies them; a variant of it registered under
    another name passes True)."""
    from moeflow.sim.simulator import simulate

    if needs_gates is None:  # the built-in policy that applies the routers (a variant registered under another
        needs_gates = policy == "mixtral-offloading"  # name says so itself)
    passes = run.passes if mtp_passes else without_mtp_passes(run)
    res = simulate(run.trace, policy, slots, any_shape(profile), passes=passes, timeline=False,
                   gates=run.gates if needs_gates else None, **options)
    return {"policy": res.policy, "slots": res.slots, "profile": profile.name,
            "decode_passes": res.decode_steps, "decode_tokens": res.decode_generated_tokens,
            "bytes_per_token": res.bytes_per_generated_token, "time_per_token_s": res.time_per_generated_token_s,
            "decode_hit_rate": res.decode_hit_rate}
