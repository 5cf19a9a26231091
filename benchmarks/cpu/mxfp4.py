"""One gpt-oss-120b expert (H 2880, I 2880: w13 [5760, 2880], w2 [2880, 2880], MXFP4) on the CPU: the ways to
compute it with torch, against the time its MXFP4 bytes take over PCIe 4 (what hybrid compute competes with).

* ``digits``: :class:`moeflow.kernels.cpu.mxfp4.Mxfp4CpuExpert` (chosen): two exact int4 digits per weight in
  torch's int4 CPU kernel, 2.4x the MXFP4 bytes of extra RAM;
* ``dequant``: dequantize the MXFP4 bytes to bf16 per call (a byte -> two-values table gather, exact), then a
  bf16 matmul: no extra RAM;
* ``bf16``: the weights kept dequantized in bf16 (3.8x the MXFP4 bytes of RAM), bf16 matmuls: torch's bf16
  GEMM speed, an upper bound for any per-call dequantization;
* ``awq``: the AWQ int4 expert of the same shape (group 32; not exact for e2m1: the peer path);
* yardsticks: reading the expert's MXFP4 bytes once (a copy, this machine's memory rate) and PCIe 4 at 25 GB/s.

Also the error of ``digits`` against the fp32 expert and the one-time conversion per expert.

    python -m benchmarks.cpu.mxfp4 [--reps 7] > benchmarks/results/cpu_mxfp4/table.md
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.cpu.quant_linear import median_s
from moeflow.kernels.cpu.int4 import Int4Expert
from moeflow.kernels.cpu.mxfp4 import Mxfp4CpuExpert
from moeflow.kernels.experts.biased import gate_activation
from moeflow.kernels.experts.mxfp4_reference import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from moeflow.kernels.formats import biased_expert_format
from moeflow.quant.awq import quantize_rtn

H, I = 2880, 2880  # noqa: E741
PCIE4_BYTES_PER_S = 25e9


_E2M1 = torch.tensor(E2M1_VALUES)
_PAIRS = torch.stack([_E2M1[torch.arange(256) & 15], _E2M1[torch.arange(256) >> 4]], -1)  # byte -> (even, odd)
_PAIRS = _PAIRS.bfloat16().contiguous().view(torch.int32).view(256)  # the two bf16 values as one int32


def dequant_bf16(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    values = _PAIRS[blocks.int()].view(torch.bfloat16).view(*blocks.shape[:-1], 32)
    return (values * torch.exp2(scales.float() - 127).bfloat16()[..., None]).flatten(-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    fmt = biased_expert_format(kind="mxfp4", hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
                             activation="clamped_swiglu")
    w13, w2 = torch.randn(2 * I, H, generator=g) * 0.02, torch.randn(H, I, generator=g) * 0.02
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    t = {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2,
         "w13_bias": torch.zeros(2 * I, dtype=torch.bfloat16), "w2_bias": torch.zeros(H, dtype=torch.bfloat16)}
    mx_bytes = sum(v.numel() for k, v in t.items() if not k.endswith("bias"))
    t0 = time.perf_counter()
    digits = Mxfp4CpuExpert.from_tensors(t, fmt)
    convert_s = time.perf_counter() - t0
    w13_bf, w2_bf = dequantize_mxfp4(b13, s13, torch.bfloat16), dequantize_mxfp4(b2, s2, torch.bfloat16)
    awq = {}
    for name, w in (("w13", w13_bf.float()), ("w2", w2_bf.float())):
        q = quantize_rtn(w, 32)
        awq[f"{name}_qweight"], awq[f"{name}_qzeros"], awq[f"{name}_scales"] = q.qweight, q.qzeros, q.scales
    awq_expert = Int4Expert.from_awq_tensors(awq, 32)

    def bf16_expert(x, wa, wb):
        h = (x @ wa.T).float()
        return (gate_activation(h, fmt).bfloat16() @ wb.T).float()

    blocks_copy = torch.empty(mx_bytes, dtype=torch.uint8)
    flat = torch.cat([b13.flatten(), s13.flatten(), b2.flatten(), s2.flatten()])
    copy_s = median_s(lambda: blocks_copy.copy_(flat), args.reps)
    pcie_s = mx_bytes / PCIE4_BYTES_PER_S
    print(f"gpt-oss-120b expert, MXFP4 {mx_bytes / 1e6:.1f} MB; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; reps {args.reps} (median)\n")
    print(f"PCIe 4 copy of the MXFP4 bytes at 25 GB/s: {pcie_s * 1e3:.2f} ms; reading them once here (copy): "
          f"{copy_s * 1e3:.2f} ms ({mx_bytes / copy_s / 1e9:.1f} GB/s)")
    print(f"digits: one-time conversion {convert_s * 1e3:.0f} ms per expert, CPU form {digits.nbytes / 1e6:.1f} MB "
          f"({digits.nbytes / mx_bytes:.2f}x the MXFP4 bytes)\n")
    print("| T | digits (chosen) ms | dequant per call ms | bf16 resident ms | awq int4 ms | digits / PCIe | "
          "digits max-rel err vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for T in (1, 4):
        x = torch.randn(T, H, generator=g)
        w = torch.ones(T)
        xb = x.bfloat16()
        cases = {
            "digits": lambda x=x, w=w: digits.forward(x, w),
            "dequant": lambda xb=xb: bf16_expert(xb, dequant_bf16(b13, s13), dequant_bf16(b2, s2)),
            "bf16": lambda xb=xb: bf16_expert(xb, w13_bf, w2_bf),
            "awq": lambda x=x, w=w: awq_expert.forward(x, w),
        }
        times = {name: median_s(fn, args.reps) for name, fn in cases.items()}
        want = (gate_activation(x @ w13_bf.float().T, fmt) @ w2_bf.float().T)
        err = float((digits.forward(x, w) - want).abs().max() / want.abs().max())
        print(f"| {T} | {times['digits'] * 1e3:.2f} | {times['dequant'] * 1e3:.2f} | {times['bf16'] * 1e3:.2f} | "
              f"{times['awq'] * 1e3:.2f} | {times['digits'] / pcie_s:.1f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
