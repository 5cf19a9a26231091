"""Machine-code figures of the MXFP4 expert kernels at gpt-oss-120b shapes, compiled for sm_90 without a GPU.

For each stage (w13: gate + up tiles; w2) and regime (decode: 1 token x top-4, GEMV-shaped; prefill: 16-row
``tl.dot`` tiles) it prints registers, spills, the hot loop's warp-instructions per weight (the figure that
bounds a memory-bound kernel: an H100 issues ~1e12 warp-instructions/s and streams ~3.35e12 B/s, so 4.25-bit
weights at HBM speed allow about 0.15) and the loop's opcode histogram.

    python benchmarks/sass_mxfp4.py [--sm 90] [--block-n 64] [--warps 4]   (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools"))

H = I = 2880  # gpt-oss-120b: hidden 2880, expert intermediate 2880, 128 experts, top-4  # noqa: E741
EXPERTS, TOP_K = 128, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--block-k", type=int, default=128)
    args = ap.parse_args()
    from sass_probe import probe

    from moeflow.kernels.biased import BiasedExpertFormat
    from moeflow.kernels.mxfp4 import mxfp4_gemm
    from moeflow.kernels.pool import ExpertPool
    from moeflow.kernels.reference import routing_plan_reference

    fmt = BiasedExpertFormat(H, I, "mxfp4", torch.bfloat16, 32, activation="clamped_swiglu")
    print(f"one gpt-oss-120b MXFP4 expert: {fmt.nbytes / 1e6:.2f} MB ({fmt.nbytes * 8 / (3 * H * I):.3f} bits/weight)")
    pool = ExpertPool.allocate(fmt, 4, "cpu")
    slots = torch.arange(EXPERTS, dtype=torch.int32) % 4
    for regime, tokens, block_m, scaled in (("decode", 1, 1, False), ("decode", 1, 16, True),
                                            ("prefill", 512, 16, False), ("prefill", 512, 16, True)):
        x = torch.zeros(tokens, H, dtype=torch.bfloat16)
        ids = torch.randint(0, EXPERTS, (tokens, TOP_K), dtype=torch.int32)
        w = torch.full((tokens, TOP_K), 0.25)
        out = torch.zeros(tokens * TOP_K, H, dtype=torch.bfloat16)
        stage = {"BLOCK_N": args.block_n, "num_warps": args.warps, "SCALED": scaled, "BLOCK_K": args.block_k}
        plan = routing_plan_reference(ids, EXPERTS, block_m)[:2]  # the plan kernel is the AWQ module's
        h = torch.zeros(tokens * TOP_K, I, dtype=torch.bfloat16)
        t, act = pool.tensors, dict(activation="clamped_swiglu", config=stage)
        with probe(sm=args.sm) as found:
            mxfp4_gemm(0, x, t["w13_blocks"], t["w13_scales"], t["w13_bias"], h, *plan, slots, None, None, TOP_K,
                       block_m, **act)
            mxfp4_gemm(1, h, t["w2_blocks"], t["w2_scales"], t["w2_bias"], out, *plan, slots, None,
                       w.reshape(-1), 1, block_m, **act)
        gemms = [k for k in found if k.name == "_mxfp4_gemm_kernel"]
        for stage_name, k in zip(("w13", "w2"), gemms, strict=True):
            if k.error:
                print(regime, stage_name, "ERROR", k.error)
                continue
            step_k = args.block_k if scaled else 32  # one K step: BLOCK_K (tl.dot_scaled) or one 32-block per row
            weights = (2 if stage_name == "w13" else 1) * args.block_n * step_k
            path = "dot_scaled" if scaled else "explicit"
            print(f"{regime:8s} {path:10s} {stage_name}: BLOCK_M={block_m} BLOCK_N={args.block_n} warps={k.num_warps} "
                  f"regs={k.regs} spill={k.spill_bytes} loop={k.loop_instructions} instr -> "
                  f"{k.warp_instructions_per_weight(weights):.3f} warp-instr/weight; "
                  f"top ops {k.loop_ops.most_common(8)}")


if __name__ == "__main__":
    main()
