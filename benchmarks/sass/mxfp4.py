"""Machine-code report of the MXFP4 expert kernels at gpt-oss shapes, compiled for sm_90 on any machine (no GPU).

    python -m benchmarks.sass.mxfp4                       # gpt-oss-120b shapes, one JSON object per line
    python -m benchmarks.sass.mxfp4 --out benchmarks/results/sass/mxfp4-after.json
    python -m benchmarks.sass.mxfp4 --layout row-major    # the same kernels reading row-major blocks (strides)

Every launch of ``mxfp4_expert_forward``'s two stages (w13 with bias + clamped SwiGLU, w2 with bias and the
routing weight) is compiled with the installed Triton and its ptxas through :func:`sass.report.compile_only`
and reported with the same keys as ``benchmarks/sass/report.py``: registers, spills, shared memory, and
``warp_instructions_per_weight`` = hot-loop instructions x warps / weights one iteration consumes
(``BLOCK_N x BLOCK_K``; a w13 tile's rows are gate and up rows). An H100 issues ~1e12 warp-instructions/s and
streams ~3.35e12 B/s, so a 4.25-bit weight loop above ~0.15 cannot reach HBM speed. ``--layout row-major`` compiles
the launches for the layout before K panels (rows K/2 bytes apart, ``mxfp4_reference.row_major_as_panels``) instead
of the pool's. TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

MODELS = {  # name: (hidden, intermediate, experts, top_k)
    "gpt-oss-120b": (2880, 2880, 128, 4),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "tiny": (64, 96, 4, 2),
}
TOKENS = (1, 4, 16, 512, 4096)


def mxfp4_layer_launches(model: str, T: int, config: dict | None = None, dtype: torch.dtype = torch.bfloat16,
                         layout: str = "panel") -> list[dict]:
    """Compile the two MXFP4 expert stages of one MoE layer at T tokens; one row per kernel. ``config``: the
    launcher's (``{"BLOCK_M", "w13": {...}, "w2": {...}}``), None for the shipped defaults; ``layout``: "panel"
    (the pool's) or "row-major" (strided views of row-major blocks and scales)."""
    from benchmarks.sass.report import _row, compile_only
    from moeflow.kernels.experts import mxfp4
    from moeflow.kernels.experts.mxfp4_reference import row_major_as_panels
    from moeflow.kernels.experts.reference import routing_plan_reference
    from moeflow.kernels.formats import biased_expert_format
    from moeflow.kernels.pool import ExpertPool

    H, I, E, k = MODELS[model]  # noqa: E741
    fmt = biased_expert_format(H, I, "mxfp4", dtype, 32, activation="clamped_swiglu")
    pool = ExpertPool(fmt, torch.empty((1, fmt.nbytes), dtype=torch.uint8))
    t = dict(pool.tensors)
    if layout == "row-major":  # [1, K/P, N, P/32, ...] views of [1, N, K/32, ...] tensors
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            n_panels, rows, per_panel = t[name].shape[1:4]
            flat = torch.empty((1, rows, n_panels * per_panel, *t[name].shape[4:]), dtype=torch.uint8)
            t[name] = row_major_as_panels(flat, per_panel * 32)
    stages = mxfp4.stage_configs(T, E, k, H, I, config)  # the launcher's defaults (decode splits included)
    block_m = stages["BLOCK_M"]
    ids = (torch.arange(T * k, dtype=torch.int32) % E).reshape(T, k)
    sorted_ids, eob = routing_plan_reference(ids, E, block_m)[:2]
    slots = torch.zeros(E, dtype=torch.int32)
    x = torch.empty((T, H), dtype=dtype)
    h = torch.empty((T * k, I), dtype=dtype)
    out = torch.empty((T * k, H), dtype=dtype)
    act = dict(activation="clamped_swiglu")
    with compile_only() as found:
        mxfp4.mxfp4_gemm(0, x, t["w13_blocks"], t["w13_scales"], t["w13_bias"], h, sorted_ids, eob, slots, None,
                         None, k, block_m, **act, config=stages["w13"])
        mxfp4.mxfp4_gemm(1, h, t["w2_blocks"], t["w2_scales"], t["w2_bias"], out, sorted_ids, eob, slots, None,
                         torch.empty(T * k), 1, block_m, **act, config=stages["w2"])
    rows = []
    for c, (stage, K) in zip(found, (("w13", H), ("w2", I)), strict=True):
        wcfg = {**stages[stage], "BLOCK_K": mxfp4.block_k_for(K, stages[stage]["BLOCK_K"])}
        rows.append({**_row(c, model, T, stage, block_m, wcfg), "dtype": str(dtype).replace("torch.", ""),
                     "layout": layout})
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sass.report import emit_json_lines

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt-oss-120b"], choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--config", type=json.loads, default=None, help='e.g. \'{"w13": {"BLOCK_N": 128}}\'')
    p.add_argument("--layout", default="panel", choices=["panel", "row-major"])
    p.add_argument("--out", type=Path, help="also write the lines to this file")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = [r for model in args.models for T in args.tokens
            for r in mxfp4_layer_launches(model, T, args.config, dtype, args.layout)]
    emit_json_lines(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
