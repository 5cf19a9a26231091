"""What running the tail (final norm + lm_head) inside gpt-oss's one-call CPU decode step saves per token (issue 42).

One process, one model (a gpt-oss GGUF with ``device="cpu"``), two ways of a decode step alternated rep by rep so
the shared machine's load hits both alike:

* ``tail``: ``NativeGptOssLayers.logits``: every layer, the final norm and the lm_head in one native call (one
  OpenMP region);
* ``python tail``: the same layers in one native call (``NativeGptOssLayers.__call__``), then the decoder's
  ``lm_head(norm(x))`` from Python (two more calls, each its own region: the path before session 18).

Per rep and way: wall ms per decoded token (TPOT of ``generate(prompt 16, tg + 1)``) and process CPU ms per decoded
token ((CPU of tg + 1 tokens - CPU of 1 token) / tg). On a loaded machine those move by more than the tail's
microseconds, so the step is also replayed (:func:`replay`): the arguments of one real decode step's call
captured, then the call with its tail (``gpt_oss_step(..., head=)``) against the call without a head plus
``lm_head(norm(out)).float()``, interleaved call by call (the same position rewritten with the same keys each time).
Also the Python tail alone (``lm_head(norm(x)).float()``, one token, warm). The greedy tokens of both ways are
checked equal.
``--vocab N``: the lm_head replaced by a random int8 head of N rows (gpt-oss's own vocabulary is 201088; the
synthetic file's is 97), to see the tail at a head of real size.

    python -m benchmarks.peers.gpt_oss_tail_ab --gguf /tmp/s16_gpt_oss/gpt-oss-mxfp4-synth-L2-E8.gguf --threads 1 \\
        --out benchmarks/results/peers/s18/gptoss_tail_ab_t1
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.peers.peer_report import uptime, write_report


def _cpu_name() -> str:
    """/proc/cpuinfo's model name and its AVX flags."""
    name, flags = "unknown", []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == "unknown":
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c")))
    return f"{name}; {' '.join(flags)}"


def replay(step_fn, args: tuple, head, logits: torch.Tensor, python_tail, calls: int) -> dict:
    """Per-call us (wall and process CPU) of the captured step: its layers alone (``layers``), with its tail
    (``one call``), and its layers then the Python tail (``python tail``), interleaved call by call (the order
    reversed every other round), medians; and the Python tail alone right after a step (``python tail after a
    step``: what the per-call path pays once the step has streamed the weights through the caches) and back to
    back (``python tail, warm``)."""
    ways = {"layers": lambda: step_fn(*args), "one call": lambda: step_fn(*args, head=head, logits=logits),
            "python tail": lambda: python_tail(step_fn(*args))}
    per: dict[str, list[tuple[float, float]]] = {name: [] for name in (*ways, "python tail after a step",
                                                                       "python tail, warm")}

    def timed(name: str, f) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        f()
        per[name].append(((time.perf_counter() - t0) * 1e6, (time.process_time() - c0) * 1e6))

    with torch.inference_mode():
        out = step_fn(*args)
        for i in range(calls):
            for name in (list(ways) if i % 2 else list(ways)[::-1]):
                timed(name, ways[name])
            step_fn(*args)
            timed("python tail after a step", lambda: python_tail(out))
            timed("python tail, warm", lambda: python_tail(out))
    return {name: {"wall_us": statistics.median(w for w, _ in v), "cpu_us": statistics.median(c for _, c in v)}
            for name, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=400, help="replayed calls per way")
    ap.add_argument("--vocab", type=int, default=0, help="replace the lm_head by a random int8 head of this many rows")
    ap.add_argument("--out", type=Path, required=True, help="output prefix (.json and .md are added)")
    args = ap.parse_args()

    import moeflow.engine.cpu_layers_gpt_oss as cpu_layers_gpt_oss
    from moeflow import MoEModel
    from moeflow.engine.cpu_layers_gpt_oss import NativeGptOssLayers
    from moeflow.kernels.cpu.quant_linear import quantize_linear_cpu

    torch.set_num_threads(args.threads)
    m = MoEModel.from_pretrained(args.gguf, device="cpu", progress=False)
    dec = m.model
    if not isinstance(dec.layers_step, NativeGptOssLayers):
        raise SystemExit(f"{args.gguf}: not a gpt-oss decoder on the one-call CPU step")
    if args.vocab:
        w = torch.randn(args.vocab, dec.lm_head.in_features, generator=torch.Generator().manual_seed(0)) * 0.05
        dec.lm_head = quantize_linear_cpu(w, bits=8)
    vocab = dec.lm_head.out_features
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, m.config.vocab_size), (1, 16), generator=gen)
    kw = dict(do_sample=False, eos_token_id=[])
    step = dec.layers_step
    real_logits = NativeGptOssLayers.logits

    def python_tail(self, *a, **k):  # the decoder then calls the step and runs its norm and head in Python
        return None

    def way(python: bool) -> None:
        step.logits = python_tail.__get__(step) if python else real_logits.__get__(step)

    def rep() -> tuple[float, float, list[int]]:
        with torch.inference_mode():
            c0 = time.process_time()
            m.generate(ids, max_new_tokens=1, **kw)
            c1 = time.process_time()
            out = m.generate(ids, max_new_tokens=args.tg + 1, **kw)
            c2 = time.process_time()
        return m.stats.tpot_s * 1e3, ((c2 - c1) - (c1 - c0)) / args.tg * 1e3, out[0, 16:].tolist()

    times = [uptime()]
    ways = {"tail": False, "python tail": True}
    tokens = {}
    for name, python in ways.items():  # warm-up, and each way's greedy tokens
        way(python)
        tokens[name] = rep()[2]
    res: dict[str, list] = {name: [] for name in ways}
    for _ in range(args.reps):
        for name, python in ways.items():
            way(python)
            res[name].append(rep()[:2])
    times.append(uptime())
    # the Python tail alone, on one token
    x = torch.randn(1, 1, dec.lm_head.in_features, generator=gen)
    with torch.inference_mode():
        for _ in range(20):
            dec.lm_head(dec.norm(x)).float()
        alone = []
        for _ in range(200):
            t0 = time.perf_counter()
            dec.lm_head(dec.norm(x)).float()
            alone.append((time.perf_counter() - t0) * 1e3)
    times.append(uptime())
    way(False)
    # one real decode step's call, captured, then replayed
    captured = []
    inner = cpu_layers_gpt_oss.gpt_oss_step

    def capture(*a, **k):
        captured.append((a, k))
        return inner(*a, **k)
    cpu_layers_gpt_oss.gpt_oss_step = capture
    try:
        with torch.inference_mode():
            m.generate(ids, max_new_tokens=2, **kw)
    finally:
        cpu_layers_gpt_oss.gpt_oss_step = inner
    a, k = captured[-1]
    replayed = replay(inner, a, k["head"], k["logits"], lambda out: dec.lm_head(dec.norm(out)).float(), args.calls)
    times.append(uptime())

    med = {name: {"wall_ms": statistics.median(r[0] for r in reps), "cpu_ms": statistics.median(r[1] for r in reps)}
           for name, reps in res.items()}
    saved_wall = med["python tail"]["wall_ms"] - med["tail"]["wall_ms"]
    saved_cpu = med["python tail"]["cpu_ms"] - med["tail"]["cpu_ms"]
    result = {"gguf": str(args.gguf), "threads": args.threads, "tg": args.tg, "reps": args.reps, "vocab": vocab,
              "hidden": dec.lm_head.in_features, "cpu": _cpu_name(), "uptime": times, "per_rep": res,
              "median": med, "python_tail_alone_ms": statistics.median(alone),
              "saved_wall_ms": saved_wall, "saved_cpu_ms": saved_cpu,
              "replayed_step_us": replayed, "greedy_tokens_equal": tokens["tail"] == tokens["python tail"]}
    lines = [f"# gpt-oss's decode step: the tail in the one call vs the tail in Python ({args.threads} thread(s))", "",
             f"`{args.gguf.name}`, lm_head int8 {vocab} x {dec.lm_head.in_features}"
             f"{' (random, --vocab)' if args.vocab else ''}; decode of {args.tg} tokens after 16; {args.reps} reps "
             f"alternated, medians. CPU: {_cpu_name()}.", "", "uptime: " + " | ".join(times), "",
             "| decode step | wall ms / token | CPU ms / token |", "|---|---|---|"]
    lines += [f"| {name} | {v['wall_ms']:.3f} | {v['cpu_ms']:.3f} |" for name, v in med.items()]
    lines += ["", f"Generate, tail in the one call minus Python tail, per token: {saved_wall * 1e3:.0f} us wall, "
              f"{saved_cpu * 1e3:.0f} us CPU saved (noise: compare the replay).", "",
              f"Replayed decode step (one captured call, {args.calls} calls per way interleaved, medians per call):",
              "",
              "| replayed | wall us / token | CPU us / token |", "|---|---|---|"]
    lines += [f"| {name} | {v['wall_us']:.0f} | {v['cpu_us']:.0f} |" for name, v in replayed.items()]
    lines += ["", f"Saved per token (python tail - one call): "
              f"{replayed['python tail']['wall_us'] - replayed['one call']['wall_us']:.0f} us wall, "
              f"{replayed['python tail']['cpu_us'] - replayed['one call']['cpu_us']:.0f} us CPU; the tail inside the "
              f"region costs (one call - layers) {replayed['one call']['wall_us'] - replayed['layers']['wall_us']:.0f}"
              f" us wall, {replayed['one call']['cpu_us'] - replayed['layers']['cpu_us']:.0f} us CPU.", "",
              f"The Python tail alone (`lm_head(norm(x))`, one token): {statistics.median(alone) * 1e3:.0f} us. "
              f"Greedy tokens equal: {result['greedy_tokens_equal']}."]
    write_report(args.out, result, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
