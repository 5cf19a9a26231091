"""moeflow ``device="cpu"`` (two source trees: before / after) beside llama.cpp on a GGUF, alternating rep by rep in
one run (issue 21): decode tok/s, pp32 tok/s and CPU ms per decoded token, at one thread count.

Each moeflow engine runs in its own worker process (``PYTHONPATH=<tree>``, the model loaded once: the peer
benchmark's AWQ synthetic Mixtral from ``<work>/<checkpoint>``, ``attention_bits`` and ``lm_head_bits`` as
asked); each rep asks every worker
for one measurement, then runs ``llama-bench`` (``--llama-gguf``, default the Q4_0 GGUF; the same thread count), so
the shared machine's load
hits all alike. Per rep and engine:

* decode: moeflow 1 / TPOT of ``generate(prompt 16, tg + 1 tokens)``; llama.cpp ``llama-bench -p 0 -n tg`` t/s;
* pp32: moeflow 32 / TTFT of ``generate(prompt 32, 1 token)``; llama.cpp ``-p 32 -n 0`` t/s;
* CPU ms per decoded token: CPU time of tg + 1 tokens minus that of 1 token, per token (moeflow: the worker's
  process time; llama.cpp: ``-n tg+1`` minus ``-n 1``, child rusage) - the figure the machine's load moves least
  at one thread.

Medians over reps, ``uptime`` before, between and after; a roofline line per engine (weight bytes per decoded
token x tok/s against ``read_probe.c``'s GB/s, run before and after the reps: ``decode_roofline.py``).
``--trees label=path[:checkpoint[:attention_bits[:lm_head_bits]]]`` (repeatable; checkpoint: a folder or file
under ``--work``, default ``awq``; attention_bits: ``auto``, ``none``, 8 or 4, default ``--attention-bits``;
lm_head_bits 8 or 4, default ``--lm-head-bits``): e.g. one engine on a ``--quantize-attention`` checkpoint and one
on the default (16-bit attention) checkpoint with the library's default, in the same alternation.

    python -m benchmarks.peers.cpu_side_by_side --work /tmp/peers --threads 1 --reps 7 \\
        --trees before=/work/main --trees after=. --out benchmarks/results/peers/s12/side_t1

The same Q4_K_M file on both sides (moeflow's GGUF K-quant CPU kernels; the file made by ``llama-quantize
mixtral-synth-bf16.gguf <work>/mixtral-synth-Q4_K_M.gguf Q4_K_M``):

    python -m benchmarks.peers.cpu_side_by_side --work /tmp/kquant_peers --llama-bin /tmp/peers/llama.cpp/build/bin \
        --llama-gguf mixtral-synth-Q4_K_M.gguf --trees q4_k_m=.:mixtral-synth-Q4_K_M.gguf:auto --threads 1 \
        --out benchmarks/results/peers/s15/kquant_same_file_t1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from benchmarks.peers.peer_report import uptime, write_report

HERE = Path(__file__).resolve()


def _roofline() -> ModuleType:
    """This checkout's decode_roofline.py, by its path (a worker's ``benchmarks`` package may be another tree's)."""
    spec = importlib.util.spec_from_file_location("decode_roofline", HERE.with_name("decode_roofline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bits(text: str) -> int | str | None:
    return None if text == "none" else text if text == "auto" else int(text)


def worker(model: Path, threads: int, lm_head_bits: int, tg: int, attention_bits: int | str | None) -> None:
    """Load the model, then answer every line on stdin with one measurement (a JSON line)."""
    import torch

    from moeflow import MoEModel  # (any family: a gpt-oss GGUF too)

    torch.set_num_threads(threads)
    m = MoEModel.from_pretrained(model, device="cpu", attention_bits=attention_bits,
                                 lm_head_bits=lm_head_bits, progress=False)
    from moeflow.kernels.cpu.native import library
    gen = torch.Generator().manual_seed(0)
    decode_ids = torch.randint(3, m.config.vocab_size, (1, 16), generator=gen)
    prompt_ids = torch.randint(3, m.config.vocab_size, (1, 32), generator=gen)
    kw = dict(do_sample=False, eos_token_id=[])
    try:  # steady-state decode: the weights' move onto huge pages (a background thread since session 18) done
        from moeflow.kernels.cpu.hugepages import wait_collapsed
        wait_collapsed(120)
    except ImportError:  # (an older tree: no deferred collapse)
        pass
    with torch.inference_mode():
        tokens = m.generate(decode_ids, max_new_tokens=tg + 1, **kw)[0, 16:].tolist()  # warm-up
        m.generate(prompt_ids, max_new_tokens=1, **kw)
        lib = library()
        one_call = getattr(m.model, "layers_step", getattr(m.model, "native_layers", None))  # (older trees' name)
        try:
            per_token = _roofline().moeflow_bytes(m)["total"]
        except (AttributeError, ImportError, TypeError):  # (a tree whose layers do not take the one call)
            per_token = None
        print(json.dumps({"ready": True, "native_layers": one_call is not None, "bytes_per_token": per_token,
                          "simd": {0: "scalar", 1: "avx2", 2: "avx512-vnni"}[lib.mf_simd()] if lib else None,
                          "greedy_tokens": tokens}), flush=True)
        for _ in sys.stdin:
            c0 = time.process_time()
            m.generate(decode_ids, max_new_tokens=1, **kw)
            c1 = time.process_time()
            m.generate(decode_ids, max_new_tokens=tg + 1, **kw)
            c2 = time.process_time()
            tpot = m.stats.tpot_s
            m.generate(prompt_ids, max_new_tokens=1, **kw)
            print(json.dumps({"decode_tok_s": 1 / tpot, "pp32_tok_s": 32 / m.stats.ttft_s,
                              "cpu_ms": ((c2 - c1) - (c1 - c0)) / tg * 1e3}), flush=True)


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def llama_rep(bench: Path, gguf: Path, threads: int, tg: int) -> dict:
    """One rep of llama-bench: tg and pp32 t/s, and CPU ms per decoded token."""
    def run(*args) -> tuple[list, float]:
        c0 = _child_cpu_s()
        out = subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out), _child_cpu_s() - c0
    rows, _ = run("-p", "32", "-n", str(tg))
    rate = {("pp32" if r["n_gen"] == 0 else "decode") + "_tok_s": r["avg_ts"] for r in rows}
    _, one = run("-p", "0", "-n", "1")
    _, full = run("-p", "0", "-n", str(tg + 1))
    return {**rate, "cpu_ms": (full - one) / tg * 1e3, "build": rows[0].get("build_commit")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/peers"), help="run_peers.py's directory (awq/, GGUFs)")
    ap.add_argument("--out", type=Path, help="output prefix (.json and .md are added)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lm-head-bits", type=int, default=8)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--trees", action="append", default=[],
                    help="label=path[:checkpoint[:attention_bits]] of a moeflow source tree")
    ap.add_argument("--tree-env", action="append", default=[],
                    help="label:VAR=VALUE, an environment variable for that tree's worker only (e.g. GOMP_SPINCOUNT)")
    ap.add_argument("--checkpoint", default="awq", help="(worker) the checkpoint folder under --work")
    ap.add_argument("--attention-bits", default="4", help="auto, none, 8 or 4 (the default of --trees)")
    ap.add_argument("--llama-bin", type=Path, help="llama-bench's folder (default <work>/llama.cpp/build/bin)")
    ap.add_argument("--llama-gguf", default="mixtral-synth-Q4_0.gguf", help="the GGUF under --work llama.cpp runs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.work / args.checkpoint, args.threads, args.lm_head_bits, args.tg,
                      _bits(args.attention_bits))
    # label=spec split at the last "=": a label may hold one, a path does not
    specs = dict(t.rsplit("=", 1) for t in args.trees) or {"this tree": str(HERE.parents[2])}
    engines_spec = {}
    for label, spec in specs.items():
        parts = spec.split(":")
        tree, ckpt, bits, head = (parts + ["awq", args.attention_bits, str(args.lm_head_bits)][len(parts) - 1:])[:4]
        engines_spec[label] = (tree, ckpt or "awq", bits or args.attention_bits, head or str(args.lm_head_bits))
    tree_env: dict[str, dict[str, str]] = {}
    for item in args.tree_env:
        label, assignment = item.split(":", 1)
        var, value = assignment.split("=", 1)
        tree_env.setdefault(label, {})[var] = value
    bench = (args.llama_bin or args.work / "llama.cpp/build/bin") / "llama-bench"
    gguf = args.work / args.llama_gguf
    peer = "llama.cpp " + gguf.stem.rsplit("-", 1)[-1]  # "llama.cpp Q4_0"
    loads = [uptime()]
    roofline = _roofline()
    probes = [roofline.probe_gbps(args.threads)[args.threads]]  # the read roofline, before and after the reps
    workers, info = {}, {}
    for label, (tree, ckpt, bits, head) in engines_spec.items():
        # moeflow from ``tree``; ``benchmarks`` (peer_report) from this checkout unless ``tree`` has it as a package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tree).resolve()), str(HERE.parents[2])]),
               "OMP_NUM_THREADS": str(args.threads), **tree_env.get(label, {})}
        p = subprocess.Popen([sys.executable, str(HERE), "--worker", "--work", str(args.work), "--threads",
                              str(args.threads), "--lm-head-bits", head, "--tg", str(args.tg),
                              "--checkpoint", ckpt, "--attention-bits", bits],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        workers[label] = p
        info[label] = {"tree": str(Path(tree).resolve()), "checkpoint": ckpt, "attention_bits": bits,
                       "lm_head_bits": int(head),
                       "env": tree_env.get(label, {}),
                       **json.loads(p.stdout.readline())}
    engines = [*workers, peer]
    samples: dict[str, list[dict]] = {e: [] for e in engines}
    try:
        for _ in range(args.reps):
            for label, p in workers.items():
                p.stdin.write("go\n")
                p.stdin.flush()
                samples[label].append(json.loads(p.stdout.readline()))
            samples[peer].append(llama_rep(bench, gguf, args.threads, args.tg))
            loads.append(uptime())
    finally:
        for p in workers.values():
            p.stdin.close()
            p.wait()
    probes.append(roofline.probe_gbps(args.threads)[args.threads])
    per_token = {**{e: i.get("bytes_per_token") for e, i in info.items()}, peer: roofline.gguf_bytes(gguf)["total"]}
    # per checkpoint: the trees on one checkpoint give the same greedy tokens
    same = all(len({tuple(i["greedy_tokens"]) for i in info.values() if i["checkpoint"] == c}) == 1
               for c in {i["checkpoint"] for i in info.values()})
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    flags = sorted({f for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
                    for f in ln.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c", "amx"))})
    keys = ("decode_tok_s", "pp32_tok_s", "cpu_ms")
    med = {e: {k: statistics.median(s[k] for s in samples[e]) for k in keys} for e in engines}
    ref = med[peer]
    ratios = {e: {"decode": med[e]["decode_tok_s"] / ref["decode_tok_s"], "pp32": med[e]["pp32_tok_s"] /
                  ref["pp32_tok_s"], "decode_by_cpu_ms": ref["cpu_ms"] / med[e]["cpu_ms"]} for e in workers}
    res = {"threads": args.threads, "lm_head_bits": args.lm_head_bits, "cpu": cpu, "cpu_flags": flags,
           "nproc": os.cpu_count(), "tg": args.tg,
           "reps": args.reps, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "uptime": loads,
           "trees": info, "same_greedy_tokens": same, "llama_cpp_build": samples[peer][0]["build"],
           "llama_cpp_gguf": str(gguf), "samples": samples, "median": med, "ratios_vs_llama_cpp": ratios,
           "read_probe_gbps": probes, "weight_bytes_per_token": per_token}
    probe = max(probes)  # the machine's best read rate seen in the run (the load lowers either)
    lines = [f"moeflow `device=\"cpu\"` beside {peer} (`{gguf.name}`), "
             f"{args.threads} thread(s), alternating, median of {args.reps} reps, {res['date']}.",
             "", f"CPU: {cpu} ({os.cpu_count()} cores seen), flags: {' '.join(flags)}  ",
             *[f"engine `{e}`: checkpoint `{i['checkpoint']}`, attention_bits={i['attention_bits']}, "
               f"lm_head_bits={i['lm_head_bits']}, kernels "
               f"{i.get('simd')}" + "".join(f", {k}={v}" for k, v in i["env"].items()) + "  "
               for e, i in info.items()],
             *[f"uptime: `{u}`  " for u in (loads[0], loads[len(loads) // 2], loads[-1])],
             f"greedy tokens (prompt 16, {args.tg + 1} new) identical across the trees on each checkpoint: {same}",
             f"read probe (read_probe.c, {args.threads} thread(s), before / after the reps): "
             f"{probes[0]:.1f} / {probes[1]:.1f} GB/s  ", "", "Roofline (weight bytes per decoded token x median "
             "decode tok/s against the probe's best; decode_roofline.py):", "",
             *[f"* {roofline.roofline_line(e, med[e]['decode_tok_s'], per_token[e], probe)}"
               for e in engines if per_token.get(e)], "",
             "| engine | decode tok/s | pp32 tok/s | CPU ms / decoded token | decode vs llama.cpp (tok/s; by CPU ms) "
             "| pp32 vs llama.cpp |", "|---|---|---|---|---|---|"]
    for e in engines:
        m, r = med[e], ratios.get(e)
        vs = f"{r['decode']:.2f}x; {r['decode_by_cpu_ms']:.2f}x | {r['pp32']:.2f}x" if r else "1.00x | 1.00x"
        lines.append(f"| {e} | {m['decode_tok_s']:.1f} | {m['pp32_tok_s']:.1f} | {m['cpu_ms']:.2f} | {vs} |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
