"""One script for all kernel benchmarks on a GPU (< 8 minutes on an H100/H200); writes JSON + a Markdown table.

    python -m benchmarks.gpu.kernels                       # Mixtral-8x7B and 8x22B, T = 1..4096
    python -m benchmarks.gpu.kernels --tune                # also sweep block configs, write a config table
    python -m benchmarks.gpu.kernels --dry-run             # tiny shapes on whatever device (CPU: torch only)

For every (model shape, T): the Triton MoE forward (route/plan + w13 + w2 + combine), timed eagerly and under
CUDA-graph replay (the figure reported: the launch overhead a decode step really pays); achieved bytes/s against
the measured device-copy bandwidth (% of HBM), TFLOP/s against a bf16 cuBLAS matmul of the same FLOPs (the
T = 4096 target), and the speed ratio to (a) a per-expert loop of bf16 torch matmuls, (b) dequantize-then-matmul
and (c) at T = 1, torch's own ``_weight_int4pack_mm`` on the same expert. ``--tune`` times the candidates of
``moeflow.kernels.experts.configs.tuning_candidates`` (no BLOCK_K above the group) under CUDA-graph replay. Raw times
(seconds, every repetition) are kept in the JSON. Nothing here asserts on time.

Layouts (T <= 64, unless ``--no-layouts``): the same forward with the experts' qweights in the pool's former
row-major layout (``[N, K/8]``, one K iteration reading BLOCK_N runs of 64 bytes 2-7 KiB apart), read by the
same kernel through strides (``pool.row_major_pool``), against today's panel-major layout (one contiguous
range per iteration): ``panel_speedup`` = row-major time / panel time, outputs bitwise equal
(``layouts_equal``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu.timing import (
    copy_bandwidth,
    cublas_peak,
    cuda_graph_fn,
    finish_point_args,
    median,
    point_inputs,
    point_parser,
    random_routing,
    time_fn,
    time_ours,
)
from moeflow import kernels
from moeflow.kernels.experts import configs as kcfg
from moeflow.kernels.experts.reference import dequantize_kernel_layout
from moeflow.kernels.formats import expert_format
from moeflow.kernels.pool import ExpertPool, row_major_pool

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {  # name: (hidden, intermediate, experts, top_k)
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "mixtral-8x22b": (6144, 16384, 8, 2),
    "tiny": (128, 256, 8, 2),
}
TOKENS = (1, 2, 4, 8, 16, 64, 512, 4096)  # issue 12
GROUP = 128
LAYOUT_MAX_T = 64  # the memory-bound range where the weights' layout decides the speed

# ---------------------------------------------------------------------------------------------------------
# builders


def random_awq_pool(hidden: int, inter: int, n_experts: int, dtype: torch.dtype, device: str, seed: int = 0):
    """A pool of random AWQ experts (random nibbles and zero points, small positive scales)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fmt = expert_format(hidden, inter, "awq", dtype, GROUP)
    pool = ExpertPool.allocate(fmt, n_experts, device)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, device=device, generator=gen))
    for name in ("w13_scales", "w2_scales"):
        t = pool.tensors[name]
        t.copy_((torch.rand(t.shape, device=device, generator=gen) * 2e-3 + 1e-3).to(dtype))
    return pool


def per_expert_loop(x, ids, w, w13_list, w2_list, inter):
    """Baseline (a): HF-style loop over experts with bf16/fp16 torch matmuls (dense weights [H, 2I], [I, H])."""
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    k = ids.shape[1]
    for e in range(len(w13_list)):
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        if pairs.numel() == 0:
            continue
        tok = pairs // k
        h = x[tok] @ w13_list[e]
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = (a @ w2_list[e]) * w.reshape(-1)[pairs, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def dequant_then_matmul(x, ids, w, pool: ExpertPool, inter):
    """Baseline (b): dequantize each used expert's weights (pool layout) to x's dtype, then torch matmuls."""
    t = pool.tensors
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    k = ids.shape[1]
    for e in range(pool.n_slots):
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        if pairs.numel() == 0:
            continue
        tok = pairs // k
        w13 = dequantize_kernel_layout(t["w13_qweight"][e], t["w13_qzeros"][e], t["w13_scales"][e], GROUP).to(x.dtype)
        w2 = dequantize_kernel_layout(t["w2_qweight"][e], t["w2_qzeros"][e], t["w2_scales"][e], GROUP).to(x.dtype)
        h = x[tok] @ w13.T  # columns interleaved: gate 2j, up 2j + 1
        a = F.silu(h[:, 0::2]) * h[:, 1::2]
        out.index_add_(0, tok, (a @ w2.T) * w.reshape(-1)[pairs, None].to(x.dtype))
    return out


def int4pack_expert(pool: ExpertPool, slot: int, inter: int):
    """Baseline (c): one expert in torch's own CUDA int4 format; returns fn(x [T, H]) -> [T, H] (bf16).

    torch stores ``W = (q - 8) * s + zero`` with a float zero, so zero = (8 - z) * s (exact up to bf16)."""
    t = pool.tensors

    def convert(prefix):
        qw, qz, sc = t[f"{prefix}_qweight"][slot], t[f"{prefix}_qzeros"][slot], t[f"{prefix}_scales"][slot]
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qw.device)
        q = ((qw.unsqueeze(-1) >> shifts) & 0xF).reshape(qw.shape[0], -1)  # [N, K]
        z = ((qz.unsqueeze(-1) >> shifts) & 0xF).reshape(qz.shape[0], -1).float()  # [K/g, N]
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        w4 = torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), 8)
        s = sc.float()
        sz = torch.stack([s, (8 - z) * s], dim=-1).to(torch.bfloat16).contiguous()  # [K/g, N, 2]
        return w4, sz

    w13, sz13 = convert("w13")
    w2, sz2 = convert("w2")

    def fn(x):
        h = torch.ops.aten._weight_int4pack_mm(x, w13, GROUP, sz13)
        a = F.silu(h[:, 0::2]) * h[:, 1::2]
        return torch.ops.aten._weight_int4pack_mm(a.contiguous(), w2, GROUP, sz2)

    return fn


def layout_point(res: dict, ours, x, ids, w, pool: ExpertPool, slot, backend: str, dev: str, reps: int,
                 cache: dict, key) -> None:
    """Time the same forward on the row-major qweights (see the module doc); adds the keys to ``res``."""
    if ("rows", key) not in cache:
        cache[("rows", key)] = row_major_pool(pool)
    rows = cache[("rows", key)]

    def theirs():
        return kernels.moe_forward(x, ids, w, rows, slot, backend, validate=False)

    res["layouts_equal"] = bool(torch.equal(ours(), theirs()))
    timed = time_ours(theirs, dev, reps)
    res["row_major_times_s"] = timed.get("ours_graph_times_s") or timed["ours_times_s"]
    res["row_major_s"] = timed["ours_s"]
    res["panel_speedup"] = timed["ours_s"] / res["ours_s"]


def bench_point(name: str, T: int, args, dense_cache: dict, copy_bw: float, cublas_cache: dict) -> dict:
    H, I, E, k = SHAPES[name]  # noqa: E741
    dev, dtype = args.device, args.dtype
    pool, slot, ids, w, x, backend, reps = point_inputs(SHAPES[name], name, T, args, dense_cache, random_awq_pool)
    cfg = kcfg.lookup_config("moe", T, kind="awq", dtype=dtype, group_size=GROUP, num_experts=E, top_k=k, n=I, k=H,
                             device=dev)

    def ours():
        return kernels.moe_forward(x, ids, w, pool, slot, backend, validate=False)

    res: dict = {"shape": name, "T": T, "hidden": H, "intermediate": I, "experts": E, "top_k": k, "backend": backend,
                 "config": cfg}
    used = int(torch.unique(ids).numel())
    weight_bytes = used * pool.fmt.nbytes
    act = torch.finfo(dtype).bits // 8
    act_bytes = act * (T * H + 2 * T * k * I + 2 * T * k * H + T * H)
    flops = 2 * T * k * (H * 2 * I + I * H)
    res.update({"experts_used": used, "weight_bytes": weight_bytes, "total_bytes": weight_bytes + act_bytes,
                "flops": flops})
    res.update(time_ours(ours, dev, reps))
    t_ours = res["ours_s"]
    res["bytes_per_s"] = res["total_bytes"] / t_ours
    res["frac_of_copy_bw"] = res["bytes_per_s"] / copy_bw
    res["tflops"] = flops / t_ours / 1e12
    if args.layouts and T <= LAYOUT_MAX_T:
        try:
            layout_point(res, ours, x, ids, w, pool, slot, backend, dev, reps, dense_cache, name)
        except Exception as exc:  # record, do not fail the run
            res["layouts_error"] = repr(exc)

    # bf16 cuBLAS of the same work: the two dense GEMMs with all T*k rows
    key = (name, T)
    if key not in cublas_cache:
        a1 = torch.randn(T * k, H, device=dev, dtype=torch.bfloat16)
        b1 = torch.randn(H, 2 * I, device=dev, dtype=torch.bfloat16)
        a2 = torch.randn(T * k, I, device=dev, dtype=torch.bfloat16)
        b2 = torch.randn(I, H, device=dev, dtype=torch.bfloat16)
        times = time_fn(lambda: (a1 @ b1, a2 @ b2), dev, reps)
        cublas_cache[key] = times
        del a1, b1, a2, b2
    res["cublas_bf16_times_s"] = cublas_cache[key]
    res["cublas_bf16_tflops"] = flops / median(cublas_cache[key]) / 1e12
    res["frac_of_cublas"] = res["tflops"] / res["cublas_bf16_tflops"]

    # (a) per-expert bf16 loop
    if not args.skip_baselines:
        dk = ("dense", name)
        if dk not in dense_cache:
            gen = torch.Generator(device=dev).manual_seed(1)
            dense_cache[dk] = (
                [torch.randn(H, 2 * I, device=dev, generator=gen).to(dtype) * 0.01 for _ in range(E)],
                [torch.randn(I, H, device=dev, generator=gen).to(dtype) * 0.01 for _ in range(E)],
            )
        w13s, w2s = dense_cache[dk]
        res["loop_bf16_times_s"] = time_fn(lambda: per_expert_loop(x, ids, w, w13s, w2s, I), dev, reps)
        res["speedup_vs_loop"] = median(res["loop_bf16_times_s"]) / t_ours
        res["dequant_matmul_times_s"] = time_fn(lambda: dequant_then_matmul(x, ids, w, pool, I), dev,
                                                max(2, reps // 3), warmup=1)
        res["speedup_vs_dequant_matmul"] = median(res["dequant_matmul_times_s"]) / t_ours
        if T == 1 and dev.startswith("cuda"):  # (c) torch's int4 kernel on the same expert, ours on it alone
            try:
                one_ids = torch.zeros((1, 1), dtype=torch.int32, device=dev)
                one_w = torch.ones((1, 1), device=dev)
                x1 = x.to(torch.bfloat16)
                theirs = int4pack_expert(pool, 0, I)
                res["int4pack_mm_times_s"] = time_fn(lambda: theirs(x1), dev, reps)
                mine = cuda_graph_fn(lambda: kernels.moe_forward(x1, one_ids, one_w, pool, slot, backend,
                                                                 validate=False), dev)
                res["ours_one_expert_times_s"] = time_fn(mine, dev, reps)
                res["speedup_vs_int4pack_mm"] = median(res["int4pack_mm_times_s"]) / median(
                    res["ours_one_expert_times_s"])
            except Exception as exc:  # record, do not fail the run
                res["int4pack_mm_error"] = repr(exc)
        if T <= 64:  # correctness against the dequantize-then-matmul baseline
            ref = dequant_then_matmul(x.float(), ids, w, pool, I)
            got = ours().float()
            res["max_abs_err_vs_dequant_fp32"] = float((got - ref).abs().max())
            res["max_abs_ref"] = float(ref.abs().max())
    return res


TUNE_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # x max |ref| (docs/kernels.md)


def output_error(got: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when ``got`` [T, H] matches the fp32 reference within the kernels' stated tolerance (relative to
    max |ref|, by got's dtype), else what is wrong: a candidate that computes something else is never timed."""
    err = float((got.float() - ref.float()).abs().max())
    bound = TUNE_TOL[got.dtype] * float(ref.abs().max())
    return None if err <= bound else f"wrong output: max |err| {err:.3g} > {bound:.3g}"


def tune_point(name: str, T: int, args, deadline: float | None = None) -> dict:
    """Time every candidate config at one point; returns {"best": cfg, "candidates": [...]} (raw times kept).
    Each candidate's output is checked against the fp32 dequantize-then-matmul reference first (split-K fixups,
    tiles): a wrong one is recorded with its error and not timed."""
    H, I, E, k = SHAPES[name]  # noqa: E741
    dev, dtype = args.device, args.dtype
    pool = random_awq_pool(H, I, E, dtype, dev)
    slot = torch.arange(E, dtype=torch.int32, device=dev)
    ids, w = random_routing(T, E, k, dev, seed=T)
    x = torch.randn(T, H, device=dev).to(dtype)
    cands = kcfg.tuning_candidates("decode" if T <= kcfg.DECODE_MAX_M else "prefill", GROUP)
    if T <= kcfg.DECODE_MAX_M:  # the lookup gives T's bucket BLOCK_M (every expert's rows in one block): time that
        cands = [c for c in cands if c["BLOCK_M"] == kcfg.bucket(T)]
    ref = dequant_then_matmul(x.float(), ids, w, pool, I)
    out = []
    for cfg in cands:
        if deadline is not None and time.time() > deadline:
            out.append({"config": cfg, "error": "skipped: time budget"})
            continue
        try:
            def run(cfg=cfg):
                return kernels.moe_forward(x, ids, w, pool, slot, "triton", config=cfg, validate=False)

            wrong = output_error(run(), ref)
            if wrong:
                out.append({"config": cfg, "error": wrong})
                continue
            replay = cuda_graph_fn(run, dev) or run  # timed as a decode step pays it: no Python, no launch gaps
            times = time_fn(replay, dev, reps=10 if T <= 512 else 3)
            out.append({"config": cfg, "times_s": times, "median_s": median(times)})
        except Exception as exc:  # e.g. out of shared memory for a big tile
            out.append({"config": cfg, "error": repr(exc)})
    ok = [c for c in out if "median_s" in c]
    return {"best": min(ok, key=lambda c: c["median_s"])["config"] if ok else None, "candidates": out}


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = point_parser(__doc__.split("\n")[0], SHAPES, "mixtral-8x7b,mixtral-8x22b", TOKENS, 450.0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-<device>-<time>.json)")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, T=1,4,16, few reps (runs on a CPU)")
    p.add_argument("--tune", action="store_true", help="sweep configs and write a config table (GPU only)")
    p.add_argument("--tune-out", default=None,
                   help="table path (default moeflow/kernels/experts/configs/<device>.json)")
    p.add_argument("--no-layouts", dest="layouts", action="store_false",
                   help="skip timing the former row-major qweight layout beside the panel layout (T <= 64)")
    a = p.parse_args(argv)
    if a.dry_run:
        a.shapes, a.tokens, a.quick = "tiny", "1,4,16", True
    finish_point_args(p, a, SHAPES)
    if a.tune and not a.device.startswith("cuda"):
        p.error("--tune needs a CUDA device")
    return a


def slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")


def markdown_table(results: list[dict], copy_bw: float, peak_tflops: float) -> str:
    lines = [
        f"device-copy bandwidth: {copy_bw / 1e9:.0f} GB/s; bf16 cuBLAS 8192^3: {peak_tflops:.0f} TFLOP/s",
        "",
        "| shape | T | ours (us) | GB/s | % copy BW | TFLOP/s | % cuBLAS bf16 | x vs bf16 loop | x vs dequant+mm "
        "| x vs int4pack_mm | panel / row-major layout |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['T']} | error: {r['error'][:60]} |||||||||")
            continue
        lines.append(
            f"| {r['shape']} | {r['T']} | {r['ours_s'] * 1e6:.1f} | {r['bytes_per_s'] / 1e9:.0f} | "
            f"{100 * r['frac_of_copy_bw']:.0f} | {r['tflops']:.1f} | {100 * r['frac_of_cublas']:.0f} | "
            f"{r.get('speedup_vs_loop', float('nan')):.2f} | {r.get('speedup_vs_dequant_matmul', float('nan')):.2f} | "
            f"{r.get('speedup_vs_int4pack_mm', float('nan')):.2f} | {r.get('panel_speedup', float('nan')):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    dev = args.device
    dev_name = kcfg.device_name(dev)
    meta = {
        "device": dev_name, "torch": torch.__version__, "triton": kcfg.triton_version(),
        "python": platform.python_version(), "dtype": str(args.dtype).replace("torch.", ""), "group_size": GROUP,
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "dry_run": args.dry_run,
    }
    bw = copy_bandwidth(dev, (1 << 30) if dev.startswith("cuda") else (1 << 24))
    peak = cublas_peak(dev, 8192 if dev.startswith("cuda") else 256)
    results, tuned, skipped = [], {}, []
    dense_cache: dict = {}
    cublas_cache: dict = {}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        f"kernels-{slug(dev_name)}-{_dt.datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> dict:  # after every point: a run cut short keeps what it measured
        report = {"meta": meta, "copy_bandwidth": bw, "cublas_bf16_peak": peak, "results": results, "tuning": tuned,
                  "skipped": skipped, "elapsed_s": time.time() - t_start}
        out.write_text(json.dumps(report, indent=1, default=str))
        out.with_suffix(".md").write_text(markdown_table(results, bw["bytes_per_s"], peak["tflops"]))
        return report

    save()
    for name in args.shape_list:
        for T in args.token_list:
            if time.time() - t_start > args.budget_s:
                skipped.append({"shape": name, "T": T})
                continue
            try:
                results.append(bench_point(name, T, args, dense_cache, bw["bytes_per_s"], cublas_cache))
            except Exception as exc:  # keep going; record the failure
                results.append({"shape": name, "T": T, "error": repr(exc)})
            print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith("times_s")}), flush=True)
            save()
        dense_cache.clear()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.tune:
        for name in args.shape_list:
            for T in args.token_list:
                if time.time() - t_start > args.budget_s:
                    skipped.append({"shape": name, "T": T, "tune": True})
                    continue
                tuned[f"{name}/{T}"] = tune_point(name, T, args, deadline=t_start + args.budget_s)
                save()
        write_tune_table(args, tuned, dev_name)
    report = save()
    print(markdown_table(results, bw["bytes_per_s"], peak["tflops"]))
    print(f"wrote {out} ({report['elapsed_s']:.0f} s)")
    return report


def write_tune_table(args, tuned: dict, dev_name: str) -> Path:
    """Write the best configs as a config table (format 1, see docs/kernels.md)."""
    entries = []
    for name in args.shape_list:
        H, I, E, k = SHAPES[name]  # noqa: E741
        cfgs = {str(T): tuned[f"{name}/{T}"]["best"] for T in args.token_list
                if f"{name}/{T}" in tuned and tuned[f"{name}/{T}"]["best"]}
        if cfgs:
            entries.append({"op": "moe", "kind": "awq", "dtype": str(args.dtype).replace("torch.", ""),
                            "group_size": GROUP, "num_experts": E, "top_k": k, "n": I, "k": H, "configs": cfgs})
    table = {"format": 1, "device": dev_name, "triton": kcfg.triton_version(),
             "note": "written by benchmarks/gpu/kernels.py --tune", "entries": entries}
    path = Path(args.tune_out) if args.tune_out else kcfg.CONFIG_DIR / f"{slug(dev_name)}.json"
    if path.exists():  # keep entries of other shapes / dtypes tuned before
        old = json.loads(path.read_text())
        if old.get("device") == dev_name and old.get("triton") == table["triton"]:
            def key(e):
                return (e["op"], e["kind"], e["dtype"], e["group_size"], e["num_experts"], e["top_k"], e["n"], e["k"])
            new_keys = {key(e) for e in entries}
            table["entries"] = [e for e in old["entries"] if key(e) not in new_keys] + entries
    kcfg.validate_table(table)
    path.write_text(json.dumps(table, indent=1))
    print(f"wrote config table {path}")
    return path


if __name__ == "__main__":
    main()
