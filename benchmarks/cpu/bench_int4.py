"""pytest-benchmark: one Mixtral-8x7B expert (H 4096, I 14336, AWQ group 128) on the CPU, and one expert of
the peer benchmark's synthetic Mixtral (H 1024, I 3584; benchmarks/peers/).

* ``int4``: torch's int4 CPU kernel (:class:`moeflow.kernels.cpu.int4.Int4Expert`, bf16 activations), the path
  hybrid execution and ``device="cpu"`` use;
* ``dequant``: dequantize the AWQ weights to fp32, then matmul (what the torch reference does per call);
* ``memcpy``: a 256 MiB memory copy on the same machine in the same run, the bandwidth yardstick.

At T = 1, 4, 16 tokens. Each benchmark records in ``extra_info`` the weight bytes it reads and the achieved
GB/s (median time), and the int4 ones their fraction of the memcpy rate (bytes copied per second; a copy
reads and writes each byte, the kernel mostly reads). Targets: int4 >= 10x dequant at T = 1 (issue 8);
int4 bytes/s at T = 4 and 16 within 1.5x of T = 1 (issue 21; the "per byte vs T=1" column).

    python -m pytest benchmarks/cpu/bench_int4.py --benchmark-json=benchmarks/results/cpu_int4/bench.json
    python -m benchmarks.cpu.bench_int4 --table benchmarks/results/cpu_int4/bench.json   # Markdown table
"""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch
import torch.nn.functional as F

from moeflow.kernels.cpu.int4 import Int4Expert, int4_cpu_available
from moeflow.quant.awq import dequantize

H, I, GROUP = 4096, 14336, 128  # noqa: E741
SHAPES = {"mixtral-8x7b": (H, I), "synthetic": (1024, 3584)}
TOKENS = (1, 4, 16)
COPY_BYTES = 256 * 2**20
_STATE: dict = {}

pytestmark = pytest.mark.skipif(not int4_cpu_available(), reason="this torch build has no int4 CPU kernels")


def _awq(fan_in: int, fan_out: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    qweight = torch.randint(-(2**31), 2**31 - 1, (fan_in, fan_out // 8), generator=gen, dtype=torch.int64)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (fan_in // GROUP, fan_out // 8), generator=gen, dtype=torch.int64)
    scales = (torch.rand((fan_in // GROUP, fan_out), generator=gen) * 2e-3 + 1e-3).half()
    return qweight.to(torch.int32), qzeros.to(torch.int32), scales


def expert_tensors(shape: str = "mixtral-8x7b") -> dict[str, torch.Tensor]:
    if ("tensors", shape) not in _STATE:
        hidden, inter = SHAPES[shape]
        gen = torch.Generator().manual_seed(0)
        (a, b, c), (d, e, f) = _awq(hidden, 2 * inter, gen), _awq(inter, hidden, gen)
        _STATE[("tensors", shape)] = {"w13_qweight": a, "w13_qzeros": b, "w13_scales": c,
                                      "w2_qweight": d, "w2_qzeros": e, "w2_scales": f}
    return _STATE[("tensors", shape)]


def int4_expert(shape: str = "mixtral-8x7b") -> Int4Expert:
    if ("int4", shape) not in _STATE:
        t0 = time.perf_counter()
        _STATE[("int4", shape)] = Int4Expert.from_awq_tensors(expert_tensors(shape), GROUP)
        _STATE[("convert_s", shape)] = time.perf_counter() - t0
    return _STATE[("int4", shape)]


def dequant_forward(t: dict[str, torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Dequantize both matrices to fp32, then the expert MLP (the torch reference's per-call cost)."""
    w13 = dequantize(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"].float(), GROUP)
    w2 = dequantize(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"].float(), GROUP)
    h = x.float() @ w13
    return ((F.silu(h[:, :I]) * h[:, I:]) @ w2) * w[:, None]


def memcpy_rate() -> float:
    """Bytes copied per second by one 256 MiB ``copy_`` (best of 5), measured once per run."""
    if "memcpy" not in _STATE:
        src, dst = torch.ones(COPY_BYTES, dtype=torch.uint8), torch.empty(COPY_BYTES, dtype=torch.uint8)
        dst.copy_(src)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        _STATE["memcpy"] = COPY_BYTES / best
    return _STATE["memcpy"]


def _record(benchmark, kind: str, T: int, nbytes: int, shape: str = "mixtral-8x7b") -> None:
    median = benchmark.stats.stats.median
    gbps = nbytes / median / 1e9
    benchmark.extra_info.update({
        "kind": kind, "T": T, "shape": shape, "weight_bytes": nbytes, "achieved_GBps": gbps,
        "memcpy_GBps": memcpy_rate() / 1e9, "fraction_of_memcpy": gbps * 1e9 / memcpy_rate(),
        "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "convert_s": _STATE.get(("convert_s", shape)),
    })


def test_memcpy(benchmark):
    src, dst = torch.ones(COPY_BYTES, dtype=torch.uint8), torch.empty(COPY_BYTES, dtype=torch.uint8)
    benchmark.pedantic(lambda: dst.copy_(src), rounds=5, iterations=1, warmup_rounds=1)
    _record(benchmark, "memcpy", 0, COPY_BYTES)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T", TOKENS)
def test_int4(benchmark, T, shape):
    ex = int4_expert(shape)
    x, w = torch.randn(T, SHAPES[shape][0]), torch.rand(T)
    rounds = 10 if shape == "mixtral-8x7b" else 40
    benchmark.pedantic(lambda: ex.forward(x, w), rounds=rounds, iterations=1, warmup_rounds=2)
    _record(benchmark, "int4", T, ex.nbytes, shape)


@pytest.mark.parametrize("T", TOKENS)
def test_dequant(benchmark, T):
    t = expert_tensors()
    x, w = torch.randn(T, H), torch.rand(T)
    benchmark.pedantic(lambda: dequant_forward(t, x, w), rounds=3, iterations=1, warmup_rounds=1)
    _record(benchmark, "dequant", T, sum(v.numel() * v.element_size() for v in t.values()))


def table(path: str) -> str:
    """Markdown table of a ``--benchmark-json`` file: int4 vs dequant per T, GB/s vs memcpy."""
    data = json.loads(open(path).read())
    rows = {(b["extra_info"]["kind"], b["extra_info"]["T"]): b for b in data["benchmarks"]
            if b["extra_info"].get("shape", "mixtral-8x7b") == "mixtral-8x7b"}
    info = next(iter(rows.values()))["extra_info"]
    med = rows[("memcpy", 0)]["extra_info"]["achieved_GBps"] if ("memcpy", 0) in rows else float("nan")
    lines = [f"memcpy (256 MiB copy_, bytes copied/s): {info['memcpy_GBps']:.2f} GB/s best of 5 (the yardstick "
             f"below), {med:.2f} GB/s median of the memcpy benchmark", "",
             "| T | int4 ms | dequant+matmul ms | int4 speed-up | int4 GB/s | int4 / memcpy | dequant GB/s |",
             "|---|---|---|---|---|---|---|"]
    for T in TOKENS:
        a, b = rows.get(("int4", T)), rows.get(("dequant", T))
        if a is None or b is None:
            continue
        ta, tb = a["stats"]["median"], b["stats"]["median"]
        lines.append(f"| {T} | {ta * 1e3:.1f} | {tb * 1e3:.0f} | {tb / ta:.1f}x | "
                     f"{a['extra_info']['achieved_GBps']:.2f} | {a['extra_info']['fraction_of_memcpy']:.0%} | "
                     f"{b['extra_info']['achieved_GBps']:.3f} |")
    return "\n".join(lines + ["", per_token_table(data)])


def per_token_table(data: dict) -> str:
    """Issue 21's metric: int4 time per byte at T relative to T = 1, per expert shape."""
    lines = ["| expert shape | T | int4 ms (median) | GB/s | time per byte vs T = 1 |", "|---|---|---|---|---|"]
    rows = {(b["extra_info"].get("shape", "mixtral-8x7b"), b["extra_info"]["T"]): b for b in data["benchmarks"]
            if b["extra_info"]["kind"] == "int4"}
    for shape in SHAPES:
        for T in TOKENS:
            if (shape, T) not in rows or (shape, 1) not in rows:
                continue
            med, base = rows[(shape, T)]["stats"]["median"], rows[(shape, 1)]["stats"]["median"]
            lines.append(f"| {shape} | {T} | {med * 1e3:.2f} | {rows[(shape, T)]['extra_info']['achieved_GBps']:.2f}"
                         f" | {med / base:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="print the Markdown table of a cpu/bench_int4.py JSON file")
    ap.add_argument("--table", required=True)
    print(table(ap.parse_args().table))
