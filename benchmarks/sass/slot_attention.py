"""Machine-code report of the slot decode attention kernels (moeflow.kernels.attention.slot), compiled for
sm_90 on any machine (no GPU).

    python -m benchmarks.sass.slot_attention              # the shipped shapes, one JSON object per line
    python -m benchmarks.sass.slot_attention --out benchmarks/results/sass/slot-attention.json

One decode layer's two launches (the split partials and the combine) per model shape, at ``--rows`` sequences over
``--keys`` keys (the grid; the binary depends only on the constexprs: GQA group, head dim, window, sinks, dtype),
compiled with the installed Triton and its ptxas through :func:`sass.report.compile_only`: registers, spilled
bytes, shared memory, programs per SM, the grid, and the partial kernel's hot loop in warp-instructions per byte
of K and V it streams (an H100 issues ~1e12 warp-instructions/s and streams ~3.35e12 B/s: above ~0.3 the loop
cannot keep up with HBM). TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import torch

MODELS = {  # name: (query heads, kv heads, head dim, sliding window, sinks)
    "mixtral-8x7b": (32, 8, 128, None, False),
    "qwen3-30b-a3b": (32, 4, 128, None, False),
    "gpt-oss-120b": (64, 8, 64, None, True),
    "gpt-oss-120b-sliding": (64, 8, 64, 128, True),
    "olmoe-d64": (16, 16, 64, None, False),
}


def slot_attention_launches(model: str, rows: int, keys: int, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compile one decode layer's launches (``rows`` sequences, ``keys`` keys read); one record per kernel."""
    from benchmarks.sass.report import _row, compile_only
    from moeflow.kernels.attention import slot as k

    heads, kv_heads, d, window, sinks = MODELS[model]
    q = torch.empty((rows, heads, 1, d), dtype=dtype)
    cache = torch.empty((rows, kv_heads, keys, d), dtype=dtype)
    valid = torch.ones((rows, keys), dtype=torch.bool)
    pos = torch.zeros((rows, 1), dtype=torch.long)
    sink = torch.empty((heads,), dtype=dtype) if sinks else None
    with compile_only() as found:
        k.slot_attention(q, cache, cache, torch.arange(rows), valid, pos, keys, window, sink)
    cfg = k.kernel_config(d, heads, kv_heads)
    splits = k.default_splits(rows, kv_heads, keys, d)
    grids = {"_partial_kernel": ("partial", rows * kv_heads * splits), "_combine_kernel": ("combine", rows * kv_heads)}
    kv_bytes = 2 * cfg["BLOCK_N"] * d * torch.tensor([], dtype=dtype).element_size()  # K and V of one iteration
    out = []
    for c in found:
        kernel, programs = grids[c.name]
        row = _row(c, model, 1, kernel, 0, cfg | {"SPLITS": splits})
        per_byte = None
        if kernel == "partial" and c.loop_instructions:
            per_byte = round(c.loop_instructions * c.num_warps / kv_bytes, 4)
        out.append({key: v for key, v in row.items() if key not in ("T", "BLOCK_M", "weights_per_iteration",
                                                                   "warp_instructions_per_weight", "mma_waits")}
                   | {"rows": rows, "keys": keys, "programs": programs, "warp_instructions_per_kv_byte": per_byte,
                      "window": window, "sinks": sinks, "dtype": str(dtype).replace("torch.", "")})
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sass.report import attention_main

    return attention_main(argv, __doc__.splitlines()[0], MODELS, slot_attention_launches)


if __name__ == "__main__":
    raise SystemExit(main())
