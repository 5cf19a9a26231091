"""Host microseconds per MoE layer per decode step (issue 14), on the embedded tiny Mixtral, CPU.

Three measurements, each the median of ``--repeats`` runs in one process:

* ``noop``: every policy's ``OffloadedExperts.forward`` (+ its ``begin_step``, amortised over the layers) with
  the expert kernels replaced by a no-op through the Platform seam (``Platform(compute=...)``), driven by a
  seeded random routing (one token per step, top-k of E uniformly) so half the slots give ~50 % hits; at
  all-hit (every expert fits in the slots) and at half the slots, under ``torch.inference_mode`` as
  ``generate`` runs: the scheduler's own cost, what the host must do per layer whatever the GPU. Per-call
  times are kept by layer (a predictor's work differs by layer: the last layers propose nothing), so the
  statistics are per layer position, averaged over the layers; ``step_p10_us`` is ``begin_step`` alone;
* ``real``: the same policies inside the embedded model's greedy decode with the real kernels (the torch
  reference on the CPU), host time of the backend's calls per layer;
* ``tok/s``: whole greedy decode, policy "lru" with every expert fitting and with half the slots, against the
  all-resident CPU int4 path (``kernels="cpu-int4"``) measured in the same run; ratio lru / resident. "lru" with
  ``kernels="cpu-int4"`` computes the slots with the int4 kernels; ``*-torch-ref`` rows use ``kernels="auto"``,
  which kept the torch reference on the slot pool until the slots learnt to hold torch's int4 form
  (moeflow/offload/cpu_slots.py): since then they run the same path as ``lru-all`` / ``lru-half``.

    PYTHONPATH=$PWD python -m benchmarks.host.overhead --out benchmarks/results/host_overhead/after.json

The machine is shared: the load average is recorded with the numbers. Every decode call is timed on its own
(``time.perf_counter``); ``us`` is the median call (forward + begin_step / layers): what the host loop costs,
robust to the preemptions of a loaded machine (on a VM even the thread's CPU time counts the hypervisor's
steal); ``mean_us`` the mean, preemptions included. Both are medians over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.moe.backend import StepInfo
from moeflow.offload import create_expert_backend
from moeflow.offload.platform import Platform

POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading", "duoserve", "promoe", "finemoe", "expertflow")
PROMPT = "The \"with\" statement is used to wrap the execution of a block"


def _noop_compute(layer: int, topk_ids: torch.Tensor, experts: list[int]) -> None:
    """The Platform's compute executor: the expert kernels replaced by nothing."""


class _Timed:
    """Wraps a backend's ``forward`` and ``begin_step``: the wall time of every decode call, one by one, the
    forwards kept by MoE layer (a predictor's work differs by layer: layers near the end propose nothing). The
    model enters through ``forward_logits`` (routing included, as the resident backend's), which reaches the
    backend's ``_forward`` without its ``forward`` wrapper: both entries are timed."""

    def __init__(self, backend, stats=None) -> None:
        self.stats, self.step_s = stats if stats is not None else backend.stats, []
        self.forward_s: dict[int, list[float]] = {}
        self._forward, self._begin, self._logits = backend.forward, backend.begin_step, backend.forward_logits
        backend.forward, backend.begin_step = self.forward, self.begin_step
        backend.forward_logits = self.forward_logits

    def _timed(self, into: list[float], fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.stats.phase == "decode":
            into.append(time.perf_counter() - t0)
        return out

    def forward(self, layer, *args):
        return self._timed(self.forward_s.setdefault(layer, []), self._forward, layer, *args)

    def forward_logits(self, layer, *args, **kwargs):
        return self._timed(self.forward_s.setdefault(layer, []), self._logits, layer, *args, **kwargs)

    def begin_step(self, step):
        return self._timed(self.step_s, self._begin, step)

    def _per_layer(self, stat) -> float:
        """stat over each layer's forwards, averaged over the layers, + stat(begin_step) / layers, in us."""
        layers = [xs for xs in self.forward_s.values() if xs]
        if not layers:  # a timing of nothing is a broken harness, not a fast backend
            raise RuntimeError("no decode call of the backend was timed (did the model's entry point change?)")
        step = stat(self.step_s) if self.step_s else 0.0
        return (statistics.fmean(stat(xs) for xs in layers) + step / len(layers)) * 1e6

    def p10_per_layer(self) -> float:
        """10th-percentile call per layer (the intrinsic cost when the cores are oversubscribed), averaged over
        the layers, + the 10th-percentile begin_step / layers, in us."""
        return self._per_layer(lambda xs: sorted(xs)[len(xs) // 10])

    def us_per_layer(self) -> tuple[float, float]:
        """(median call per layer averaged over the layers + median begin_step / layers, the same with means) in
        us: the median call is what the host loop costs, the mean adds the preemptions of a loaded machine."""
        return self._per_layer(statistics.median), self._per_layer(statistics.fmean)


def _backend(model, policy: str, slots: int, noop: bool):
    """A fresh backend of ``policy`` sharing ``model``'s filled host store (kernels: no-op or the model's)."""
    old = model.experts
    cfg = model.config
    config = OffloadConfig(policy=policy, gpu_expert_slots=slots)
    gates = [blk.gate for blk in model.model.moe_blocks]
    backend = create_expert_backend(
        config, fmt=old.fmt, num_layers=old.num_layers, num_experts=old.num_experts, top_k=cfg.num_experts_per_tok,
        device=model.device, kernels_backend=old.kernels_backend, gates=gates, reserved_bytes=0,
        stats=model.stats, checkpoint_dir=embedded_model_path(), host_store=old.host,
        platform=Platform(compute=_noop_compute) if noop else Platform(),
    )
    backend.finish_loading()
    return backend


def _summary(med: list[float], mean: list[float], hits: list[float], p10: list[float] | None = None,
             step: list[float] | None = None) -> dict:
    out = {"us": statistics.median(med), "mean_us": statistics.median(mean), "runs_us": med,
           "hit_rate": statistics.median(hits)}
    if p10:
        out["p10_us"] = statistics.median(p10)
    if step:  # begin_step alone, per step (the predictors' per-pass work, amortised over the layers above)
        out["step_p10_us"] = statistics.median(step)
    return out


def noop_steps(model, steps: int, seed: int):
    """The no-op driver's inputs: per decode step (one token) its StepInfo and, per MoE layer, (x [1, H], probs
    [1, E], topk_ids int32 [1, k], topk_weights [1, k]) with seeded uniform routing; real token ids (the path
    predictor's vocabulary)."""
    E, L = model.experts.num_experts, model.experts.num_layers
    k, H = model.config.num_experts_per_tok, model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    text = model.tokenizer.encode(PROMPT * (1 + steps // 8))
    history = torch.tensor([text[: 8 + steps]])
    for step in range(steps):
        ids = history[:, 8 + step : 9 + step]
        embeds = torch.randn(1, 1, H, generator=gen)
        info = StepInfo(ids, torch.tensor([[8 + step]]), torch.ones_like(ids, dtype=torch.bool), "decode", None,
                        embeds, history[:, : 9 + step], torch.ones(1, 9 + step, dtype=torch.bool))
        layers = []
        for _ in range(L):
            x = torch.randn(1, H, generator=gen)
            probs = torch.softmax(torch.randn(1, E, generator=gen), -1)
            top = torch.randperm(E, generator=gen)[:k].view(1, k).to(torch.int32)
            w = probs.gather(1, top.long())
            layers.append((x, probs, top, w / w.sum(-1, keepdim=True)))
        yield info, layers


@torch.inference_mode()  # as the model's generate() runs its decode
def noop_us_per_layer(model, policy: str, slots: int, steps: int, repeats: int) -> dict:
    """Drive a no-op-kernel backend directly: one decode token per step, seeded uniform routing."""
    med, mean, hits, p10, step_p10 = [], [], [], [], []
    for r in range(repeats):
        backend = _backend(model, policy, slots, noop=True)
        timed = _Timed(backend)
        model.stats.reset()
        model.stats.set_phase("decode")
        for info, layers in noop_steps(model, steps, r):
            timed.begin_step(info)
            for layer, args in enumerate(layers):
                timed.forward(layer, *args)
        backend.close()
        a, b = timed.us_per_layer()
        med.append(a)
        mean.append(b)
        p10.append(timed.p10_per_layer())
        step_p10.append(sorted(timed.step_s)[len(timed.step_s) // 10] * 1e6)
        d = model.stats.decode
        hits.append(d.hits / max(d.hits + d.misses, 1))
    return _summary(med, mean, hits, p10, step_p10)


def real_us_per_layer(model, ids: torch.Tensor, policy: str, slots: int, new_tokens: int, repeats: int) -> dict:
    """The backend's host time per MoE layer inside the embedded model's greedy decode, real kernels."""
    med, mean, hits = [], [], []
    base = model.experts
    for _ in range(repeats):
        backend = _backend(model, policy, slots, noop=False)
        timed = _Timed(backend)
        model.use_backend(backend)
        model.stats.reset()
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        model.use_backend(base)
        backend.close()
        a, b = timed.us_per_layer()
        med.append(a)
        mean.append(b)
        d = model.stats.decode
        hits.append(d.hits / max(d.hits + d.misses, 1))
    return _summary(med, mean, hits)


def resident_us_per_layer(path: Path, ids: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """The all-resident CPU int4 backend's time per MoE layer in the same greedy decode: what ``real`` is
    compared with (routing and expert kernels, no scheduler)."""
    model = MoEOffloadedMixtral.from_pretrained(path, kernels="cpu-int4", attention_bits=None)
    med, mean = [], []
    for _ in range(repeats):
        timed = _Timed(model.experts, model.stats)
        model.stats.reset()
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        a, b = timed.us_per_layer()
        med.append(a)
        mean.append(b)
        for name in ("forward", "begin_step", "forward_logits"):  # unwrap: the next repeat wraps afresh
            delattr(model.experts, name)
    model.close()
    return _summary(med, mean, [1.0])


def decode_tok_s(models: dict, ids: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, float]:
    """Decode tokens/s of each model: (generate n+1 tokens) - (generate 1 token), medians over repeats. The
    models take turns within every repeat, so a slow spell of this shared machine lands on all of them alike."""
    def run(model, n: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0
    long: dict[str, list[float]] = {label: [] for label in models}
    short: dict[str, list[float]] = {label: [] for label in models}
    for model in models.values():
        run(model, 2)
    for _ in range(repeats):
        for label, model in models.items():
            long[label].append(run(model, new_tokens + 1))
            short[label].append(run(model, 1))
    return {label: new_tokens / max(statistics.median(long[label]) - statistics.median(short[label]), 1e-9)
            for label in models}


def _slot_int4_supported() -> bool:
    """Whether this moeflow computes offloaded slots with the int4 kernels (kernels="cpu-int4" + a policy)."""
    try:
        import moeflow.offload.cpu_slots  # noqa: F401
        return True
    except ImportError:
        return False


TARGET_US = {"ondemand": 120, "lru": 120, "lfu": 120, "static": 120, "mixtral-offloading": 120}  # else 250


def _us(r: dict) -> str:
    if not r:
        return ""
    return f"{r['us']:.0f}" + (f" / {r['p10_us']:.0f}" if "p10_us" in r else "")


def table(before_path: Path, after_path: Path) -> str:
    """Markdown: us per layer before -> after for every policy, kind and hit level, and the tok/s ratios."""
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    lines = ["| kernels | policy | slots | before us (median / p10) | after us (median / p10) | target | hit rate "
             "| after: begin_step p10 us (per step) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for kind in ("noop", "real"):
        for key, r in after.get(kind, {}).items():
            policy, label = key.split("/")
            b = before.get(kind, {}).get(key, {})
            target = TARGET_US.get(policy, 250) if kind == "noop" and label == "all-hit" else ""
            step = f"{r['step_p10_us']:.0f}" if r.get("step_p10_us", 0) > 5 else ""  # no per-pass work: ~1 us
            lines.append(f"| {kind} | {policy} | {label} | {_us(b)} | {_us(r)} | {target} | {r['hit_rate']:.2f} "
                         f"| {step} |")
    if after.get("tok_s"):
        lines += ["", "| decode tok/s | before | after |", "|---|---:|---:|"]
        for key in after["tok_s"]:
            b = before.get("tok_s", {}).get(key)
            lines.append(f"| {key} | {'' if b is None else f'{b:.3g}'} | {after['tok_s'][key]:.3g} |")
    lines += ["", f"load average before/after: {before.get('load_before')} / {after.get('load_before')} (2 cores)"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="print the Markdown table")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--skip-tok-s", action="store_true")
    ap.add_argument("--noop-only", action="store_true", help="only the no-op-kernel scheduler timings")
    args = ap.parse_args()
    if args.table:
        print(table(*args.table))
        return
    torch.set_num_threads(1)
    path = embedded_model_path()
    # attention as stored (attention_bits=None), as in earlier sessions' results: with int8 attention (the CPU
    # default since session 13) the resident model runs a step's layers as one native call, timing no backend call
    model = MoEOffloadedMixtral.from_pretrained(path, kernels="cpu-int4", attention_bits=None,
                                                offload=OffloadConfig(policy="lru", transport="sync"))
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    total = model.experts.num_layers * model.experts.num_experts
    result: dict = {"load_before": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version(),
                    "model": str(path.name), "tokens": args.tokens, "repeats": args.repeats, "noop": {}, "real": {}}
    for policy in args.policies.split(","):
        for label, slots in (("all-hit", total), ("half", total // 2)):
            runs = {"noop": noop_us_per_layer(model, policy, slots, 4 * args.tokens, args.repeats)}
            if not args.noop_only:
                runs["real"] = real_us_per_layer(model, ids, policy, slots, args.tokens, args.repeats)
            for kind, r in runs.items():
                result[kind][f"{policy}/{label}"] = r
                print(f"{kind:5s} {policy:19s} {label:8s} {r['us']:8.1f} us/layer (p10 {r.get('p10_us', 0):7.1f}, mean "
                      f"{r['mean_us']:8.1f})  "
                      f"hit {r['hit_rate']:.2f}", flush=True)
    model.close()
    if not args.noop_only:
        r = result["real"]["resident-cpu-int4"] = resident_us_per_layer(path, ids, args.tokens, args.repeats)
        print(f"real  {'resident-cpu-int4':19s} {'all':8s} {r['us']:8.1f} us/layer (mean {r['mean_us']:8.1f})",
              flush=True)
    if not (args.skip_tok_s or args.noop_only):
        models = {"resident-cpu-int4": MoEOffloadedMixtral.from_pretrained(path, kernels="cpu-int4",
                                                                         attention_bits=None)}
        for label, slots, kernels in (("lru-all", total, "cpu-int4"), ("lru-half", total // 2, "cpu-int4"),
                                      ("lru-all-torch-ref", total, "auto"), ("lru-half-torch-ref", total // 2, "auto")):
            if kernels == "cpu-int4" and not _slot_int4_supported():
                continue
            models[label] = MoEOffloadedMixtral.from_pretrained(
                path, kernels=kernels, attention_bits=None, offload=OffloadConfig(policy="lru", gpu_expert_slots=slots))
        tok = decode_tok_s(models, ids, args.tokens, args.repeats)
        for m in models.values():
            m.close()
        for label in ("lru-all", "lru-half", "lru-all-torch-ref", "lru-half-torch-ref"):
            if label in tok:
                tok[f"ratio_{label}"] = tok[label] / tok["resident-cpu-int4"]
        result["tok_s"] = tok
        print(json.dumps(tok, indent=1))
    result["load_after"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
