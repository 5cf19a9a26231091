"""Machine-code report of the Gated DeltaNet kernels (moeflow.kernels.deltanet.kernels) at Qwen3-Next / Qwen3.5-MoE
shapes, compiled for sm_90 on any machine (no GPU).

    python -m benchmarks.sass.deltanet                    # Qwen3-Next-80B shapes, one JSON object per line
    python -m benchmarks.sass.deltanet --out benchmarks/results/sass/deltanet.json

Each launch of one linear-attention layer (decode: the conv and the fused recurrence; prefill runs the same
recurrence binary, the token count is a runtime argument) is compiled with the installed Triton and its ptxas
through :func:`sass.report.compile_only` and reported with registers, spilled bytes, shared memory, programs per
SM and the grid. TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

MODELS = {  # name: (key heads, value heads, k_dim, v_dim, conv kernel)
    "qwen3-next-80b": (16, 32, 128, 128, 4),
    "qwen3.5-397b": (16, 64, 128, 128, 4),
    "tiny": (2, 4, 8, 6, 4),
}


def deltanet_launches(model: str, rows: int, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compile the decode launches of one layer (``rows`` sequences, one token each); one record per kernel."""
    from benchmarks.sass.report import _row, compile_only
    from moeflow.kernels.deltanet import kernels as k
    from moeflow.kernels.triton_common import next_pow2

    hk, hv, dk, dv, kw = MODELS[model]
    conv_dim = 2 * hk * dk + hv * dv
    qkv = torch.empty((rows, 1, conv_dim), dtype=dtype)
    conv_state = torch.empty((rows, kw - 1, conv_dim), dtype=dtype)
    weight = torch.empty((conv_dim, 1, kw), dtype=dtype)
    mask = torch.ones((rows, 1), dtype=torch.bool)
    ab = torch.empty((rows, 1, hv), dtype=dtype)
    params = torch.empty((hv,), dtype=dtype)
    state = torch.empty((rows, hv, dk, dv), dtype=torch.float32)
    with compile_only() as found:
        k.conv_decode(qkv, conv_state, weight, mask)
        k.recurrent(qkv, ab, ab, params, params, mask, state, hk, dk, dk ** -0.5, dtype)
    bv = min(k.BLOCK_V, next_pow2(dv))
    launches = {"_conv_decode_kernel": ("conv_decode", {"BLOCK_C": k.CONV_BLOCK}, rows * -(-conv_dim // k.CONV_BLOCK)),
                "_recurrent_kernel": ("recurrent", {"BLOCK_V": bv}, rows * hv * -(-dv // bv))}
    out = []
    for c in found:
        kernel, cfg, programs = launches[c.name]
        row = _row(c, model, 1, kernel, 0, cfg)
        out.append({key: v for key, v in row.items() if key not in ("BLOCK_M", "weights_per_iteration",
                                                                   "warp_instructions_per_weight", "mma_waits")}
                   | {"rows": rows, "programs": programs, "dtype": str(dtype).replace("torch.", "")})
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sass.report import emit_json_lines

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-next-80b"], choices=sorted(MODELS))
    p.add_argument("--rows", type=int, default=1, help="decode batch rows (the grid; the binary is the same)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", type=Path, help="also write the lines to this file")
    args = p.parse_args(argv)
    rows = [r for model in args.models
            for r in deltanet_launches(model, args.rows, getattr(torch, args.dtype))]
    emit_json_lines(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
