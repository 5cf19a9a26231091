"""One expert on the CPU per token count: moeflow's own kernels (``cpu_native``) vs torch's int4 kernel (issue 21).

Shapes of the peer benchmark's synthetic Mixtral (hidden 1024, intermediate 3584, AWQ g128). Each timing runs
``--experts`` distinct experts in turn (~6 MB each, so the weights stream from memory as in a decode step, not
from cache) on one thread and reports CPU milliseconds per expert call (``time.process_time``: on a shared
machine the CPU time a call needs moves far less with the load than its wall time) and the weight bytes read per
CPU second.

    python benchmarks/peers/bench_cpu_native.py --out benchmarks/results/peers/s3/bench_cpu_native.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from moeflow.kernels.cpu_int4 import COMPUTE_DTYPE, Int4Matrix
from moeflow.kernels.cpu_native import Q4Matrix, library, q4_expert
from moeflow.quant.awq import quantize_rtn

HIDDEN, INTER, GROUP = 1024, 3584, 128


def awq(n: int, k: int, seed: int):
    t = quantize_rtn(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, GROUP)
    return t.qweight, t.qzeros, t.scales


def torch_expert(w13: Int4Matrix, w2: Int4Matrix, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch-kernel expert as ``Int4Expert`` runs it without moeflow's kernels (bf16 activations)."""
    h = w13.matmul(x.to(COMPUTE_DTYPE)).float()
    a = (torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]).to(COMPUTE_DTYPE)
    return w2.matmul(a).float() * w[:, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--experts", type=int, default=24, help="distinct experts cycled through (memory, not cache)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base13, base2 = awq(2 * INTER, HIDDEN, 0), awq(HIDDEN, INTER, 1)
    native = [(Q4Matrix.from_awq(*base13, GROUP), Q4Matrix.from_awq(*base2, GROUP))]
    reference = [(Int4Matrix.from_awq(*base13, GROUP), Int4Matrix.from_awq(*base2, GROUP))]
    for _ in range(args.experts - 1):  # distinct copies: each call reads its own bytes from memory
        a, b = native[0]
        native.append((Q4Matrix(a.packed.clone(), a.scales.clone(), a.mins.clone(), GROUP),
                       Q4Matrix(b.packed.clone(), b.scales.clone(), b.mins.clone(), GROUP)))
        c, d = reference[0]
        reference.append((Int4Matrix(c.packed.clone(), c.scales_zeros.clone(), GROUP),
                          Int4Matrix(d.packed.clone(), d.scales_zeros.clone(), GROUP)))
    sizes = {"moeflow cpu_native": native[0][0].nbytes + native[0][1].nbytes,
             "torch _weight_int4pack_mm_for_cpu": reference[0][0].nbytes + reference[0][1].nbytes}
    rows = []
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    with torch.inference_mode():
        for t in (int(v) for v in args.tokens.split(",")):
            x, w = torch.randn(t, HIDDEN), torch.rand(t)
            for name, experts, fn in (
                    ("moeflow cpu_native", native, lambda e, x=x, w=w: q4_expert(x, e[0], e[1], w)),
                    ("torch _weight_int4pack_mm_for_cpu", reference,
                     lambda e, x=x, w=w: torch_expert(e[0], e[1], x, w))):
                fn(experts[0])
                times = []
                for _ in range(args.reps):
                    c0 = time.process_time()
                    for e in experts:
                        fn(e)
                    times.append((time.process_time() - c0) / len(experts))
                ms = statistics.median(times) * 1e3
                rows.append({"kernel": name, "tokens": t, "cpu_ms_per_expert": round(ms, 3),
                             "weight_gb_per_cpu_s": round(sizes[name] / ms / 1e6, 2),
                             "cpu_ms_per_token": round(ms / t, 3)})
                print(rows[-1], flush=True)
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shapes": {"hidden": HIDDEN, "intermediate": INTER, "group": GROUP},
                                    "expert_bytes": sizes, "simd": bool(library().mf_simd()), "threads": 1,
                                    "uptime": uptime, "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
