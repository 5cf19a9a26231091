"""Quantized CPU linear layers (moeflow.kernels.cpu.quant_linear) vs the fp32 / bf16 ``F.linear`` they replace.

Shapes: the peer benchmark's synthetic Mixtral (lm_head 32000 x 1024, q/o 1024 x 1024, k/v 256 x 1024) and
Mixtral-8x7B's lm_head (32000 x 4096), at T = 1 (decode) and 32 (a short prefill). Median of ``--reps``
calls after a warm-up, 2 threads, with ``uptime`` before and after (the machine is shared), GB/s of the
weight bytes each kernel reads, and the max relative error of the output vs fp32 on random inputs.

    python -m benchmarks.cpu.quant_linear --out benchmarks/results/cpu_quant_linear
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moeflow.kernels.cpu.quant_linear import quantize_linear_cpu

SHAPES = {"synthetic lm_head": (32000, 1024), "synthetic q/o_proj": (1024, 1024),
          "synthetic k/v_proj": (256, 1024), "mixtral-8x7b lm_head": (32000, 4096)}
TOKENS = (1, 32)


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run(reps: int) -> dict:
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5
        wb = w.bfloat16()
        layers = {"fp32": (lambda x, w=w: F.linear(x, w), w.numel() * 4),
                  "bf16": (lambda x, wb=wb: F.linear(x.bfloat16(), wb).float(), w.numel() * 2)}
        for bits, group in ((8, 0), (4, 32), (4, 128)):
            q = quantize_linear_cpu(w, bits, group or 128)
            layers[f"int{bits}" + (f" g{group}" if group else "")] = (q.forward, q.nbytes)
        for T in TOKENS:
            x = torch.randn(T, in_f, generator=gen)
            want = F.linear(x, w)
            for kind, (fn, nbytes) in layers.items():
                s = median_s(lambda fn=fn, x=x: fn(x), reps)
                err = float(((fn(x) - want).norm(dim=-1) / want.norm(dim=-1)).max())
                rows.append({"shape": name, "out": out_f, "in": in_f, "T": T, "kind": kind, "ms": s * 1e3,
                             "weight_bytes": nbytes, "GBps": nbytes / s / 1e9, "max_rel_err": err})
                print(rows[-1], flush=True)
    return {"rows": rows}


def markdown(res: dict) -> str:
    lines = ["| layer | T | kind | ms | GB/s of weights | speed-up vs fp32 | max rel. error vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    base = {(r["shape"], r["T"]): r["ms"] for r in res["rows"] if r["kind"] == "fp32"}
    for r in res["rows"]:
        lines.append(f"| {r['shape']} ({r['out']} x {r['in']}) | {r['T']} | {r['kind']} | {r['ms']:.3f} | "
                     f"{r['GBps']:.2f} | {base[(r['shape'], r['T'])] / r['ms']:.2f}x | {r['max_rel_err']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(2)
    up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    res = run(args.reps)
    res.update(uptime_before=up0, uptime_after=subprocess.run(["uptime"], capture_output=True, text=True)
               .stdout.strip(), torch=torch.__version__, cpu_capability=torch.backends.cpu.get_cpu_capability(),
               threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_cpu_quant_linear.json").write_text(json.dumps(res, indent=1))
    table = markdown(res)
    (args.out / "table.md").write_text(
        f"{res['date']}, torch {res['torch']} ({res['cpu_capability']}), {res['threads']} threads.  \n"
        f"uptime before: `{up0}`  \nuptime after: `{res['uptime_after']}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
