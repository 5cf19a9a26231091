"""Block configurations of the Triton kernels: a JSON table in the repo, nearest-M lookup, heuristic defaults.

No autotuning happens at start-up. Tables live in ``moeflow/kernels/configs/*.json`` (format in
``docs/kernels.md``); ``benchmarks/run_gpu_kernels.py --tune`` writes one for the GPU it runs on.
Lookup order: (1) a table for this device name and this Triton ``major.minor``; (2) a table for this device
and another Triton version; (3) the heuristic :func:`default_config`. Inside a table the entry must match
the op, weight kind, dtype, group size and shape exactly; then the nearest M (in log distance) wins.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).with_name("configs")
ENV_CONFIG_DIR = "MOEFLOW_KERNEL_CONFIG_DIR"  # extra directory searched first (e.g. a freshly tuned table)

GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages")
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def device_name(device: torch.device | str) -> str:
    """The name tables are keyed by: ``torch.cuda.get_device_name`` on CUDA, ``"cpu"`` otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def triton_version() -> str:
    try:
        import triton
    except ImportError:  # pragma: no cover - triton is a dependency
        return "none"
    return ".".join(triton.__version__.split(".")[:2])


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def default_config(op: str, m: int, num_experts: int, top_k: int, n: int, k: int) -> dict[str, Any]:
    """Heuristic config when no table entry matches.

    op "moe": ``{"BLOCK_M": bm, "w13": {...}, "w2": {...}}`` for T = m tokens, N = intermediate, K = hidden.
    op "linear": one GEMM config with ``BLOCK_M`` for an [m, k] @ [k, n] matmul.
    Decode (few rows per expert) gets BLOCK_M < 16, i.e. the GEMV-shaped fp32 path, with split-K on the
    w2 GEMM when the grid would not fill a large GPU; prefill gets tensor-core tiles.
    """
    per_expert = m * top_k / max(1, num_experts) if op == "moe" else m
    if m <= 8 or per_expert <= 2:
        bm = min(_next_pow2(min(m, 4)), 4)
        # the fp32 product tile [BLOCK_M, BLOCK_K, BLOCK_N] lives in registers: keep it at <= 8K elements
        gemv = {"BLOCK_N": 32, "BLOCK_K": 256 // bm, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
        if op == "linear":
            return {"BLOCK_M": bm, **gemv, "SPLIT_K": 4 if n <= 8192 and k >= 4096 else 1}
        active = min(num_experts, m * top_k)
        programs_w2 = active * math.ceil(k / 32)
        split = 1
        while programs_w2 * split < 1024 and split < 8 and n // (split * 2) >= 512:
            split *= 2
        return {"BLOCK_M": bm, "w13": dict(gemv), "w2": {**gemv, "SPLIT_K": split}}
    if per_expert <= 32:
        bm, tile = 16, {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    elif per_expert <= 256:
        bm, tile = 64, {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    else:
        bm, tile = 128, {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
    if op == "linear":
        return {"BLOCK_M": bm, **tile}
    return {"BLOCK_M": bm, "w13": dict(tile), "w2": dict(tile)}


@functools.cache
def _load_tables(dirs: tuple[str, ...]) -> tuple[dict, ...]:
    tables = []
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            continue
        for f in sorted(p.glob("*.json")):
            with open(f) as fh:
                data = json.load(fh)
            validate_table(data, str(f))
            tables.append(data)
    return tuple(tables)


def validate_table(data: dict, where: str = "config table") -> None:
    """Raise ValueError when a table does not follow the documented format."""
    for key in ("format", "device", "triton", "entries"):
        if key not in data:
            raise ValueError(f"{where}: missing key {key!r}")
    if data["format"] != 1:
        raise ValueError(f"{where}: unsupported format {data['format']!r} (expected 1)")
    for i, e in enumerate(data["entries"]):
        for key in ("op", "kind", "dtype", "group_size", "num_experts", "top_k", "n", "k", "configs"):
            if key not in e:
                raise ValueError(f"{where}: entry {i} misses key {key!r}")
        for m, cfg in e["configs"].items():
            int(m)
            if "BLOCK_M" not in cfg:
                raise ValueError(f"{where}: entry {i} M={m} has no BLOCK_M")


def _search_dirs() -> tuple[str, ...]:
    extra = os.environ.get(ENV_CONFIG_DIR)
    return ((extra,) if extra else ()) + (str(CONFIG_DIR),)


def _nearest(configs: dict[str, dict], m: int) -> dict:
    lm = math.log2(max(1, m))
    key = min(configs, key=lambda s: (abs(math.log2(max(1, int(s))) - lm), int(s)))
    return configs[key]


def lookup_config(
    op: str,
    m: int,
    *,
    kind: str,
    dtype: torch.dtype,
    group_size: int,
    num_experts: int,
    top_k: int,
    n: int,
    k: int,
    device: torch.device | str,
) -> dict[str, Any]:
    """The block config for one launch (host-side, cached tables; never touches device memory)."""
    name, tv = device_name(device), triton_version()
    tables = _load_tables(_search_dirs())
    for same_version in (True, False):
        for t in tables:
            if t["device"] != name or (t["triton"] == tv) != same_version:
                continue
            for e in t["entries"]:
                if (
                    e["op"] == op and e["kind"] == kind and e["dtype"] == DTYPE_NAMES.get(dtype)
                    and int(e["group_size"]) == int(group_size) and int(e["num_experts"]) == num_experts
                    and int(e["top_k"]) == top_k and int(e["n"]) == n and int(e["k"]) == k
                ):
                    return _complete(op, _nearest(e["configs"], m), m, num_experts, top_k, n, k)
    return default_config(op, m, num_experts, top_k, n, k)


def _complete(op: str, cfg: dict, m: int, num_experts: int, top_k: int, n: int, k: int) -> dict:
    """Fill keys a table entry leaves out from the heuristic default (tables may store only what was tuned)."""
    base = default_config(op, m, num_experts, top_k, n, k)
    if op == "linear":
        return {**base, **cfg}
    return {
        "BLOCK_M": cfg["BLOCK_M"],
        "w13": {**base["w13"], **cfg.get("w13", {})},
        "w2": {**base["w2"], **cfg.get("w2", {})},
    }


def clear_cache() -> None:
    """Forget loaded tables (after writing a new one)."""
    _load_tables.cache_clear()
