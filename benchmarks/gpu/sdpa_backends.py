"""Which scaled_dot_product_attention backend the decode path should use on a GPU (issue 12 found cuDNN's costing
~7 ms of host time per call on torch 2.11 / H100 with our static cache + bool mask).

For each backend (default choice, cuDNN, flash, efficient, math) and each case (Mixtral's GQA 32/8 heads, D 128,
a static cache of ``max_len`` with a bool mask, as ``families.layers.Attention`` calls it), prints one JSON line:
host microseconds per call (the CPU side of an eager call, synchronised once per 50 calls) and GPU microseconds
per call (CUDA events over 50 calls), or the error a backend raised. No model needed.

    python -m benchmarks.gpu.sdpa_backends [--out sdpa.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def case(b: int, t: int, max_len: int, gqa: bool) -> tuple:
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(b, 32, t, 128, device=dev, dtype=dt)
    kv_heads = 8 if gqa else 32
    k = torch.randn(b, kv_heads, max_len, 128, device=dev, dtype=dt)
    v = torch.randn_like(k)
    pos = torch.arange(max_len, device=dev)
    start = max_len // 2
    mask = (pos[None, :] <= (start + torch.arange(t, device=dev))[:, None]).expand(b, 1, t, max_len)
    return q, k, v, mask


def measure(name: str, args: tuple, gqa: bool, calls: int = 50) -> dict:
    q, k, v, mask = args
    backend = BACKENDS[name]
    def call():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    try:
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
        out = call()
        err = (out.float() - ref).abs().max().item()
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            call()
        e1.record()
        torch.cuda.synchronize()
        return {"host_us": host * 1e6, "gpu_us": e0.elapsed_time(e1) * 1e3 / calls, "max_abs_err": err}
    except Exception as exc:  # a backend that refuses these inputs: record why
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for b, t, max_len in ((1, 1, 4096), (8, 1, 4096), (1, 1, 512), (1, 512, 4096), (1, 2048, 4096)):
        for gqa in (True, False):
            args = case(b, t, max_len, gqa)
            for name in BACKENDS:
                row = {"B": b, "T": t, "max_len": max_len, "gqa": gqa, "backend": name, **measure(name, args, gqa)}
                print(json.dumps(row), flush=True)
                rows.append(row)
                if a.out:
                    with open(a.out, "w") as f:
                        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
