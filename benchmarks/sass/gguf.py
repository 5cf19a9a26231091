"""Machine-code report of the GGUF expert kernels at Qwen3-30B-A3B shapes, compiled for sm_90 on any machine (no
GPU).

    python benchmarks/sass/gguf.py                           # Q4_K_M (Q4_K gate/up, Q6_K down), one JSON line each
    python benchmarks/sass/gguf.py --types Q4_0 Q4_0 --tokens 1 --out benchmarks/results/sass/gguf-q4_0.json

Both stages of ``gguf_expert_forward`` (w13 reading gate and up, w2 with the routing weight) are compiled with the
installed Triton and its ptxas through :func:`sass_report.compile_only` and reported with ``sass_report``'s keys:
registers, spills, shared memory, and ``warp_instructions_per_weight`` = hot-loop instructions x warps / weights one
iteration consumes (``BLOCK_N x BLOCK_K``). An H100 issues ~1e12 warp-instructions/s and streams ~3.35e12 B/s, so a
4.5-bit weight loop above ~0.15 cannot reach HBM speed. TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

MODELS = {  # name: (hidden, intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "tiny": (256, 256, 4, 2),
}
TOKENS = (1, 16, 512)


def gguf_layer_launches(model: str, T: int, gate_up: str, down: str, config: dict | None = None,
                        dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compile the two GGUF expert stages of one MoE layer at T tokens; one row per kernel."""
    from benchmarks.sass.report import _row, compile_only
    from moeflow.kernels.experts import gguf as gguf_experts
    from moeflow.kernels.experts.reference import routing_plan_reference
    from moeflow.kernels.formats import gguf_expert_format
    from moeflow.kernels.pool import ExpertPool

    H, I, E, k = MODELS[model]  # noqa: E741
    fmt = gguf_expert_format(gate_up.split("+"), down.split("+"), H, I, dtype)
    pool = ExpertPool(fmt, torch.empty((2, fmt.nbytes), dtype=torch.uint8))
    stages = gguf_experts.stage_configs(T, E, k, H, I, config)
    block_m = stages["BLOCK_M"]
    ids = (torch.arange(T * k, dtype=torch.int32) % E).reshape(T, k)
    sorted_ids, eob = routing_plan_reference(ids, E, block_m)[:2]
    slots = torch.zeros(E, dtype=torch.int32)
    x = torch.empty((T, H), dtype=dtype)
    h = torch.empty((T * k, I), dtype=dtype)
    out = torch.empty((T * k, H), dtype=dtype)
    up_off = fmt.spec("up").offset - fmt.spec("gate").offset
    with compile_only() as found:
        gguf_experts.gguf_gemm(0, x, pool.tensors["gate"], up_off, fmt.types_of("gate"), pool.tensors["types"], h,
                               sorted_ids, eob, slots, None, None, k, block_m, stages["w13"])
        gguf_experts.gguf_gemm(1, h, pool.tensors["down"], 0, fmt.types_of("down"), pool.tensors["types"], out,
                               sorted_ids, eob, slots, None, torch.empty(T * k), 1, block_m, stages["w2"])
    rows = []
    for c, (stage, K, t) in zip(found, (("w13", H, gate_up), ("w2", I, down)), strict=True):
        wcfg = {**stages[stage], "BLOCK_K": gguf_experts.block_k_for(K, stages[stage]["BLOCK_K"])}
        rows.append({**_row(c, model, T, stage, block_m, wcfg), "dtype": str(dtype).replace("torch.", ""),
                     "ggml_type": t})
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sass.report import emit_json_lines

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(MODELS))
    p.add_argument("--types", nargs=2, default=["Q4_K", "Q6_K"], metavar=("GATE_UP", "DOWN"),
                   help="a type each, or two joined by '+' (e.g. Q4_K Q4_K+Q6_K: both down types in one kernel)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--config", type=json.loads, default=None, help='e.g. \'{"w13": {"BLOCK_N": 128}}\'')
    p.add_argument("--out", type=Path, help="also write the lines to this file")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = [r for model in args.models for T in args.tokens
            for r in gguf_layer_launches(model, T, *args.types, args.config, dtype)]
    emit_json_lines(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
