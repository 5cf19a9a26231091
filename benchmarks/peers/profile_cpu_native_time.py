"""Where a fused CPU decode step's CPU time goes, per native kernel, against the bytes each reads (issue 21).

Loads the peer benchmark's AWQ synthetic Mixtral (``run_peers.py`` writes it) with ``device="cpu"``, wraps
moeflow's CPU library so every ctypes call is timed (process CPU time: all threads) and its weight bytes counted,
and reports per decoded token: CPU ms and weight MB per kernel (``mf_attn_block``: a layer's attention half;
``mf_q4_expert``: one expert; ``mf_q4_linear`` / ``mf_q8_linear`` / ``mf_q8_linear_rows`` called from Python:
the lm_head; ``mf_dense_f32`` + ``mf_softmax_topk``: the router), the GB/s each reaches, and the rest of the
step's CPU time (Python, aten ops: "glue"). Per token = (generate(tg + 1) - generate(1)) / tg, median of reps.
Compare GB/s with ``cpu_roofline.py``'s stream bandwidth.

    python -m benchmarks.peers.profile_cpu_native_time --model /tmp/peers/awq --threads 1 --lm-head-bits 4 \\
        --out benchmarks/results/peers/s12/native_time_after
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch

from benchmarks.peers.peer_report import uptime, write_report


def _q4_bytes(n: int, k: int, group: int, fmt: int = 0) -> int:
    """fmt 0: fp32 scales and mins (8 bytes per row and group); 1: fp16 scales and uint8 zeros (3 bytes)."""
    return n * k // 2 + (3 if fmt else 8) * n * (k // group)


def _linear_bytes(bits: int, n: int, k: int, group: int, fmt: int = 0) -> int:
    return _q4_bytes(n, k, group, fmt) if bits == 4 else n * k + 4 * n


def weight_bytes(name: str, a: tuple) -> int:
    """Weight bytes one call reads, from its ctypes arguments (0 for the small ops). The q4 kernels took a ``fmt``
    argument after the group size from session 12 on: both signatures are read."""
    if name == "mf_q4_expert":
        h, inter, group = a[2], a[3], a[4]
        fmt = a[5] if len(a) == 16 else 0
        return _q4_bytes(2 * inter, h, group, fmt) + _q4_bytes(h, inter, group, fmt)
    if name == "mf_q4_linear":
        return _q4_bytes(a[3], a[2], a[4], a[5] if len(a) == 11 else 0)
    if name == "mf_q8_linear":
        return a[2] * a[3] + 4 * a[3]
    if name == "mf_q8_linear_rows":
        return a[2] * a[7]
    if name == "mf_attn_block":
        if len(a) in (39, 43):  # q (bits, group, fmt, w, s, m), k/v part (kv bits 0: none), o, nh, nkv, D, [QK-norm] ..
            (nh, nkv, d), kv = a[25:28], (a[13], a[14], a[15])
            h, f = a[3], (nh + 2 * nkv) * d
            nq = nh * d if kv[0] else f
            return (_linear_bytes(a[7], nq, h, a[8], a[9]) + _linear_bytes(a[19], h, nh * d, a[20], a[21])
                    + (_linear_bytes(kv[0], f - nq, h, kv[1], kv[2]) if kv[0] else 0))
        if len(a) == 33:  # (.., qkv bits, group, fmt, w, s, m, o bits, group, fmt, w, s, m, nh, nkv, D, ..)
            qkv, o, (nh, nkv, d) = (a[7], a[8], a[9]), (a[13], a[14], a[15]), a[19:22]
        else:
            qkv, o, (nh, nkv, d) = (a[7], a[8], 0), (a[12], a[13], 0), a[17:20]
        h, f = a[3], (nh + 2 * nkv) * d
        return _linear_bytes(qkv[0], f, h, qkv[1], qkv[2]) + _linear_bytes(o[0], h, nh * d, o[1], o[2])
    if name == "mf_dense_f32":
        return 4 * a[2] * a[3]
    return 0


class Timed:
    """The library with each call's CPU seconds and weight bytes added up per function name."""

    def __init__(self, lib, clock=time.process_time) -> None:
        self.lib, self.clock = lib, clock
        self.cpu: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)
        if not callable(fn) or not name.startswith("mf_"):
            return fn

        def call(*a):
            c0 = self.clock()
            r = fn(*a)
            self.cpu[name] += self.clock() - c0
            self.bytes[name] += weight_bytes(name, a)
            self.calls[name] += 1
            return r
        return call

    def snapshot(self) -> tuple[dict, dict, dict]:
        return dict(self.cpu), dict(self.bytes), dict(self.calls)


def profile_model(path: Path, lm_head_bits: int, prompt: int, tg: int, reps: int, wall: bool = False) -> dict:
    from moeflow import MoEOffloadedMixtral
    from moeflow.kernels.cpu import native as cpu_native
    from moeflow.kernels.cpu import step as cpu_step_ops
    try:
        from moeflow.kernels.cpu import layers as cpu_layers_ops
    except ImportError:  # a tree before the one-call layers
        cpu_layers_ops = None

    model = MoEOffloadedMixtral.from_pretrained(path, device="cpu", attention_bits=4, lm_head_bits=lm_head_bits,
                                                progress=False)
    cpu_step_ops._lib()  # declare the step ops' signatures on the real library first
    if cpu_layers_ops is not None:
        cpu_layers_ops._declare(cpu_native.library())
    clock = time.perf_counter if wall else time.process_time
    timed = Timed(cpu_native.library(), clock)
    cpu_native.set_library(timed)
    cpu_step_ops._DECLARED.add(id(timed))
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))

    # this tree's one-call layers (engine.cpu_layers; older trees name them native_layers)
    native = getattr(model.model, "layers_step", getattr(model.model, "native_layers", None))

    def run(n: int, wrapped: bool = True, one_call: bool = False) -> tuple[float, tuple]:
        cpu_native.set_library(timed if wrapped else timed.lib)
        if native is not None:  # the kernels are timed on the per-layer path: the same calls, one by one
            native.enabled = one_call
        before = timed.snapshot()
        c0 = clock()
        model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
        total = clock() - c0
        after = timed.snapshot()
        return total, tuple({k: v - b.get(k, 0) for k, v in a.items()} for a, b in zip(after, before, strict=True))

    per_rep = []
    try:
        with torch.inference_mode():
            run(4)  # warm-up
            for _ in range(reps):
                plain = run(tg + 1, wrapped=False)[0] - run(1, wrapped=False)[0]  # the step without the timing
                row = {"total_ms": plain / tg * 1e3}
                if native is not None:
                    one = run(tg + 1, wrapped=False, one_call=True)[0] - run(1, wrapped=False, one_call=True)[0]
                    row["total_one_call_ms"] = one / tg * 1e3
                t1, (c1, b1, n1) = run(1)
                tf, (cf, bf, nf) = run(tg + 1)
                row["total_timed_ms"] = (tf - t1) / tg * 1e3
                for k in cf:
                    row[k] = {"cpu_ms": (cf[k] - c1.get(k, 0)) / tg * 1e3, "mb": (bf[k] - b1.get(k, 0)) / tg / 1e6,
                              "calls": (nf[k] - n1.get(k, 0)) / tg}
                per_rep.append(row)
    finally:
        cpu_native.set_library(timed.lib)
        if native is not None:
            native.enabled = True
    med = {k: statistics.median(r[k] for r in per_rep) for k in per_rep[0] if k.startswith("total")}
    for k in sorted({k for r in per_rep for k in r if not k.startswith("total")}):
        vals = [r[k] for r in per_rep if k in r]
        cpu = statistics.median(v["cpu_ms"] for v in vals)
        mb = statistics.median(v["mb"] for v in vals)
        med[k] = {"cpu_ms": round(cpu, 3), "mb": round(mb, 2), "calls": statistics.median(v["calls"] for v in vals),
                  "gb_per_s": round(mb / cpu, 2) if cpu > 0 and mb else None}
    kernels = sum(v["cpu_ms"] for v in med.values() if isinstance(v, dict))
    med["glue_ms"] = med["total_ms"] - kernels
    if "total_one_call_ms" in med:
        med["glue_one_call_ms"] = med["total_one_call_ms"] - kernels
    return {"median": med, "reps": per_rep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="output prefix (.json and .md are added)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lm-head-bits", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--wall", action="store_true", help="wall time instead of process CPU time (2+ threads)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    before = uptime()
    res = profile_model(args.model, args.lm_head_bits, args.prompt, args.tg, args.reps, args.wall)
    res.update(clock="wall" if args.wall else "process CPU", threads=args.threads, lm_head_bits=args.lm_head_bits,
               uptime_before=before, uptime_after=uptime(),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    m = res["median"]
    lines = [f"{res['clock']} ms per decoded token by native kernel ({args.threads} thread(s), attention_bits=4, "
             f"lm_head_bits={args.lm_head_bits}, {args.reps} reps, {res['date']}).", "",
             f"uptime before: `{before}`  ", f"uptime after: `{res['uptime_after']}`", "",
             "| kernel | calls / token | ms / token | weight MB / token | GB/s |", "|---|---|---|---|---|"]
    for k, v in m.items():
        if isinstance(v, dict):
            lines.append(f"| {k} | {v['calls']:g} | {v['cpu_ms']:.3f} | {v['mb']:.2f} | {v['gb_per_s'] or ''} |")
    lines += [f"| glue (Python, aten), layers one by one | | {m['glue_ms']:.3f} | | |",
              f"| total, layers one by one | | {m['total_ms']:.3f} | | |"]
    if "total_one_call_ms" in m:
        lines += [f"| glue (Python, aten), layers in one call | | {m['glue_one_call_ms']:.3f} | | |",
                  f"| total, layers in one call | | {m['total_one_call_ms']:.3f} | | |"]
    lines.append(f"| (total with the timing wrapper) | | {m['total_timed_ms']:.3f} | | |")
    write_report(args.out, res, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
