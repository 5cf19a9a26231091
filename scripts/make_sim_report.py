"""Regenerate the simulator figures and tables of docs/simulator.md (one command, CPU only, a few minutes).

    python -m scripts.make_sim_report            # writes docs/sim_*.png and the tables between the markers

1. Small-model routing: the embedded model (moeflow/data/tiny-mixtral-awq) when it exists; otherwise a tiny
   random AWQ checkpoint written here (benchmarks/common/checkpoint.py, 8 layers x 8 experts), whose
   routing is recorded with ``record_trace`` (prefill + greedy decode, with hidden states and its routers).
   Its experts are charged as Mixtral-8x7B experts on the pcie4-24gb profile (the routing is the small
   model's, the costs are Mixtral's): the figure compares policies on real recorded routing.
2. Mixtral-8x7B-sized: a SYNTHETIC trace of Mixtral's shape (32 layers x 8 experts, top-2; moeflow.trace.synthetic:
   skewed, temporally local, residual-stream routing, not real Mixtral routing) on the pcie4-24gb and h100-pcie5
   presets.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from moeflow.errors import SchedulingError
from moeflow.sim import get_profile, simulate
from moeflow.sim.cli import format_table
from moeflow.sim.plot import plot_sweep, plot_timeline
from moeflow.sim.simulator import SimulationError, known_policies
from moeflow.trace.synthetic import gate_modules, synthesize_trace

ROOT = Path(__file__).resolve().parents[1]

BEGIN, END = "<!-- sim-report:begin -->", "<!-- sim-report:end -->"


def small_model_trace(workdir: Path):
    """(trace, routers, description, predictor checkpoint or None) from the embedded model (its trained
    predictors included), else from a tiny random AWQ checkpoint."""
    from moeflow import MoEOffloadedMixtral
    from moeflow.tools.record import record_trace

    embedded = ROOT / "moeflow" / "data" / "tiny-mixtral-awq"
    if (embedded / "config.json").is_file():
        path, what = embedded, "the embedded model moeflow/data/tiny-mixtral-awq"
    else:
        from benchmarks.common.checkpoint import TINY, write_synthetic_awq_checkpoint

        cfg = dict(TINY, num_hidden_layers=8)
        path = write_synthetic_awq_checkpoint(workdir / "tiny-random-awq", cfg, group_size=32)
        what = ("a tiny RANDOM AWQ checkpoint (8 layers x 8 experts, top-2, hidden 128; the embedded model "
                "does not exist yet)")
    model = MoEOffloadedMixtral.from_pretrained(path, device="cpu", progress=False)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    if path == embedded:  # text its trained predictors know (ExpertFlow's vocabulary is the training text's)
        texts = ("The \"with\" statement is used to wrap the execution of a block", "def add(a, b):\n    return a + b",
                 "Python lists are mutable sequences, typically used to store collections", "import os\nimport sys")
        prompts = [model.tokenizer.encode(t) for t in texts]
    else:
        prompts = [torch.randint(3, vocab, (24,), generator=g).tolist() for _ in range(4)]
    trace = record_trace(model, prompts, max_new_tokens=24, hidden=True)
    gates = gate_modules([l.block_sparse_moe.gate.weight.detach().float() for l in model.model.layers])
    return trace, gates, what, (path if path == embedded else None)


def sweep(trace, gates, profile, slots_list: list[int], policies: list[str], predictor_dir=None) -> tuple[list, dict]:
    rows, by_key = [], {}
    total = trace.num_layers * trace.num_experts
    for policy in policies:
        for n in ([total] if policy == "resident" else slots_list):
            try:
                r = simulate(trace, policy, n, profile, gates=gates, timeline=True, predictor_dir=predictor_dir)
            except (SimulationError, SchedulingError) as e:  # e.g. a predictor policy without its trained file
                print(f"  skip {policy}: {e}", file=sys.stderr)
                break
            rows.append(r)
            by_key[(policy, r.slots)] = r
    return rows, by_key


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=Path, default=ROOT / "docs")
    ap.add_argument("--quick", action="store_true", help="fewer sequences and budgets (tests)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    policies = known_policies()
    sections = []
    pcie4 = get_profile("pcie4-24gb")

    with tempfile.TemporaryDirectory() as tmp:
        trace, gates, what, predictors = small_model_trace(Path(tmp))
    if args.quick:
        trace = trace.select(trace.sequence_ids()[:1])
    small_prof = pcie4.with_overrides(name="pcie4-24gb (Mixtral expert costs)")
    from dataclasses import replace

    small_prof = replace(small_prof, num_layers=None, num_experts=None, top_k=None)
    total = trace.num_layers * trace.num_experts
    slots = [s for s in (2, 4, 8, 16, 24, 32, 48, 64) if s <= total]
    rows, _ = sweep(trace, gates, small_prof, slots[:3] if args.quick else slots, policies, predictors)
    png = plot_sweep([r.as_dict() for r in rows], args.docs / "sim_small_model_pcie4.png",
                     f"{trace.num_layers}x{trace.num_experts} model's recorded routing, Mixtral expert costs, PCIe 4",
                     bound_s=next(r.decode_bound_s for r in rows if r.policy != "resident"))
    sections.append(("small", what, small_prof, rows, png))

    mix_trace, mix_gates_w = synthesize_trace(sequences=1 if args.quick else 2, prompt_len=32,
                                              new_tokens=9 if args.quick else 13, seed=0,
                                              model="synthetic Mixtral-8x7B-shaped")
    mix_gates = gate_modules(mix_gates_w)
    for name in ("pcie4-24gb", "h100-pcie5"):
        prof = get_profile(name)
        mslots = [4, 16, 64] if args.quick else [4, 16, 32, 64, 128, 192, 256]
        rows, by_key = sweep(mix_trace, mix_gates, prof, mslots, policies)
        png = plot_sweep([r.as_dict() for r in rows], args.docs / f"sim_mixtral_{name}.png",
                         f"Mixtral-8x7B-sized SYNTHETIC trace on {name}",
                         bound_s=next(r.decode_bound_s for r in rows if r.policy != "resident"),
                         max_slots=prof.max_slots())
        sections.append((name, "a synthetic Mixtral-8x7B-shaped trace", prof, rows, png))
        if name == "pcie4-24gb":
            pick = by_key.get(("mixtral-offloading", 64)) or rows[-1]
            plot_timeline(pick, args.docs / "sim_timeline_pcie4.png")

    lines = [BEGIN, "", f"Generated by `python -m scripts.make_sim_report` in {time.perf_counter() - t0:.0f} s.", ""]
    for key, what_, prof, rows, png in sections:
        shown = [r for r in rows if r.policy == "resident" or r.slots in (4, 16, 64, 128) or key == "small"
                 and r.slots in (4, 16, 32)]
        lines += [f"### {key}: {what_}, profile `{prof.name}`", "",
                  f"![time per token against slots]({png.name})", "", format_table(shown), ""]
    lines.append(END)
    doc = args.docs / "simulator.md"
    text = doc.read_text() if doc.is_file() else f"# Simulator\n\n{BEGIN}\n{END}\n"
    a, b = text.index(BEGIN), text.index(END) + len(END)
    doc.write_text(text[:a] + "\n".join(lines) + text[b:])
    print(f"wrote {doc} and {len(sections)} figures in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
