"""One expert on the CPU per token count: moeflow's own kernels (``cpu_native``) vs torch's int4 kernel (issue 21).

Shapes: ``--shape synthetic`` (the peer benchmark's synthetic Mixtral: hidden 1024, intermediate 3584) or
``mixtral-8x7b`` (hidden 4096, intermediate 14336); AWQ group 128. Each timing runs ``--experts`` distinct
experts in turn (so the weights stream from memory as in a decode step, not from cache) and reports CPU
milliseconds per expert call (``time.process_time``, all threads together: on a shared machine the CPU time a call
needs moves far less with the load than its wall time), wall milliseconds, and the weight bytes read per wall
second and per CPU second, with the ratio of bytes/s at T = 1 to bytes/s at T, by wall and by CPU time (1.0 =
memory-bound at every T).
Run it once per tree to compare a change (``PYTHONPATH=<tree>``; ``--label`` names the tree in the JSON).

    python -m benchmarks.peers.bench_cpu_native --shape mixtral-8x7b --threads 1,2 --kernels native \\
        --out benchmarks/results/cpu_native/after.json --label after
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.peers.peer_report import uptime
from moeflow.kernels.cpu.int4 import COMPUTE_DTYPE, Int4Matrix
from moeflow.kernels.cpu.native import library
from moeflow.kernels.cpu.q4_matrix import Q4Matrix, q4_expert
from moeflow.quant.awq import quantize_rtn

SHAPES = {"synthetic": (1024, 3584), "mixtral-8x7b": (4096, 14336)}
GROUP = 128
NATIVE, TORCH = "moeflow cpu_native", "torch _weight_int4pack_mm_for_cpu"


def awq(n: int, k: int, seed: int):
    t = quantize_rtn(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, GROUP)
    return t.qweight, t.qzeros, t.scales


def torch_expert(w13: Int4Matrix, w2: Int4Matrix, x: torch.Tensor, w: torch.Tensor, inter: int) -> torch.Tensor:
    """The torch-kernel expert as ``Int4Expert`` runs it without moeflow's kernels (bf16 activations)."""
    h = w13.matmul(x.to(COMPUTE_DTYPE)).float()
    a = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(COMPUTE_DTYPE)
    return w2.matmul(a).float() * w[:, None]


def experts_of(kernel: str, hidden: int, inter: int, count: int) -> tuple[list, int]:
    """``count`` distinct copies of one random expert in ``kernel``'s format, and the bytes of one."""
    base13, base2 = awq(2 * inter, hidden, 0), awq(hidden, inter, 1)
    if kernel == NATIVE:
        a, b = Q4Matrix.from_awq(*base13, GROUP), Q4Matrix.from_awq(*base2, GROUP)
        copies = [(a, b)] + [(Q4Matrix(a.packed.clone(), a.scales.clone(), a.mins.clone(), GROUP),
                              Q4Matrix(b.packed.clone(), b.scales.clone(), b.mins.clone(), GROUP))
                             for _ in range(count - 1)]
    else:
        a, b = Int4Matrix.from_awq(*base13, GROUP), Int4Matrix.from_awq(*base2, GROUP)
        copies = [(a, b)] + [(Int4Matrix(a.packed.clone(), a.scales_zeros.clone(), GROUP),
                              Int4Matrix(b.packed.clone(), b.scales_zeros.clone(), GROUP)) for _ in range(count - 1)]
    return copies, a.nbytes + b.nbytes


def time_calls(fn, experts: list, reps: int) -> tuple[float, float]:
    """Median CPU and wall seconds per call over ``reps`` passes through every expert."""
    fn(experts[0])
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        for e in experts:
            fn(e)
        cpu.append((time.process_time() - c0) / len(experts))
        wall.append((time.perf_counter() - w0) / len(experts))
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", default="", help="names the tree measured (e.g. before / after)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="synthetic")
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--kernels", default="native,torch", help="native and/or torch")
    ap.add_argument("--experts", type=int, default=None,
                    help="distinct experts cycled through (default: enough for 200 MB, so memory, not cache)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    hidden, inter = SHAPES[args.shape]
    kernels = [{"native": NATIVE, "torch": TORCH}[k] for k in args.kernels.split(",")]
    one = 3 * hidden * inter * 9 // 16  # int4 + fp32 scale and min per 128: about one expert's bytes
    count = args.experts or max(2, -(-200_000_000 // one))
    rows, marks = [], [uptime()]
    with torch.inference_mode():
        for kernel in kernels:
            experts, nbytes = experts_of(kernel, hidden, inter, count)
            for threads in (int(v) for v in args.threads.split(",")):
                torch.set_num_threads(threads)
                base = None
                for t in (int(v) for v in args.tokens.split(",")):
                    x, w = torch.randn(t, hidden), torch.rand(t)
                    fn = ((lambda e, x=x, w=w: q4_expert(x, e[0], e[1], w)) if kernel == NATIVE
                          else (lambda e, x=x, w=w: torch_expert(e[0], e[1], x, w, inter)))
                    cpu, wall = time_calls(fn, experts, args.reps)
                    base = base or (wall, cpu)
                    rows.append({"kernel": kernel, "threads": threads, "tokens": t,
                                 "wall_ms_per_expert": round(wall * 1e3, 3), "cpu_ms_per_expert": round(cpu * 1e3, 3),
                                 "weight_gb_per_s": round(nbytes / wall / 1e9, 2),
                                 "weight_gb_per_cpu_s": round(nbytes / cpu / 1e9, 2),
                                 "slowdown_per_byte_vs_t1": round(wall / base[0], 2),
                                 "cpu_slowdown_per_byte_vs_t1": round(cpu / base[1], 2),
                                 "wall_ms_per_token": round(wall * 1e3 / t, 3)})
                    print(rows[-1], flush=True)
            del experts
    marks.append(uptime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"label": args.label, "shape": args.shape,
                                    "shapes": {"hidden": hidden, "intermediate": inter, "group": GROUP},
                                    "experts_cycled": count, "simd": bool(library().mf_simd()), "uptime": marks,
                                    "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
