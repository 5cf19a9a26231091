"""MXFP4 expert kernels (gpt-oss) on a GPU: % of measured HBM bandwidth and speed against a bf16 per-expert loop.

    python -m benchmarks.gpu.mxfp4 --out $OUT/mxfp4.json            # gpt-oss-120b experts, T = 1..512
    python -m benchmarks.gpu.mxfp4 --tiny --out /tmp/mxfp4.json     # tiny shape on the CPU (torch reference)
    python -m benchmarks.gpu.mxfp4 --splits --tokens 1,4,16 --out $OUT/mxfp4-splits.json  # + every decode split
    python -m benchmarks.gpu.mxfp4 --no-layouts ...                 # without the panel / row-major A/B

For every T: one MoE layer of gpt-oss-120b's experts (hidden 2880, intermediate 2880, 128 experts, top-4, MXFP4
blocks + e8m0 scales, bf16 biases, clamped SwiGLU) through ``moeflow.kernels.moe_forward`` (plan + the w13 and w2
stages of :mod:`moeflow.kernels.experts.mxfp4` + combine), timed eagerly and under CUDA-graph replay (reported: what a
captured decode step pays). Achieved bytes/s on the active experts' bytes (+ activations) against the device-copy
bandwidth measured in the same run (% of HBM), and the speed ratio to a per-expert loop of bf16 torch matmuls on
dense weights of the same shapes (``gpu.kernels.per_expert_loop``: SiLU, no biases; the elementwise epilogue
is noise next to the weight traffic). At T <= 64 the output is checked against the fp32 plain-torch reference on
the dequantized weights (max abs error and relative Frobenius error are recorded, never asserted).

Layouts (on by default, ``--no-layouts`` skips them): the experts alone (``mxfp4_expert_forward``: plan, w13, w2; no
combine) timed from the pool's K-panel layout and from a row-major copy of the same weights (the layout before
panels, read by the same kernel through strides: ``mxfp4.row_major_copy``), both eager and under CUDA-graph replay,
with the time ratio row-major / panel (> 1: panels are faster) and whether both outputs are bitwise equal. They
need the Triton kernels: a GPU, or ``--interpret`` on a CPU; with the torch backend the point records why not.

The timing harness (events, CUDA-graph replay, copy bandwidth) is gpu/kernels.py's (benchmarks/gpu/timing.py).
The JSON is rewritten after every point and each point prints one summary line; a failing point is recorded and the
run goes on.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.gpu.kernels import per_expert_loop
from benchmarks.gpu.timing import (
    copy_bandwidth,
    finish_point_args,
    median,
    point_inputs,
    point_parser,
    time_fn,
    time_ours,
)
from benchmarks.sass.mxfp4 import MODELS
from moeflow import kernels
from moeflow.kernels.experts import configs as kcfg
from moeflow.kernels.experts import mxfp4
from moeflow.kernels.formats import biased_expert_format
from moeflow.kernels.pool import ExpertPool

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {"gpt-oss-120b": MODELS["gpt-oss-120b"], "gpt-oss-20b": MODELS["gpt-oss-20b"],  # (H, I, E, top_k)
          "tiny": (64, 96, 8, 2)}
TOKENS = (1, 4, 16, 64, 512)


def random_mxfp4_pool(hidden: int, inter: int, n_experts: int, dtype: torch.dtype, device: str,
                      seed: int = 0) -> ExpertPool:
    """A pool of random gpt-oss experts: random e2m1 nibbles (every code is a finite value), e8m0 scales
    2**-9 .. 2**-4 (so weights stay <= 0.375 and bf16 activations finite), small biases."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fmt = biased_expert_format(hidden, inter, "mxfp4", dtype, 32, activation="clamped_swiglu")
    pool = ExpertPool.allocate(fmt, n_experts, device)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, device=device, generator=gen))
    for name in ("w13_scales", "w2_scales"):
        t = pool.tensors[name]
        t.copy_(torch.randint(118, 124, t.shape, dtype=torch.uint8, device=device, generator=gen))
    for name in ("w13_bias", "w2_bias"):
        t = pool.tensors[name]
        t.copy_((torch.randn(t.shape, device=device, generator=gen) * 0.05).to(dtype))
    return pool


def bench_point(name: str, T: int, args, cache: dict, copy_bw: float) -> dict:
    H, I, E, k = SHAPES[name]  # noqa: E741
    dev, dtype = args.device, args.dtype
    pool, slot, ids, w, x, backend, reps = point_inputs(SHAPES[name], name, T, args, cache, random_mxfp4_pool)

    def ours():
        return kernels.moe_forward(x, ids, w, pool, slot, backend, validate=False)

    used = int(torch.unique(ids).numel())
    act = torch.finfo(dtype).bits // 8
    weight_bytes = used * pool.fmt.nbytes
    res: dict = {"shape": name, "T": T, "hidden": H, "intermediate": I, "experts": E, "top_k": k, "backend": backend,
                 "experts_used": used, "expert_bytes": pool.fmt.nbytes, "weight_bytes": weight_bytes,
                 "total_bytes": weight_bytes + act * (T * H + T * k * I + 2 * T * k * H),
                 "flops": 2 * T * k * (H * 2 * I + I * H)}
    res.update(time_ours(ours, dev, reps))
    t_ours = res["ours_s"]
    res.update(bytes_per_s=res["total_bytes"] / t_ours,
               frac_of_copy_bw=res["total_bytes"] / t_ours / copy_bw, tflops=res["flops"] / t_ours / 1e12)
    if not args.skip_baselines:
        try:
            if ("dense", name) not in cache:  # bf16 weights of the same shapes (2I x H and H x I per expert)
                gen = torch.Generator(device=dev).manual_seed(1)
                cache[("dense", name)] = (
                    [(torch.randn(H, 2 * I, device=dev, generator=gen) * 0.01).to(dtype) for _ in range(E)],
                    [(torch.randn(I, H, device=dev, generator=gen) * 0.01).to(dtype) for _ in range(E)])
            w13s, w2s = cache[("dense", name)]
            res["loop_bf16_times_s"] = time_fn(lambda: per_expert_loop(x, ids, w, w13s, w2s, I), dev, reps)
            res["speedup_vs_loop"] = median(res["loop_bf16_times_s"]) / t_ours
        except Exception as exc:  # e.g. out of memory for the dense copy: the kernel's numbers stand
            res["loop_error"] = repr(exc)
    if args.splits and T <= kcfg.DECODE_MAX_M:  # every decode split pair (CUDA-graph replay where it captures)
        default = mxfp4.stage_configs(T, E, k, H, I)
        res["default_splits"] = [default["w13"]["SPLIT_K"], default["w2"]["SPLIT_K"]]
        res["split_times_s"] = {}
        for s13, s2 in mxfp4.SPLIT_CANDIDATES:
            cfg = {"w13": {"SPLIT_K": s13}, "w2": {"SPLIT_K": s2}}
            timed = time_ours(lambda cfg=cfg: kernels.moe_forward(x, ids, w, pool, slot, backend, config=cfg,
                                                                  validate=False), dev, reps)
            res["split_times_s"][f"{s13}x{s2}"] = timed["ours_s"]
    if args.layouts:
        res["layouts"] = layout_ab(name, T, x, ids, w, pool, slot, backend, reps, cache, res["total_bytes"], copy_bw)
    if T <= 64:  # against the fp32 reference on the dequantized weights
        ref = kernels.moe_forward(x.float(), ids, w, pool, slot, "torch", validate=False)
        got = ours().float()
        res["max_abs_err_vs_fp32"] = float((got - ref).abs().max())
        res["rel_err_vs_fp32"] = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        res["all_finite"] = bool(torch.isfinite(got).all())
    return res


def layout_ab(name: str, T: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, pool: ExpertPool,
              slot: torch.Tensor, backend: str, reps: int, cache: dict, total_bytes: int, copy_bw: float) -> dict:
    """The experts from the pool's K panels and from a row-major copy of them (module doc)."""
    if backend != "triton":
        return {"skipped": "the layouts are the Triton kernels' (a GPU, or --interpret on a CPU)"}
    if ("row_major", name) not in cache:
        cache[("row_major", name)] = mxfp4.row_major_copy(pool)
    res: dict = {"timed": "mxfp4_expert_forward: plan + w13 + w2, no combine"}
    outs = {}
    for layout, weights in (("panel", None), ("row_major", cache[("row_major", name)])):
        buf = x.new_empty((ids.numel(), x.shape[1]))

        def experts(weights=weights, buf=buf):
            return mxfp4.mxfp4_expert_forward(x, ids, w, pool, slot, buf, weights=weights)

        timed = time_ours(experts, x.device.type, reps)
        res[layout] = {key: timed.get(key) for key in ("ours_s", "ours_eager_s", "timed_as", "ours_graph_error")}
        res[layout]["frac_of_copy_bw"] = total_bytes / timed["ours_s"] / copy_bw
        outs[layout] = experts().clone()
    res["row_major_over_panel"] = res["row_major"]["ours_s"] / res["panel"]["ours_s"]
    res["row_major_over_panel_eager"] = res["row_major"]["ours_eager_s"] / res["panel"]["ours_eager_s"]
    res["bitwise_equal"] = bool(torch.equal(outs["panel"], outs["row_major"]))
    return res


def summary(r: dict) -> str:
    """The one line printed per point."""
    if "error" in r:
        return f"mxfp4 {r['shape']} T={r['T']}: error {r['error']}"
    loop = f"{r['speedup_vs_loop']:.2f}x bf16 loop" if "speedup_vs_loop" in r else r.get("loop_error", "no loop")
    err = f", rel err {r['rel_err_vs_fp32']:.1e}" if "rel_err_vs_fp32" in r else ""
    lay = r.get("layouts", {})
    if "panel" in lay:
        lay = (f"; experts: panels {lay['panel']['ours_s'] * 1e6:.1f} us, row-major "
               f"{lay['row_major']['ours_s'] * 1e6:.1f} us ({lay['row_major_over_panel']:.2f}x"
               f"{'' if lay['bitwise_equal'] else ', OUTPUTS DIFFER'})")
    else:
        lay = f"; layouts skipped: {lay['skipped']}" if "skipped" in lay else ""
    return (f"mxfp4 {r['shape']} T={r['T']}: {r['ours_s'] * 1e6:.1f} us ({r['timed_as']}; eager "
            f"{r['ours_eager_s'] * 1e6:.1f} us), {r['experts_used']} experts, {r['bytes_per_s'] / 1e9:.0f} GB/s = "
            f"{100 * r['frac_of_copy_bw']:.0f}% of copy BW, {loop}{err}{lay}")


def markdown_table(results: list[dict], copy_bw: float) -> str:
    lines = [f"device-copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)", "",
             "| shape | T | experts used | us (graph) | us (eager) | GB/s | % copy BW | x vs bf16 loop | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['T']} | error: {r['error'][:60]} ||||||")
            continue
        lines.append(f"| {r['shape']} | {r['T']} | {r['experts_used']} | {r['ours_s'] * 1e6:.1f} | "
                     f"{r['ours_eager_s'] * 1e6:.1f} | {r['bytes_per_s'] / 1e9:.0f} | "
                     f"{100 * r['frac_of_copy_bw']:.0f} | {r.get('speedup_vs_loop', float('nan')):.2f} | "
                     f"{r.get('rel_err_vs_fp32', float('nan')):.1e} |")
    ab = [r for r in results if "panel" in r.get("layouts", {})]
    if ab:  # the experts alone (no combine), K panels against the row-major copy
        lines += ["", "| shape | T | panels us | row-major us | panels % copy BW | row-major % copy BW | "
                  "row-major / panels | bitwise equal |", "|---|---|---|---|---|---|---|---|"]
        for r in ab:
            lay = r["layouts"]
            lines.append(f"| {r['shape']} | {r['T']} | {lay['panel']['ours_s'] * 1e6:.1f} | "
                         f"{lay['row_major']['ours_s'] * 1e6:.1f} | {100 * lay['panel']['frac_of_copy_bw']:.0f} | "
                         f"{100 * lay['row_major']['frac_of_copy_bw']:.0f} | {lay['row_major_over_panel']:.2f} | "
                         f"{lay['bitwise_equal']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = point_parser(__doc__.split("\n")[0], SHAPES, "gpt-oss-120b", TOKENS, 150.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mxfp4_kernels.json")
    p.add_argument("--splits", action="store_true", help="at T <= 16 also time every (w13, w2) split of "
                   "moeflow.kernels.experts.mxfp4.SPLIT_CANDIDATES (split_times_s; default_splits: the wave rule's)")
    p.add_argument("--layouts", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the experts from the K-panel layout and from a row-major copy (module doc)")
    p.add_argument("--tiny", action="store_true", help="tiny shape, T = 1, 4, 16, few repetitions (runs on a CPU)")
    a = p.parse_args(argv)
    if a.tiny:
        a.shapes, a.quick = "tiny", True
        if a.tokens == ",".join(map(str, TOKENS)):
            a.tokens = "1,4,16"
    finish_point_args(p, a, SHAPES)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start, dev = time.time(), args.device
    meta = {"device": kcfg.device_name(dev), "torch": torch.__version__, "triton": kcfg.triton_version(),
            "python": platform.python_version(), "dtype": str(args.dtype).replace("torch.", ""),
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "tiny": args.tiny}
    results: list[dict] = []
    skipped: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bw = {"bytes_per_s": float("nan")}

    def save() -> dict:  # after every point: a run cut short keeps what it measured
        report = {"meta": meta, "copy_bandwidth": bw, "results": results, "skipped": skipped,
                  "elapsed_s": time.time() - t_start}
        args.out.write_text(json.dumps(report, indent=1, default=str))
        args.out.with_suffix(".md").write_text(markdown_table(results, bw["bytes_per_s"]))
        return report

    try:
        bw = copy_bandwidth(dev, (1 << 30) if dev.startswith("cuda") else (1 << 24))
    except Exception as exc:  # the % column is then NaN; the times still count
        bw = {"bytes_per_s": float("nan"), "error": repr(exc)}
    save()
    cache: dict = {}
    for name in args.shape_list:
        for T in args.token_list:
            if time.time() - t_start > args.budget_s:
                skipped.append({"shape": name, "T": T})
                continue
            try:
                results.append(bench_point(name, T, args, cache, bw["bytes_per_s"]))
            except Exception as exc:  # keep going; record the failure
                results.append({"shape": name, "T": T, "error": repr(exc)})
            print(summary(results[-1]), flush=True)
            save()
        cache.clear()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    report = save()
    print(markdown_table(results, bw["bytes_per_s"]))
    print(f"wrote {args.out} ({report['elapsed_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
