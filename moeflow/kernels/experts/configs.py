"""Block configurations of the Triton kernels: a JSON table in the repo, nearest-M lookup, heuristic defaults.

No autotuning happens at start-up. Tables live in ``moeflow/kernels/experts/configs/*.json`` (format in
``docs/kernels.md``); ``benchmarks/run_gpu_kernels.py --tune`` writes one for the GPU it runs on.
Lookup order: (1) a table for this device name and this Triton ``major.minor``; (2) a table for this device
and another Triton version; (3) the heuristic :func:`default_config`. Inside a table the entry must match
the op, weight kind, dtype, group size and shape exactly; then the nearest M (in log distance) wins.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).with_name("configs")
ENV_CONFIG_DIR = "MOEFLOW_KERNEL_CONFIG_DIR"  # extra directory searched first (e.g. a freshly tuned table)

GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages", "SCALE_IN_A")
# the one source of default values: what a table entry or a hand-written config leaves out
GEMM_DEFAULTS = {"BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3,
                 "SCALE_IN_A": 0}
DECODE_MAX_M = 16  # up to this many tokens every expert's rows fit one block (BLOCK_M = next power of two >= T)
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def device_name(device: torch.device | str) -> str:
    """The name tables are keyed by: ``torch.cuda.get_device_name`` on CUDA, ``"cpu"`` otherwise."""
    return _device_name(str(device))


@functools.lru_cache(maxsize=64)
def _device_name(device: str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.cache
def triton_version() -> str:
    try:
        import triton
    except ImportError:  # pragma: no cover - triton is a dependency
        return "none"
    return ".".join(triton.__version__.split(".")[:2])


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _split_k(active: int, n: int, k: int, block_n: int, block_k: int) -> int:
    """Split K until the grid has ~2 programs per SM of a large GPU, keeping >= 2 K tiles per split."""
    programs = active * -(-n // block_n)
    split = 1
    while programs * split < 256 and k // (2 * split) >= 2 * block_k and split < 8:
        split *= 2
    return split


# w13's decode split comes from wave arithmetic: an H100 has 132 SMs and holds DECODE_PROGRAMS_PER_SM programs of
# the decode tile (128 x 128, 4 warps: benchmarks/sass_report.py's programs_per_sm, also with the split-K fixup)
SMS = 132
DECODE_PROGRAMS_PER_SM = 3
WAVE_FILL = 0.85  # the last wave must be at least this full (averaged over all waves)


def wave_efficiency(programs: int, programs_per_sm: int = DECODE_PROGRAMS_PER_SM, sms: int = SMS) -> float:
    """waves / ceil(waves): the fraction of the GPU's program slots a grid of ``programs`` keeps busy."""
    waves = programs / (programs_per_sm * sms)
    return waves / max(1, -(-programs // (programs_per_sm * sms)))


def key_splits(pairs: int, programs_per_sm: int, most: int) -> int:
    """Programs per (sequence, head group) along a decode attention kernel's key axis, 1..``most``: the fewest
    whose grid (``pairs`` x split) fills at least one wave to ``WAVE_FILL`` (its waves as full), else the fullest.
    Shapes only: the same grid on every replay."""
    best, best_eff = 1, 0.0
    for split in range(1, max(1, most) + 1):
        eff = wave_efficiency(pairs * split, programs_per_sm)
        if eff >= WAVE_FILL and pairs * split >= WAVE_FILL * programs_per_sm * SMS:
            return split
        if eff > best_eff:
            best, best_eff = split, eff
    return best


def wave_split(programs: int, k: int, block_k: int, programs_per_sm: int = DECODE_PROGRAMS_PER_SM) -> int:
    """A decode SPLIT_K of the expert GEMMs whose in-kernel fixup reduces (one launch at every split: AWQ w13,
    the biased AWQ stages, both MXFP4 stages). Rule: the smallest split of 1, 2, 4, 8 whose grid (``programs`` x
    split) fills its waves of ``programs_per_sm`` x ``SMS`` to >= ``WAVE_FILL`` (else the fullest), with
    >= 2 K tiles per split. Splitting keeps the warp-instructions per weight (the same loop), so only the waves
    change: Mixtral-8x7B T = 1 has 448 programs at 3 per SM, 1.13 waves (57 %): split 4 makes 4.53 (91 %);
    T = 2: split 2 (2.26 -> 4.53 waves); T >= 4: 1792 programs, 4.53 waves already: split 1."""
    best, best_eff = 1, wave_efficiency(programs, programs_per_sm)
    for split in (1, 2, 4, 8):
        if split > 1 and k // split < 2 * block_k:
            break
        eff = wave_efficiency(programs * split, programs_per_sm)
        if eff >= WAVE_FILL:
            return split
        if eff > best_eff:
            best, best_eff = split, eff
    return best


def block_k_for(K: int, block_k: int, smallest: int = 32) -> int:
    """The largest power of two in [``smallest``, ``block_k``] dividing K (K is a multiple of ``smallest``): the k per
    iteration of the block-quantized kernels (MXFP4, GGUF), whose blocks are 32 values."""
    bk = max(smallest, block_k)
    while K % bk:
        bk //= 2
    return bk


STAGE_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")  # a block-quantized stage's keys


def encode_stage_configs(config: dict | None) -> list[int]:
    """``{"BLOCK_M"?, "w13"?: {...}, "w2"?: {...}}`` of the block-quantized kernels -> the flat int list their custom
    ops take (``[]`` for None; a missing key is -1 / 0, left to the defaults): inverse of
    :func:`decode_stage_configs`."""
    if config is None:
        return []
    return [int(config.get("BLOCK_M", 0))] + [int(config.get(stage, {}).get(key, -1))
                                                for stage in ("w13", "w2") for key in STAGE_KEYS]


def decode_stage_configs(flat: list[int]) -> dict | None:
    """Inverse of :func:`encode_stage_configs` (None for ``[]``), the missing keys left out."""
    if not flat:
        return None
    n = len(STAGE_KEYS)
    stages = {name: {k: v for k, v in zip(STAGE_KEYS, flat[1 + i * n: 1 + (i + 1) * n], strict=True) if v >= 0}
              for i, name in enumerate(("w13", "w2"))}
    return {**({"BLOCK_M": flat[0]} if flat[0] > 0 else {}), **stages}


def layer_stage_configs(tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, block_m: int,
                        defaults: dict, programs_per_sm: int, config: dict) -> dict:
    """``{"BLOCK_M", "w13", "w2"}`` of one MoE layer of the block-quantized kernels (MXFP4, GGUF), whose w13 tile
    of ``BLOCK_N`` weight rows holds ``BLOCK_N / 2`` gate/up outputs: each stage's ``config`` over ``defaults``; at
    decode (T <= ``DECODE_MAX_M``) a stage without ``SPLIT_K`` gets :func:`wave_split`'s over ``min(E, T k)`` plan
    blocks at ``programs_per_sm``."""
    out: dict = {"BLOCK_M": block_m}
    active = min(num_experts, tokens * top_k)
    for name, n_out, K in (("w13", inter, hidden), ("w2", hidden, inter)):
        cfg = {**defaults, **config.get(name, {})}
        if "SPLIT_K" not in cfg:
            bn = int(cfg["BLOCK_N"])
            tiles = -(-n_out // (bn // 2 if name == "w13" else bn))
            cfg["SPLIT_K"] = (wave_split(active * tiles, K, block_k_for(K, int(cfg["BLOCK_K"])), programs_per_sm)
                              if tokens <= DECODE_MAX_M else 1)
        out[name] = cfg
    return out


def default_config(
    op: str, m: int, num_experts: int, top_k: int, n: int, k: int, group_size: int = 128
) -> dict[str, Any]:
    """Heuristic config when no table entry matches (the values every missing key gets: ``GEMM_DEFAULTS``).

    op "moe": ``{"BLOCK_M": bm, "w13": {...}, "w2": {...}}`` for T = m tokens, N = intermediate, K = hidden;
    op "linear": one GEMM config with ``BLOCK_M`` for an [m, k] @ [k, n] matmul (the published-AWQ kernel).
    Up to ``DECODE_MAX_M`` tokens, BLOCK_M is the next power of two >= T, so an expert shared by several
    tokens is streamed once; prefill gets 64/128-row tiles with the scale folded into the MMA operand
    (asynchronous tensor cores). ``BLOCK_K`` never exceeds the AWQ group (``group_size`` 0: dense).
    """
    bk_cap = group_size if group_size else 128
    if op == "linear":  # the published-AWQ kernel: GEMV-shaped below 16 rows, tensor-core tiles above
        if m < 16:
            return {"BLOCK_M": _next_pow2(m), **GEMM_DEFAULTS, "BLOCK_N": 32, "BLOCK_K": min(128, bk_cap)}
        bm = 16 if m <= 32 else 64 if m <= 256 else 128
        return {"BLOCK_M": bm, **GEMM_DEFAULTS, "BLOCK_N": 64 if bm < 128 else 128, "BLOCK_K": min(64, bk_cap),
                "GROUP_M": 8, "num_warps": 4 if bm < 128 else 8}
    per_expert = m * top_k / max(1, num_experts)
    if m <= DECODE_MAX_M or per_expert <= 16:
        bm = min(_next_pow2(m), DECODE_MAX_M)
        tile = {**GEMM_DEFAULTS, "BLOCK_K": min(128, bk_cap)}
    elif per_expert <= 96:
        bm, tile = 64, {**GEMM_DEFAULTS, "BLOCK_K": min(64, bk_cap), "GROUP_M": 8, "SCALE_IN_A": 1}
    else:
        bm = 128
        tile = {**GEMM_DEFAULTS, "BLOCK_K": min(64, bk_cap), "GROUP_M": 8, "num_warps": 8, "SCALE_IN_A": 1}
    active = min(num_experts, m * top_k)
    w13 = {**tile, "SPLIT_K": wave_split(active * -(-2 * n // tile["BLOCK_N"]), k, tile["BLOCK_K"]) if bm <= 16
           else 1}
    # w2 (N = hidden, K = intermediate) by the same wave rule; its partials are summed in the combine (no launch):
    # Mixtral-8x7B T >= 4 has 256 programs, 0.65 of a wave at 3 per SM, unsplit: split 4 makes 2.59 (86 %)
    w2 = {**tile, "SPLIT_K": wave_split(active * -(-k // tile["BLOCK_N"]), n, tile["BLOCK_K"]) if bm <= 16 else 1}
    return {"BLOCK_M": bm, "w13": w13, "w2": w2}


@functools.lru_cache(maxsize=4096)
def packed_linear_config(m: int, n: int, k: int, group_size: int) -> dict[str, Any]:
    """Config of ``awq_linear_packed`` (the expert GEMM with one "expert"): the MoE rules for one matrix.
    Cached per shape (a host-side hot path); the returned dict is shared: do not modify it."""
    moe = default_config("moe", m, 1, 1, n, k, group_size)
    return {"BLOCK_M": moe["BLOCK_M"], **moe["w2"], "SPLIT_K": _split_k(1, n, k, moe["w2"]["BLOCK_N"],
                                                                       moe["w2"]["BLOCK_K"]) if m <= 16 else 1}


# decode (w13, w2) splits --tune times: w2's deeper splits with w13 whole, then w13's 2 / 4 / 8 (the fixup: still
# one launch) with the w2 splits around the default
SPLIT_PAIRS = ((1, 1), (1, 4), (1, 8), (1, 16), (2, 4), (4, 4), (8, 4), (2, 8), (4, 8), (8, 8))


def tuning_candidates(phase: str, group_size: int) -> list[dict]:
    """Configs ``benchmarks/run_gpu_kernels.py --tune`` times: ``phase`` "decode" or "prefill"; any candidate
    with BLOCK_K above the AWQ group is dropped (it would need a per-row zero/scale gather)."""
    if phase == "decode":
        # the first H100 run: the default tile (BLOCK_N 128, 4 warps) holds 3 programs per SM, so w13's 448
        # programs at T = 1 make 1.13 waves; 8 warps (2 per SM), narrower tiles (5-7 per SM) and deeper w2 splits
        # fill the waves differently (benchmarks/results/h100-2026-11-23/README.md): time them all
        cands = [
            {"BLOCK_M": bm, "w13": {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s13, "num_warps": nw, "num_stages": 3},
             "w2": {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s2, "num_warps": nw, "num_stages": 3}}
            for bm in (1, 2, 4, 8, 16) for bn, bk in ((128, 128), (64, 128), (32, 128), (128, 64), (256, 64), (128, 32))
            for nw in (4, 8) for s13, s2 in SPLIT_PAIRS
        ]
        # software pipelining depth of the default tile (sm_90 machine code, benchmarks/results/sass/README.md):
        # 1 stage loads straight to registers (0.12 warp-instructions per weight at 4 warps, 2 barriers per
        # iteration instead of 12 at 8 warps) but keeps fewer bytes in flight; 2 / 4 stages trade shared memory
        # for depth. Only a GPU can say which hides HBM latency best (first, so a cut-short sweep still times them)
        cands = [
            {"BLOCK_M": bm, "w13": {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": s13, "num_warps": nw, "num_stages": st},
             "w2": {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": s2, "num_warps": nw, "num_stages": st}}
            for bm in (1, 2, 4, 8, 16) for nw in (4, 8) for st in (1, 2, 4) for s13, s2 in ((1, 4), (4, 4), (1, 8))
        ] + cands
    else:
        cands = [
            {"BLOCK_M": bm, **{w: {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": nw, "num_stages": st,
                                   "SCALE_IN_A": 1} for w in ("w13", "w2")}}
            for bm, bn, bk, nw, st in ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 2),
                                       (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 128, 4, 3),
                                       (128, 128, 32, 8, 4), (64, 128, 32, 4, 4))
        ]
    return [c for c in cands if all(c[w]["BLOCK_K"] <= group_size for w in ("w13", "w2"))]


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
    """The entry of the smallest tuned M >= m (else the largest): a config tuned for fewer tokens could split
    an expert's rows over two blocks and stream its weights twice (T = 2 must never get BLOCK_M 1)."""
    keys = sorted(int(s) for s in configs)
    key = next((km for km in keys if km >= m), keys[-1])
    cfg = dict(configs[str(key)])
    if m <= DECODE_MAX_M:
        cfg["BLOCK_M"] = max(int(cfg["BLOCK_M"]), _next_pow2(m))
    return cfg


def bucket(m: int) -> int:
    """The shape bucket of T: configs are resolved once per bucket (next power of two)."""
    return _next_pow2(max(1, m))


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
    """The block config for one launch: resolved once per (op, T bucket, shapes, dtype, device) and cached.

    Host-side only (never touches device memory). The returned dict is shared: do not modify it.
    """
    return _lookup(op, bucket(m), kind, DTYPE_NAMES.get(dtype), int(group_size), num_experts, top_k, n, k,
                   device_name(device), triton_version(), _search_dirs())


@functools.lru_cache(maxsize=4096)
def _lookup(op: str, m: int, kind: str, dtype: str | None, group_size: int, num_experts: int, top_k: int, n: int,
            k: int, name: str, tv: str, dirs: tuple[str, ...]) -> dict[str, Any]:
    tables = _load_tables(dirs)
    for same_version in (True, False):
        for t in tables:
            if t["device"] != name or (t["triton"] == tv) != same_version:
                continue
            for e in t["entries"]:
                if (
                    e["op"] == op and e["kind"] == kind and e["dtype"] == dtype
                    and int(e["group_size"]) == group_size and int(e["num_experts"]) == num_experts
                    and int(e["top_k"]) == top_k and int(e["n"]) == n and int(e["k"]) == k
                ):
                    return _complete(op, _nearest(e["configs"], m), m, num_experts, top_k, n, k, group_size)
    return default_config(op, m, num_experts, top_k, n, k, group_size)


def _complete(op: str, cfg: dict, m: int, num_experts: int, top_k: int, n: int, k: int, group_size: int) -> dict:
    """Fill keys a table entry leaves out from ``GEMM_DEFAULTS`` (tables may store only what was tuned)."""
    if op == "linear":
        return {**GEMM_DEFAULTS, **cfg}
    return {
        "BLOCK_M": cfg["BLOCK_M"],
        "w13": {**GEMM_DEFAULTS, **cfg.get("w13", {})},
        "w2": {**GEMM_DEFAULTS, **cfg.get("w2", {})},
    }


def clear_cache() -> None:
    """Forget loaded tables and resolved configs (after writing a new table)."""
    _load_tables.cache_clear()
    _lookup.cache_clear()
