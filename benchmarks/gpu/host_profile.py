"""Where a GPU decode step's host time goes: cProfile and torch.profiler's CPU table of steady-state decode steps
(``--policy``, default resident, on the synthetic Mixtral checkpoint of ``--layers`` layers). Prints the top
functions by own time and by cumulative time, and the top aten ops by self CPU time; writes them to ``--out``.

    python -m benchmarks.gpu.host_profile --layers 8 --out $OUT/host_profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

import torch

from benchmarks.common.checkpoint import add_checkpoint_args, mixtral_setup, write_synthetic_awq_checkpoint
from benchmarks.gpu.engine import load_in_ram
from benchmarks.gpu.offload import _sync, install_backend


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--policy", default="resident")
    ap.add_argument("--slots", type=int, default=None, help="expert slots for a caching policy (default: all)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    device, dtype, config, kernels, group, ckpt = mixtral_setup(args)
    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    L, E = config["num_hidden_layers"], config["num_local_experts"]
    model = load_in_ram(ckpt, device, dtype, kernels, L * E)  # eager: its step's host time is the subject
    install_backend(model, model.experts.host, args.policy, args.slots or L * E, "auto")
    prompt = torch.randint(3, config["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=[])
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=[])
    _sync(device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=[])
        _sync(device)
    text.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text.getvalue())
    print(text.getvalue()[:12000])


if __name__ == "__main__":
    main()
