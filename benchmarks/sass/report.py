"""Machine-code report of the shipped kernel configs, compiled for a GPU target on any machine (no GPU needed).

    python -m benchmarks.sass.report                      # Mixtral-8x7B shapes, sm_90, one JSON object per line
    python -m benchmarks.sass.report --out benchmarks/results/sass/after.json --models mixtral-8x7b tiny

Every launch of the MoE layer (route + plan, w13, w2, combine) and of ``awq_linear`` is
compiled with the installed Triton and its ptxas for ``sm_<N>`` instead of being run; for each kernel and T
it prints registers, spilled bytes, shared memory, the hot loop (the largest backward branch of the SASS) and
``warp_instructions_per_weight``: loop instructions x warps / weights one iteration consumes. An H100 issues
~1e12 warp-instructions/s and streams ~3.35e12 B/s, so a 4-bit loop above ~0.15 cannot reach HBM speed.
``async_mma`` says whether the loop's tensor-core ops run asynchronously (a ``wgmma.wait_group`` with pending
groups > 0 in the PTX). TRITON_INTERPRET must be unset (the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODELS = {  # name: (hidden, intermediate, experts, top_k, group)
    "mixtral-8x7b": (4096, 14336, 8, 2, 128),
    "mixtral-8x22b": (6144, 16384, 8, 2, 128),
    "tiny": (128, 256, 8, 2, 32),
}
TOKENS = (1, 2, 4, 16, 64, 512, 4096)


@dataclass
class Compiled:
    """What one launch compiled to."""

    name: str
    num_warps: int = 0
    regs: int | None = None
    spill_bytes: int | None = None
    smem_bytes: int | None = None
    loop_instructions: int | None = None
    loop_ops: collections.Counter = field(default_factory=collections.Counter)
    mma_waits: list[int] = field(default_factory=list)
    atomics: list[str] = field(default_factory=list)  # the PTX atomics (the split-K fixup's arrival counter)
    error: str | None = None


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


CACHE_DIR = Path(os.environ.get("MOEFLOW_SASS_CACHE", Path(tempfile.gettempdir()) / "moeflow-sass-cache"))


def _read_cubin(cubin: bytes) -> tuple[int | None, int | None, int | None, collections.Counter]:
    """(registers, stack bytes, hot-loop instruction count, hot-loop opcode histogram) of one cubin.

    cuobjdump costs ~1 s a call on a busy machine: results are cached on disk by the cubin's hash."""
    cached = CACHE_DIR / (hashlib.sha256(cubin).hexdigest() + ".json")
    if cached.exists():
        regs, stack, n, ops = json.loads(cached.read_text())
        return regs, stack, n, collections.Counter(ops)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([_tool("cuobjdump"), "-res-usage", "-sass", f.name], capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(f.name)
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines()) if m]
    loop: list[str] = []
    for addr, instr in code:  # a branch to an earlier address closes a loop: keep the largest body
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", instr)
        if m and m.group(1) and int(m.group(1), 16) < addr:
            body = [t for a, t in code if int(m.group(1), 16) <= a <= addr]
            loop = body if len(body) > len(loop) else loop
    ops = collections.Counter(re.sub(r"^@!?U?P[T0-9]\s+", "", t).split()[0].split(".")[0] for t in loop)
    result = (int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None, len(loop) or None, ops)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps([*result[:3], dict(ops)]))
    return result


@contextlib.contextmanager
def compile_only(sm: int = 90):
    """Inside the block every Triton launch is compiled for ``sm_<sm>`` and recorded (a list of Compiled)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("benchmarks.sass.report: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class TargetOnly(DriverBase):  # a driver that only names the target: nothing is launched
        def __init__(self):
            pass

        @staticmethod
        def is_active():
            return True

        def get_current_target(self):
            return GPUTarget("cuda", sm, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_benchmarker(self):
            return None

    found: list[Compiled] = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        name = getattr(self.fn, "__name__", str(self))
        try:
            k = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # keep going: one failing config must not hide the others
            found.append(Compiled(name, error=repr(e)[:1000]))
            return None
        rec = Compiled(name, k.metadata.num_warps, smem_bytes=k.metadata.shared)
        if "cubin" in k.asm:
            rec.regs, rec.spill_bytes, rec.loop_instructions, rec.loop_ops = _read_cubin(k.asm["cubin"])
        rec.mma_waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", k.asm.get("ptx", ""))]
        rec.atomics = sorted(set(re.findall(r"\batom\.[\w.]+", k.asm.get("ptx", ""))))
        found.append(rec)
        return k

    previous = driver._active
    driver.set_active(TargetOnly())
    JITFunction.run = record
    try:
        yield found
    finally:
        JITFunction.run = run
        driver._active = previous


def _pool(hidden: int, inter: int, group: int, dtype: torch.dtype):
    from moeflow.kernels.formats import expert_format
    from moeflow.kernels.pool import ExpertPool

    fmt = expert_format(hidden, inter, "awq", dtype, group)
    return ExpertPool(fmt, torch.empty((1, fmt.nbytes), dtype=torch.uint8))


def moe_layer_launches(model: str, T: int, cfg: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compile the launches of one MoE layer (routing from logits) at T tokens; one record per kernel.
    ``cfg`` None: the heuristic default (what every GPU without a tuned table gets)."""
    from moeflow.kernels.experts import configs, ops

    H, I, E, k, g = MODELS[model]  # noqa: E741
    pool = _pool(H, I, g, dtype)
    if cfg is None:
        cfg = configs.default_config("moe", T, E, k, I, H, g)
    cfg = ops.decode_moe_config(ops.encode_moe_config(cfg))
    x = torch.empty((T, H), dtype=dtype)
    logits = torch.empty((T, E), dtype=dtype)
    slot = torch.zeros((E,), dtype=torch.int32)
    t = pool.tensors
    w13 = (t["w13_qweight"], t["w13_qzeros"], t["w13_scales"])
    w2 = (t["w2_qweight"], t["w2_qzeros"], t["w2_scales"])
    with compile_only() as found:
        plan = ops.plan_eager(torch.empty((T, k), dtype=torch.int32), E, cfg["BLOCK_M"], ops.fresh, logits=logits)
        pairs = torch.empty((T * k, H), dtype=dtype)
        partials = ops.experts_eager(x, plan, plan[1], w13, w2, slot, None, g, cfg, pairs, ops.fresh,
                                     defer_w2_reduce=True)
        ops.combine_eager(None if partials is not None else pairs, k, torch.empty((T, H), dtype=dtype), partials,
                          plan[1])
    names = {"_route_plan_kernel": "route_plan", "_combine_kernel": "combine"}
    gemms = iter(("w13", "w2"))
    rows = []
    for c in found:
        kernel = next(gemms) if c.name == "_expert_gemm_kernel" else names.get(c.name, c.name)
        wcfg = cfg.get(kernel, {}) if kernel in ("w13", "w2") else {}
        rows.append(_row(c, model, T, kernel, cfg["BLOCK_M"], wcfg))
    return rows


def awq_linear_launches(n: int, k: int, T: int, group: int = 128, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compile ``awq_linear`` (published AWQ layout) for [T, k] @ [k, n]."""
    from moeflow.kernels.experts import configs, ops
    from moeflow.kernels.formats.plain_layout import awq_panel

    cfg = configs.default_config("linear", T, 1, 1, n, k, group)
    x = torch.empty((T, k), dtype=dtype)
    q = torch.empty((k, n // 8), dtype=torch.int32)
    z = torch.empty((k // group, n // 8), dtype=torch.int32)
    s = torch.empty((k // group, n), dtype=dtype)
    with compile_only() as found:
        ops.linear_eager(x, q, z, s, group, cfg)
    wcfg = {**cfg, "BLOCK_K": min(cfg["BLOCK_K"], group)}
    rows = [_row(c, f"linear-{k}x{n}", T, "awq_linear", cfg["BLOCK_M"], wcfg) for c in found]
    pcfg = configs.packed_linear_config(T, n, k, group)
    with compile_only() as found:  # the same matrix packed for the expert kernel (kernels.pack_awq_linear)
        qw = torch.empty((k // awq_panel(group), n, awq_panel(group) // 8), dtype=torch.int32)
        ops.linear_packed_eager(x, qw, z, s, group, pcfg, ops.fresh)
    return rows + [_row(c, f"linear-{k}x{n}", T, "awq_linear_packed" if "gemm" in c.name else c.name.strip("_"),
                        pcfg["BLOCK_M"], pcfg) for c in found]


# sm_90 (H100) per-SM limits: 64 K registers allocated per warp in units of 256, 64 warps, 32 programs, 228 KB of
# shared memory of which each program also reserves 1 KB
SM90_REGS, SM90_WARPS, SM90_PROGRAMS, SM90_SMEM, SMEM_RESERVED = 65536, 64, 32, 233472, 1024


def programs_per_sm(regs: int | None, smem_bytes: int | None, num_warps: int) -> int | None:
    """How many programs of this build an sm_90 SM holds at once (the occupancy the grid's waves are made of).
    On the first H100 run the profiler's registers and shared memory per program matched this report's exactly."""
    if regs is None or not num_warps:
        return None
    per_warp = -(-regs * 32 // 256) * 256
    by_smem = SM90_SMEM // ((smem_bytes or 0) + SMEM_RESERVED)
    return min(SM90_REGS // (per_warp * num_warps), by_smem, SM90_WARPS // num_warps, SM90_PROGRAMS)


def _row(c: Compiled, model: str, T: int, kernel: str, block_m: int, wcfg: dict) -> dict:
    weights = wcfg.get("BLOCK_N", 0) * wcfg.get("BLOCK_K", 0)
    per_weight = None
    if c.loop_instructions and weights:
        per_weight = round(c.loop_instructions * c.num_warps / weights, 4)
    return {
        "kernel": kernel, "model": model, "T": T, "BLOCK_M": block_m,
        "config": {key: wcfg[key] for key in sorted(wcfg) if key != "BLOCK_M"},
        "regs": c.regs, "spill_bytes": c.spill_bytes, "smem_bytes": c.smem_bytes, "num_warps": c.num_warps,
        "programs_per_sm": programs_per_sm(c.regs, c.smem_bytes, c.num_warps),
        "loop_instructions": c.loop_instructions, "weights_per_iteration": weights or None,
        "warp_instructions_per_weight": per_weight,
        "async_mma": any(n > 0 for n in c.mma_waits), "mma_waits": c.mma_waits, "atomics": c.atomics,
        "top_ops": dict(c.loop_ops.most_common(40)), "error": c.error,
    }


def shipped_table_configs() -> list[tuple[str, int, dict, torch.dtype]]:
    """(model, T, config, dtype) of every table entry shipped in moeflow/kernels/experts/configs/ for a known model."""
    from moeflow.kernels.experts import configs

    dtypes = {name: dt for dt, name in configs.DTYPE_NAMES.items()}
    out, seen = [], set()
    for f in sorted(configs.CONFIG_DIR.glob("*.json")):
        table = json.loads(f.read_text())
        for e in table["entries"]:
            if e["op"] != "moe" or e["kind"] != "awq":
                continue
            for model, (H, I, E, k, g) in MODELS.items():  # noqa: E741
                if (e["n"], e["k"], e["num_experts"], e["top_k"], e["group_size"]) != (I, H, E, k, g):
                    continue
                for m, c in e["configs"].items():
                    key = (model, int(m), json.dumps(c, sort_keys=True), e["dtype"])
                    if key not in seen:
                        seen.add(key)
                        out.append((model, int(m), c, dtypes[e["dtype"]]))
    return out


def emit_json_lines(rows: list[dict], out: Path | None) -> None:
    """Print one JSON object per row (with the Triton version and the target), and write them to ``out`` too."""
    import triton

    lines = [json.dumps({**r, "triton": triton.__version__, "sm": 90}) for r in rows]
    print("\n".join(lines))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")


def attention_main(argv: list[str] | None, description: str, models: dict, launches) -> int:
    """The command line of the decode attention kernels' reports (sass/slot_attention.py, sass/latent_attention.py):
    ``launches(model, rows, keys, dtype)`` -> rows, one JSON line each."""
    import torch

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", nargs="+", default=sorted(models), choices=sorted(models))
    p.add_argument("--rows", type=int, default=16, help="decode batch rows (the grid; the binary is the same)")
    p.add_argument("--keys", type=int, default=4096, help="keys read (the view's key_len)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", type=Path, help="also write the lines to this file")
    args = p.parse_args(argv)
    emit_json_lines([r for model in args.models for r in launches(model, args.rows, args.keys,
                                                                   getattr(torch, args.dtype))], args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mixtral-8x7b"], choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--no-tables", action="store_true", help="skip the shipped table entries")
    p.add_argument("--no-linear", action="store_true", help="skip awq_linear")
    p.add_argument("--out", type=Path, help="also write the lines to this file")
    args = p.parse_args(argv)
    rows: list[dict] = []
    for model in args.models:
        for T in args.tokens:
            rows += [{**r, "source": "default"} for r in moe_layer_launches(model, T)]
    if not args.no_tables:
        for model, T, cfg, dtype in shipped_table_configs():
            rows += [{**r, "source": "table", "dtype": str(dtype).replace("torch.", "")}
                     for r in moe_layer_launches(model, T, cfg, dtype)]
    if not args.no_linear:
        for T in (1, 16, 4096):
            rows += [{**r, "source": "default"} for r in awq_linear_launches(4096, 4096, T)]
    emit_json_lines(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
