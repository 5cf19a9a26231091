"""The fused CPU decode step against the unfused one, A/B interleaved in one process, beside llama.cpp Q4_0
(issue 21 item 3).

One model (the peer benchmark's AWQ synthetic Mixtral, ``run_peers.py`` writes it) is switched between its fused
and its unfused step (``moeflow.engine.cpu_step.set_cpu_step_fused``: the same weights and kernels, only the
glue differs) rep after rep (with ``--lm-head-4`` a second model with ``lm_head_bits=4`` joins the rotation), so the
shared machine's load hits all alike; llama.cpp Q4_0's ``llama-bench`` runs between them. Reports, per mode, the
median wall ms per decoded token (generate's TPOT) and the median CPU ms per decoded token (CPU time of generate(tg
+ 1) minus generate(1), per token: what one thread's contention moves least), with ``uptime`` before and after.

    python -m benchmarks.peers.cpu_step_ab --work /tmp/peers --threads 1 --attention-bits 4 --lm-head-4 \\
        --out benchmarks/results/peers/s4/ab_t1
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.peers.peer_report import uptime, write_report
from benchmarks.peers.run_peers import llama_cpp_decode_cpu_ms

HERE = Path(__file__).resolve().parent


def main() -> None:
    from moeflow import MoEOffloadedMixtral
    from moeflow.engine.cpu_step import set_cpu_step_fused

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="run_peers.py's scratch directory (awq/, GGUFs)")
    ap.add_argument("--out", type=Path, required=True, help="output prefix (.json and .md are added)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention-bits", type=int, default=4, help="from_pretrained(attention_bits=...); 0: None")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tg", type=int, default=32, help="decoded tokens per repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp Q4_0")
    ap.add_argument("--lm-head-4", action="store_true", help="also the fused step with lm_head_bits=4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    before = uptime()
    bits = args.attention_bits or None
    load = dict(device="cpu", attention_bits=bits, progress=False)
    model = MoEOffloadedMixtral.from_pretrained(args.work / "awq", **load)
    modes = {"unfused": (model, False), "fused": (model, True)}
    if args.lm_head_4:
        modes["fused, lm_head_bits=4"] = (MoEOffloadedMixtral.from_pretrained(args.work / "awq", lm_head_bits=4,
                                                                               **load), True)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def cpu_s(m, n: int) -> tuple[float, float]:
        c0 = time.process_time()
        m.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
        return time.process_time() - c0, m.stats.tpot_s

    samples: dict[str, dict[str, list[float]]] = {m: {"wall_ms": [], "cpu_ms": []} for m in modes}
    llama: list[float] = []
    with torch.inference_mode():
        for m, fused in modes.values():  # warm-up
            set_cpu_step_fused(m.model, fused)
            cpu_s(m, 4)
        for _ in range(args.reps):
            for mode, (m, fused) in modes.items():
                set_cpu_step_fused(m.model, fused)
                one, _ = cpu_s(m, 1)
                full, tpot = cpu_s(m, args.tg + 1)
                samples[mode]["wall_ms"].append(tpot * 1e3)
                samples[mode]["cpu_ms"].append((full - one) / args.tg * 1e3)
            if not args.no_llama and args.threads == 1:
                gguf = args.work / "mixtral-synth-Q4_0.gguf"
                llama.append(llama_cpp_decode_cpu_ms(args.work / "llama.cpp/build/bin/llama-bench", gguf, args.tg, 1))
    res = {"threads": args.threads, "attention_bits": bits, "prompt": args.prompt, "tg": args.tg, "reps": args.reps,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "uptime_before": before, "uptime_after": uptime(), "samples": samples, "llama_cpp_q4_0_cpu_ms": llama,
           "median": {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}}
    if llama:
        res["median"]["llama.cpp Q4_0"] = {"cpu_ms": statistics.median(llama)}
    lines = [f"moeflow `device=\"cpu\"` decode, fused vs unfused step (A/B interleaved, {args.reps} reps), "
             f"attention_bits={bits}, {args.threads} thread(s), prompt {args.prompt}, tg {args.tg}, {res['date']}.",
             "", f"uptime before: `{before}`  ", f"uptime after: `{res['uptime_after']}`", "",
             "| engine | wall ms / token (median) | CPU ms / token (median) | tok/s from CPU ms | vs llama.cpp Q4_0 |",
             "|---|---|---|---|---|"]
    ref = res["median"].get("llama.cpp Q4_0", {}).get("cpu_ms")
    for name, m in res["median"].items():
        wall = f"{m['wall_ms']:.2f}" if "wall_ms" in m else ""
        ratio = f"{ref / m['cpu_ms']:.2f}x" if ref else ""
        lines.append(f"| {name} | {wall} | {m['cpu_ms']:.2f} | {1e3 / m['cpu_ms']:.1f} | {ratio} |")
    write_report(args.out, res, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
