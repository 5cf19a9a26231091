"""``moeflow bench profile``: measure a hardware profile on the machine at hand.

On a GPU: pinned host->device copies of one expert region (bandwidth) and of 4 KiB (latency), the expert
kernels on one AWQ expert for 1 and 64 tokens, an attention-layer proxy (q/k/v/o projections plus SDPA over
a 256-token context) and the LM head, all timed with CUDA events. On the CPU it measures the CPU path
honestly and says so: the "copy" is a host memcpy into the CPU slot pool (what the runtime does without a
GPU), compute runs through the CPU kernels. The host scheduling time is the real ``OffloadedExperts.forward``
with every expert a hit (the simulator's stubbed compute), so it is this host's Python cost per layer.

The CPU expert cost (hybrid execution, fiddler, llama.cpp's placement) is measured on every machine the way the
runtime's calibration does it (:func:`moeflow.offload.calibration.measure_cpu` on the expert's CPU int4 form, on
this process's torch threads): one token on the profile's expert and on one with a quarter of its intermediate
size give the weight rate (``cpu_gbps``: bytes / seconds between the two) and the fixed cost of a call
(``cpu_call_us``, plus on a GPU the round trip of the activations: two small copies); 8 and 16 tokens give the
cost per further token and the tokens free under the weight read.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from moeflow.sim.profile import MIXTRAL_8X7B, HardwareProfile

TINY_SHAPE = {"num_layers": 4, "num_experts": 8, "top_k": 2, "hidden": 128, "intermediate": 256}
SHAPES = {"mixtral-8x7b": MIXTRAL_8X7B, "tiny": TINY_SHAPE}


def _timer(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """Seconds per call of fn (median of ``repeats`` timed calls after a warm-up)."""
    def run(fn: Callable[[], Any], repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]
    return run


def _awq_pool(hidden: int, intermediate: int, group: int, device: torch.device):
    from moeflow.kernels.formats import expert_format
    from moeflow.kernels.pool import ExpertPool

    fmt = expert_format(hidden, intermediate, "awq", torch.float16, group)
    pool = ExpertPool.allocate(fmt, 1, device)
    g = torch.Generator().manual_seed(0)
    for name, t in pool.tensors.items():
        if name.endswith("qweight"):
            t.copy_(torch.randint(-(2**31), 2**31 - 1, t.shape, generator=g, dtype=torch.int64).to(torch.int32))
        elif name.endswith("qzeros"):
            t.fill_(0x88888888 - 2**32)
        else:
            t.copy_(torch.rand(t.shape, generator=g) * 4e-3)
    return fmt, pool


def measure_cpu_expert(hidden: int, intermediate: int, group: int, min_bytes: float = 8e6) -> dict[str, float]:
    """The CPU cost of one AWQ expert of ``hidden`` x ``intermediate`` in its CPU int4 form (see the module
    docstring): ``cpu_gbps``, ``cpu_call_us`` (the call alone, no transfers), ``cpu_token_ms``,
    ``cpu_free_tokens``. The weight rate is the slope between an expert of one group of intermediate rows and one of
    at least ``min_bytes`` (tiny shapes are all call cost; their rate would be noise)."""
    from moeflow.kernels.formats import expert_format
    from moeflow.offload.calibration import measure_cpu

    def timed(inter: int) -> tuple[int, float, float, float]:
        """(bytes, seconds for one token, seconds per further token, free tokens) of a hidden x inter expert."""
        fmt, pool = _awq_pool(hidden, inter, group, torch.device("cpu"))
        form = fmt.cpu_expert(fmt.loader_tensors(pool.buffer[0]))
        return (fmt.nbytes, *measure_cpu(form, hidden, lambda fn: fn()))

    nbytes = expert_format(hidden, intermediate, "awq", torch.float16, group).nbytes
    big_inter = intermediate if nbytes >= min_bytes else -(-int(intermediate * min_bytes / nbytes) // group) * group
    big_bytes, big_one, _, _ = big = timed(big_inter)
    small_bytes, small_one, _, _ = timed(group)
    _, _, per_token, free = big if big_inter == intermediate else timed(intermediate)
    slope = (big_one - small_one) / max(big_bytes - small_bytes, 1)  # seconds per weight byte
    if slope <= 0:  # timing noise swamped the difference: the whole call at the weight rate, no fixed cost
        slope = big_one / big_bytes
    call = max(0.0, small_one - slope * small_bytes)
    return {"cpu_gbps": round(1 / slope / 1e9, 3), "cpu_call_us": round(call * 1e6, 2),
            "cpu_token_ms": round(per_token * 1e3, 5), "cpu_free_tokens": round(max(1.0, free), 2)}


def measure_sched_ms(num_layers: int = 4, num_experts: int = 8, top_k: int = 2, steps: int = 40) -> float:
    """Host ms per layer of the real ``OffloadedExperts.forward`` with every expert a hit (compute stubbed)."""
    from moeflow.sim.profile import custom_profile
    from moeflow.sim.simulator import simulate
    from moeflow.trace.synthetic import synthesize_trace

    trace, _ = synthesize_trace(num_layers, num_experts, top_k, hidden_size=16, sequences=1, prompt_len=1,
                                new_tokens=steps + 1, seed=0)
    prof = custom_profile(h2d_gbps=100.0, expert_mb=1.0)
    simulate(trace, "lru", num_layers * num_experts, prof, timeline=False)  # warm-up
    t0 = time.perf_counter()
    simulate(trace, "lru", num_layers * num_experts, prof, timeline=False)
    return (time.perf_counter() - t0) / (len(trace) * num_layers) * 1e3


def measure_profile(device: str | torch.device | None = None, shape: str | dict = "auto", group_size: int = 128,
                    repeats: int = 10, name: str | None = None) -> HardwareProfile:
    """A :class:`HardwareProfile` measured here (see the module docstring)."""
    from moeflow import kernels

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if shape == "auto":
        shape = "mixtral-8x7b" if device.type == "cuda" else "tiny"
    shape_name = shape if isinstance(shape, str) else "custom"
    m = SHAPES[shape] if isinstance(shape, str) else shape
    H, I = m["hidden"], m["intermediate"]  # noqa: E741
    group = min(group_size, H, I)
    timed = _timer(device)
    fmt, pool = _awq_pool(H, I, group, device)

    # copies: one expert region, and a small one for the fixed cost
    cuda = device.type == "cuda"
    src = torch.empty(fmt.nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(fmt.nbytes, dtype=torch.uint8, device=device)
    copy_s = timed(lambda: dst.copy_(src, non_blocking=cuda), repeats)
    small = 4096
    lat_s = timed(lambda: dst[:small].copy_(src[:small], non_blocking=cuda), repeats * 3)
    gbps = fmt.nbytes / max(copy_s - lat_s, 1e-9) / 1e9

    # one expert for 1 and for 64 tokens
    dt = torch.float16 if cuda else torch.float32
    backend = "auto"

    def expert_call(T: int) -> Callable[[], Any]:
        x = torch.randn(T, H, device=device, dtype=dt) * 0.1
        ids = torch.zeros(T, 1, dtype=torch.int32, device=device)
        w = torch.ones(T, 1, device=device)
        slot = torch.zeros(1, dtype=torch.int32, device=device)
        out = torch.empty(T, H, device=device, dtype=dt)
        return lambda: kernels.expert_forward(x, ids, w, pool, slot, out, None, backend, validate=False)

    e1 = timed(expert_call(1), repeats)
    e64 = timed(expert_call(64), max(3, repeats // 2))
    per_tok_e = max(0.0, (e64 - e1) / 63)

    # attention-layer proxy: projections (Mixtral GQA shapes: 8 KV heads of 128, or H/4) + SDPA over 256 tokens
    kv = min(1024, H // 4)
    wq, wk, wv, wo = (torch.randn(o, H, device=device, dtype=dt) * 0.02 for o in (H, kv, kv, H))
    heads = max(1, H // 128)
    ctx_k = torch.randn(1, heads, 256, H // heads, device=device, dtype=dt)

    def attn_call(T: int) -> Callable[[], Any]:
        x = torch.randn(T, H, device=device, dtype=dt)

        def run() -> torch.Tensor:
            q = x @ wq.T
            _ = x @ wk.T, x @ wv.T
            a = torch.nn.functional.scaled_dot_product_attention(
                q.view(1, T, heads, H // heads).transpose(1, 2), ctx_k, ctx_k)
            return a.transpose(1, 2).reshape(T, H) @ wo.T
        return run

    a1 = timed(attn_call(1), repeats)
    a64 = timed(attn_call(64), max(3, repeats // 2))
    head_w = torch.randn(32000 if shape_name == "mixtral-8x7b" else 1024, H, device=device, dtype=dt) * 0.02
    xh = torch.randn(1, H, device=device, dtype=dt)
    head = timed(lambda: xh @ head_w.T, repeats)
    sched = measure_sched_ms()
    cpu = measure_cpu_expert(H, I, group)
    if cuda:  # a CPU expert's activations go to the host and its rows come back
        cpu["cpu_call_us"] = round(cpu["cpu_call_us"] + 2 * lat_s * 1e6, 2)
    from moeflow.sim.disk import measure_disk

    disk_gbps, disk_lat_us, _ = measure_disk(fmt.nbytes)

    what = (torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads)")
    desc = (f"measured by `moeflow bench profile` on {what}, expert shape {shape_name} (H={H}, I={I}, AWQ g{group})")
    if not cuda:
        desc += ("; NO GPU: 'h2d' is a host memcpy into the CPU slot pool and compute is the CPU kernels "
                 "(this describes the CPU path, not any GPU)")
    desc += "; attention is a proxy (projections + SDPA over 256 tokens), not the model's layer"
    desc += (f"; CPU experts: moeflow's int4 CPU form on {torch.get_num_threads()} torch threads "
             f"({platform.processor() or platform.machine()})")
    desc += "; disk: cold preads of a scratch file in the temp directory (page cache dropped with posix_fadvise)"
    return HardwareProfile(
        name=name or f"measured-{device.type}-{shape_name}", h2d_gbps=round(gbps, 3), expert_bytes=fmt.nbytes,
        h2d_latency_us=round(lat_s * 1e6, 3), attn_ms=round(a1 * 1e3, 5),
        attn_ms_per_token=round(max(0.0, (a64 - a1) / 63) * 1e3, 6), expert_ms=round(e1 * 1e3, 5),
        expert_ms_per_token=round(per_tok_e * 1e3, 6), head_ms=round(head * 1e3, 5), sched_ms=round(sched, 5),
        num_layers=m["num_layers"], num_experts=m["num_experts"], top_k=m["top_k"], description=desc, measured=True,
        disk_gbps=round(disk_gbps, 3), disk_latency_us=round(disk_lat_us, 2), **cpu,
        gpu_memory_gb=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 2) if cuda else None,
    )
