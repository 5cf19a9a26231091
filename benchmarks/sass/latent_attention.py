"""Machine-code report of MLA's in-place decode attention kernels (moeflow.kernels.attention.latent),
compiled for sm_90 on any machine (no GPU).

    python -m benchmarks.sass.latent_attention              # the shipped shapes, one JSON object per line
    python -m benchmarks.sass.latent_attention --out benchmarks/results/sass/latent-attention.json

One decode layer's two launches (the split partials and the combine) per model shape, at ``--rows`` sequences over
``--keys`` keys (the grid; the binary depends only on the constexprs: heads, kv_lora_rank, rope, DSA's selection,
dtype), compiled with the installed Triton and its ptxas through :func:`sass.report.compile_only`: registers,
spilled bytes, shared memory, programs per SM, the grid, and the partial kernel's hot loop in warp-instructions per
latent byte: ``warp_instructions_per_latent_byte`` per byte a program streams, ``..._per_row_byte`` per byte of the
cache row (every head tile of the row counted: what HBM delivers once). An H100 issues ~1e12 warp-instructions/s
and streams ~3.35e12 B/s: above ~0.3 a row byte the loop cannot keep up with HBM. TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import torch

MODELS = {  # name: (heads, kv_lora_rank, qk_rope_head_dim, columns after them (DSA's indexer key), DSA selection)
    "deepseek-v3": (128, 512, 64, 0, False),
    "deepseek-v3.2": (128, 512, 64, 128, True),
    "kimi-k2": (64, 512, 64, 0, False),
    "glm-5": (64, 512, 64, 128, True),
    "glm-4.7-flash": (20, 512, 64, 0, False),
    "deepseek-v2-lite": (16, 512, 64, 0, False),
}


def latent_attention_launches(model: str, rows: int, keys: int, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compile one decode layer's launches (``rows`` sequences, ``keys`` keys read); one record per kernel."""
    from benchmarks.sass.report import _row, compile_only
    from moeflow.kernels.attention import latent as k
    from moeflow.kernels.triton_common import cdiv

    heads, rank, rope, extra, sparse = MODELS[model]
    query = torch.empty((rows, heads, 1, rank + rope), dtype=dtype)
    cache = torch.empty((rows, keys, rank + rope + extra), dtype=dtype)
    valid = torch.ones((rows, keys), dtype=torch.bool)
    pos = torch.zeros((rows, 1), dtype=torch.long)
    select = torch.ones((rows, keys), dtype=torch.bool) if sparse else None
    with compile_only() as found:
        k.latent_attention(query, cache, torch.arange(rows), valid, pos, keys, rank, rank ** -0.5, select)
    cfg = k.kernel_config(heads, rank, rope, dtype)
    tiles = cdiv(heads, cfg["BLOCK_H"])
    splits = k.default_splits(rows, tiles, keys, cfg["BLOCK_H"])
    grids = {"_partial_kernel": ("partial", tiles * splits * rows),
             "_combine_kernel": ("combine", rows * tiles * (cfg["BLOCK_H"] // k.COMBINE_H))}
    tile_bytes = cfg["BLOCK_N"] * (rank + rope) * torch.tensor([], dtype=dtype).element_size()  # one iteration's
    out = []
    for c in found:
        kernel, programs = grids[c.name]
        row = _row(c, model, 1, kernel, 0, cfg | {"SPLITS": splits})
        per_byte = per_row_byte = None
        if kernel == "partial" and c.loop_instructions:
            per_byte = round(c.loop_instructions * c.num_warps / tile_bytes, 4)
            per_row_byte = round(per_byte * tiles, 4)
        out.append({key: v for key, v in row.items() if key not in ("T", "BLOCK_M", "weights_per_iteration",
                                                                   "warp_instructions_per_weight", "mma_waits")}
                   | {"rows": rows, "keys": keys, "heads": heads, "head_tiles": tiles, "programs": programs,
                      "warp_instructions_per_latent_byte": per_byte, "warp_instructions_per_row_byte": per_row_byte,
                      "dsa": sparse, "dtype": str(dtype).replace("torch.", "")})
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sass.report import attention_main

    return attention_main(argv, __doc__.splitlines()[0], MODELS, latent_attention_launches)


if __name__ == "__main__":
    raise SystemExit(main())
