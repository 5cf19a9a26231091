"""The GPU lane's kernel-timing harness (gpu/kernels.py: W4A16 at Mixtral shapes; gpu/mxfp4.py: MXFP4 at
gpt-oss shapes): CUDA-event timing, CUDA-graph replay, the measured ceilings (device-copy bandwidth, bf16 cuBLAS)
and one (shape, T) point's random inputs. On a CPU the same functions time with ``perf_counter`` and skip graphs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def random_routing(T: int, E: int, k: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-top-k routing of T random tokens over E experts: (topk_ids int32 [T, k], weights fp32 [T, k])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(T, E, device=device, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], device: str, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call, one entry per repetition (CUDA events on a GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def copy_bandwidth(device: str, nbytes: int) -> dict:
    """Measured device-to-device copy bandwidth (read + write bytes per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), device, reps=10)
    return {"bytes": nbytes, "times_s": times, "bytes_per_s": 2 * nbytes / median(times)}


def cublas_peak(device: str, n: int) -> dict:
    """bf16 cuBLAS TFLOP/s of one square [n, n] @ [n, n] matmul on random data (the compute ceiling)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = time_fn(lambda: a @ b, device, reps=10 if device.startswith("cuda") else 2)
    return {"n": n, "times_s": times, "tflops": 2 * n**3 / median(times) / 1e12}


def cuda_graph_fn(fn: Callable[[], object], device: str) -> Callable[[], object] | None:
    if not device.startswith("cuda"):
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):  # on the warmed stream: its workspace buffers and split-K counters exist
        fn()
    return g.replay


def reps_for(T: int, quick: bool) -> int:
    if quick:
        return 3
    return 30 if T <= 64 else 10 if T <= 512 else 5


def time_ours(fn: Callable[[], object], device: str, reps: int) -> dict:
    """Eager and CUDA-graph-replay times of ``fn``; ``ours_s`` is the replay's median (what a captured decode step
    pays), the eager one when the capture failed (its error recorded, the run goes on)."""
    res: dict = {"ours_times_s": time_fn(fn, device, reps)}
    try:
        graph = cuda_graph_fn(fn, device)
        res["ours_graph_times_s"] = time_fn(graph, device, reps) if graph else None
    except Exception as exc:  # record, do not fail the run
        res["ours_graph_error"] = repr(exc)
    res["timed_as"] = "cuda_graph" if res.get("ours_graph_times_s") else "eager"
    res["ours_s"] = median(res.get("ours_graph_times_s") or res["ours_times_s"])
    res["ours_eager_s"] = median(res["ours_times_s"])
    return res


def point_parser(description: str, shapes: dict, default_shapes: str, tokens: tuple[int, ...],
                 budget_s: float) -> argparse.ArgumentParser:
    """The kernel scripts' shared arguments: shapes, T, dtype, device, repetitions, interpreter, baselines, budget."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shapes", default=default_shapes, help=f"comma list of {sorted(shapes)}")
    p.add_argument("--tokens", default=",".join(map(str, tokens)), help="comma list of T")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true", help="3 repetitions per measurement")
    p.add_argument("--interpret", action="store_true", help="on a CPU, time the Triton interpreter (very slow)")
    p.add_argument("--skip-baselines", action="store_true", help="skip the torch baselines (per-expert loops)")
    p.add_argument("--budget-s", type=float, default=budget_s, help="stop starting new points after this long")
    return p


def finish_point_args(parser: argparse.ArgumentParser, a: argparse.Namespace, shapes: dict) -> None:
    """The kernel scripts' shared arguments, resolved in place: ``device`` (cuda when there is one), ``dtype``,
    ``shape_list`` (names of ``shapes``, else a parser error) and ``token_list`` from the comma lists."""
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    a.shape_list = [s for s in a.shapes.split(",") if s]
    for s in a.shape_list:
        if s not in shapes:
            parser.error(f"unknown shape {s!r}; known: {sorted(shapes)}")
    a.token_list = [int(t) for t in a.tokens.split(",") if t]


def point_inputs(shape: tuple[int, int, int, int], key: str, T: int, args, cache: dict, make_pool: Callable):
    """(pool, slot_of_expert, topk_ids, topk_weights, x [T, H], backend, repetitions) of one point; the pool
    (``make_pool(H, I, E, dtype, device)``) is built once per ``key`` and kept in ``cache``."""
    H, I, E, k = shape  # noqa: E741
    dev = args.device
    if ("pool", key) not in cache:
        cache[("pool", key)] = make_pool(H, I, E, args.dtype, dev)
    ids, w = random_routing(T, E, k, dev, seed=T)
    backend = "triton" if dev.startswith("cuda") or args.interpret else "torch"
    return (cache[("pool", key)], torch.arange(E, dtype=torch.int32, device=dev), ids, w,
            torch.randn(T, H, device=dev).to(args.dtype), backend, reps_for(T, args.quick))
