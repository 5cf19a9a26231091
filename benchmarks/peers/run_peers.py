"""Peer benchmark on the CPU (issue 21): llama.cpp Q4_0 / Q4_K_M, transformers eager fp32 / bf16 and moeflow
``device="cpu"`` (AWQ from ``moeflow quantize``) on one synthetic Mixtral-architecture model, in one run,
2 threads each. Decode (tg) and prefill (pp32, pp512) tokens per second. Not part of CI.

    python -m benchmarks.peers.run_peers --work /tmp/peers --out benchmarks/results/peers

Set-up (skipped when its output exists in --work): build llama.cpp from the llama-cpp-python sdist
(build_llama_cpp.sh), write the checkpoint (synthetic_mixtral.py), convert it with the vendored
convert_hf_to_gguf.py (bf16 GGUF), quantize to Q4_0 and Q4_K_M with llama-quantize, AWQ with
``moeflow quantize``. Then the timed part, with ``uptime`` before and after (the machine is shared).
Every engine is timed on random token ids (llama-bench's own for llama.cpp): prefill = prompt tokens /
time to the first token; decode = 1 / mean time per further token, greedy, no EOS stop.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.peers.synthetic_mixtral import CONFIG, parameter_count, write_checkpoint

HERE = Path(__file__).resolve().parent

THREADS = 2  # default; --threads
GGUF_TYPES = ("Q4_0", "Q4_K_M")


def sh(*cmd, **kw) -> str:
    """Run a command, fail loudly with its output, return its stdout."""
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({res.returncode}):\n{res.stdout[-3000:]}\n"
                           f"{res.stderr[-3000:]}")
    return res.stdout


def set_up(work: Path) -> dict[str, Path]:
    """Build llama.cpp and write every model file the timed part reads (each step skipped when done)."""
    bin_dir = work / "llama.cpp" / "build" / "bin"
    if not (bin_dir / "llama-bench").is_file() or not (bin_dir / "llama-quantize").is_file():
        sh("bash", HERE / "build_llama_cpp.sh", work)
    hf = write_checkpoint(work / "hf")
    files = {"hf": hf, "bench": bin_dir / "llama-bench"}
    bf16 = work / "mixtral-synth-bf16.gguf"
    if not bf16.is_file():
        sh(sys.executable, work / "llama.cpp" / "convert_hf_to_gguf.py", hf, "--outfile", bf16, "--outtype", "bf16")
    for kind in GGUF_TYPES:
        files[kind] = work / f"mixtral-synth-{kind}.gguf"
        if not files[kind].is_file():
            sh(bin_dir / "llama-quantize", bf16, files[kind], kind, THREADS)
    files["awq"] = work / "awq"
    if not (files["awq"] / "config.json").is_file():
        sh(sys.executable, "-m", "moeflow", "quantize", hf, files["awq"])
    return files


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def llama_cpp_decode_cpu_ms(bench: Path, gguf: Path, tg: int, reps: int) -> float:
    """CPU milliseconds per decoded token (one thread: a rate the machine's other load barely moves): the CPU
    time of ``llama-bench -n tg+1`` minus that of ``-n 1`` (same load, warm-up and single token), per token."""
    def cpu(n: int) -> float:
        c0 = _child_cpu_s()
        sh(bench, "-m", gguf, "-t", 1, "-p", 0, "-n", n, "-r", reps, "-o", "json")
        return _child_cpu_s() - c0
    return (cpu(tg + 1) - cpu(1)) / (tg * reps) * 1e3


def llama_cpp_prefill_cpu_ms(bench: Path, gguf: Path, prompt: int, reps: int) -> float:
    """CPU milliseconds per prompt of ``prompt`` tokens on one thread: ``-r 2*reps`` minus ``-r reps`` (the
    load and warm-up cancel)."""
    def cpu(r: int) -> float:
        c0 = _child_cpu_s()
        sh(bench, "-m", gguf, "-t", 1, "-p", prompt, "-n", 0, "-r", r, "-o", "json")
        return _child_cpu_s() - c0
    return (cpu(2 * reps) - cpu(reps)) / reps * 1e3


def llama_cpp(bench: Path, gguf: Path, prompts: list[int], tg: int, reps: int) -> dict:
    """llama-bench on one GGUF: mean tok/s (and std) of pp<N> and tg<tg> over ``reps`` repetitions."""
    out = json.loads(sh(bench, "-m", gguf, "-t", THREADS, "-p", ",".join(map(str, prompts)), "-n", tg,
                        "-r", reps, "-o", "json"))
    version = bench.parents[2] / "LLAMA_CPP_PYTHON_VERSION"
    res = {"build": out[0].get("build_commit"), "file_bytes": gguf.stat().st_size,
           "llama_cpp_python_sdist": version.read_text().strip() if version.is_file() else None}
    for row in out:
        key = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else "tg"
        res[key] = row["avg_ts"]
        res[key + "_std"] = row["stddev_ts"]
    return res


def _median_rate(fn, tokens: int, reps: int) -> float:
    return statistics.median(tokens / fn() for _ in range(reps))


def transformers_eager(hf: Path, dtype: torch.dtype, prompts: list[int], tg: int, reps: int,
                       budget_s: float) -> dict:
    """transformers' MixtralForCausalLM, eager attention, KV cache, greedy decode by hand."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(hf, dtype=dtype, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(0)
    res: dict = {}

    def prefill(n: int) -> float:
        ids = torch.randint(3, CONFIG["vocab_size"], (1, n), generator=gen)
        t0 = time.perf_counter()
        model(ids, use_cache=True)
        return time.perf_counter() - t0

    def decode() -> float:
        ids = torch.randint(3, CONFIG["vocab_size"], (1, prompts[0]), generator=gen)
        out = model(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(tg):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / tg

    with torch.inference_mode():
        prefill(8)
        res.update(_timed(prefill, decode, prompts, tg, reps, budget_s))
    return res


def moeflow_cpu(awq: Path, prompts: list[int], tg: int, reps: int, budget_s: float,
                attention_bits: int | None = None, cpu_time: bool = False, lm_head_bits: int = 8) -> dict:
    """moeflow ``device="cpu"`` on the AWQ checkpoint (its default kernels: torch's int4 CPU kernel);
    ``attention_bits``: also quantize the 16-bit attention projections at load (as llama.cpp's Q4_0 does);
    ``lm_head_bits=4``: the int4 lm_head (top logits recomputed in int8)."""
    from moeflow import MoEOffloadedMixtral

    extra = {"attention_bits": attention_bits} if attention_bits is not None else {}
    if lm_head_bits != 8:
        extra["lm_head_bits"] = lm_head_bits
    model = MoEOffloadedMixtral.from_pretrained(awq, device="cpu", **extra)
    gen = torch.Generator().manual_seed(0)

    def prefill(n: int) -> float:
        ids = torch.randint(3, CONFIG["vocab_size"], (1, n), generator=gen)
        model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=[])
        return model.stats.ttft_s

    def decode() -> float:
        ids = torch.randint(3, CONFIG["vocab_size"], (1, prompts[0]), generator=gen)
        model.generate(ids, max_new_tokens=tg + 1, do_sample=False, eos_token_id=[])
        return model.stats.tpot_s

    def decode_cpu_ms() -> float:  # CPU ms per decode step on one thread: generate(tg + 1) minus generate(1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        ids = torch.randint(3, CONFIG["vocab_size"], (1, prompts[0]), generator=gen)
        cpu = []
        for n in (1, tg + 1):
            c0 = time.process_time()
            for _ in range(reps):
                model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
            cpu.append(time.process_time() - c0)
        torch.set_num_threads(threads)
        return (cpu[1] - cpu[0]) / (tg * reps) * 1e3

    def prefill_cpu_ms() -> float:  # CPU ms per prompt of prompts[0] tokens (and its first token) on one thread
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        ids = torch.randint(3, CONFIG["vocab_size"], (1, prompts[0]), generator=gen)
        c0 = time.process_time()
        for _ in range(reps):
            model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=[])
        torch.set_num_threads(threads)
        return (time.process_time() - c0) / reps * 1e3

    with torch.inference_mode():
        model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=4, do_sample=False, eos_token_id=[])
        res = {"kernels": model.kernels, **_timed(prefill, decode, prompts, tg, reps, budget_s)}
        if cpu_time:
            res["decode_cpu_ms_1thread"] = decode_cpu_ms()
            res[f"pp{prompts[0]}_cpu_ms_1thread"] = prefill_cpu_ms()
        return res


def moeflow_in_tree(tree: Path, args: argparse.Namespace, attention_bits: int | None) -> dict:
    """:func:`moeflow_cpu` with the moeflow of another source tree (the branch point), in a child process."""
    code = (f"import json, torch; torch.set_num_threads({THREADS}); "
            f"from benchmarks.peers.run_peers import moeflow_cpu; from pathlib import Path; "
            f"print('RESULT', json.dumps(moeflow_cpu(Path({str(args.work / 'awq')!r}), {args.prompts_list!r}, "
            f"{args.tg}, {args.reps}, {args.budget}, {attention_bits!r}, {args.cpu_time!r})))")
    # moeflow from ``tree``; ``benchmarks`` from ``tree`` when it is a package there, else from this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE.parents[1])])}
    out = sh(sys.executable, "-c", code, env=env, cwd=tree)
    res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    res["tree"] = str(tree)
    res["commit"] = sh("git", "-C", tree, "rev-parse", "--short", "HEAD").strip()
    return res


def _timed(prefill, decode, prompts: list[int], tg: int, reps: int, budget_s: float) -> dict:
    """Median tok/s of ``reps`` prefills per prompt length and decodes; a length whose estimated time (from
    the shorter one) exceeds ``budget_s`` is skipped and marked so."""
    res: dict = {}
    rate = None
    for n in prompts:
        if rate is not None and n / rate * reps > budget_s:
            res[f"pp{n}"] = None
            res[f"pp{n}_skipped"] = f"estimated {n / rate * reps:.0f} s > budget {budget_s:.0f} s"
            continue
        rate = _median_rate(lambda n=n: prefill(n), n, reps)
        res[f"pp{n}"] = rate
    res["tg"] = statistics.median(1.0 / decode() for _ in range(reps))
    return res


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "logical_cpus": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version()}


def markdown(result: dict) -> str:
    prompts = result["prompts"]
    head = "| engine | weights | " + " | ".join(f"pp{n} tok/s" for n in prompts) + f" | tg{result['tg']} tok/s |" \
        " moeflow tg / this |"
    lines = [head, "|" + "---|" * (len(prompts) + 4)]
    mf = result["engines"].get("moeflow cpu (AWQ)", {}).get("tg")
    for name, r in result["engines"].items():
        if "error" in r:
            lines.append(f"| {name} | | " + " | ".join("error" for _ in prompts) + f" | {r['error'][:60]} | |")
            continue
        if "tg" not in r:  # a CPU-time-only row
            pp_cpu = r.get(f"pp{prompts[0]}_cpu_ms_1thread")
            lines.append(f"| {name} | {r.get('weights', '')} | " +
                         " | ".join([f"{pp_cpu:.0f} ms CPU / prompt" if pp_cpu else ""] + ["" for _ in prompts[1:]]) +
                         f" | {r.get('decode_cpu_ms_1thread', 0):.2f} ms CPU / token | |")
            continue
        cells = [f"{r[f'pp{n}']:.1f}" if r.get(f"pp{n}") else "skipped" for n in prompts]
        ratio = f"{mf / r['tg']:.2f}x" if mf and r.get("tg") else ""
        cpu = f" ({r['decode_cpu_ms_1thread']:.2f} ms CPU / token, 1 thread)" if r.get("decode_cpu_ms_1thread") else ""
        pp_cpu = r.get(f"pp{prompts[0]}_cpu_ms_1thread")
        if pp_cpu:
            cells[0] += f" ({pp_cpu:.0f} ms CPU / prompt)"
        lines.append(f"| {name} | {r.get('weights', '')} | " + " | ".join(cells) + f" | {r['tg']:.1f}{cpu} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    global THREADS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (build, checkpoints, GGUFs)")
    ap.add_argument("--out", type=Path, required=True, help="where peers.json and peers.md go")
    ap.add_argument("--prompts", default="32,512")
    ap.add_argument("--tg", type=int, default=32, help="decode tokens per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per prefill length and engine")
    ap.add_argument("--engines", default="llama.cpp,transformers-fp32,transformers-bf16,moeflow,moeflow-attn4,"
                                         "moeflow-attn4-lm4")
    ap.add_argument("--threads", type=int, default=THREADS, help="threads of every engine")
    ap.add_argument("--before-tree", type=Path, default=None,
                    help="also run moeflow (and moeflow-attn4) from this source tree (the branch point), same run")
    ap.add_argument("--cpu-time", action="store_true",
                    help="also measure CPU ms per decoded token on one thread (llama.cpp Q4_0 and moeflow)")
    args = ap.parse_args()
    THREADS = args.threads
    prompts = [int(p) for p in args.prompts.split(",")]
    args.prompts_list = prompts
    engines = args.engines.split(",")
    torch.set_num_threads(THREADS)
    files = set_up(args.work)

    result = {"model": {**CONFIG, "parameters": parameter_count()}, "threads": THREADS, "prompts": prompts,
              "tg": args.tg, "reps": args.reps, "machine": machine(), "uptime_before": sh("uptime").strip(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "engines": {}}
    runs = []
    if "llama.cpp" in engines:
        for kind in GGUF_TYPES:
            runs.append((f"llama.cpp {kind}", kind, lambda k=kind: llama_cpp(files["bench"], files[k], prompts,
                                                                               args.tg, args.reps)))
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        if f"transformers-{name}" in engines:
            runs.append((f"transformers eager {name}", name, lambda dt=dt: transformers_eager(
                files["hf"], dt, prompts, args.tg, args.reps, args.budget)))
    if args.cpu_time and "llama.cpp" in engines:
        runs.append(("llama.cpp Q4_0 decode CPU ms (1 thread)", "Q4_0", lambda: {
            "decode_cpu_ms_1thread": llama_cpp_decode_cpu_ms(files["bench"], files["Q4_0"], args.tg, args.reps),
            f"pp{prompts[0]}_cpu_ms_1thread": llama_cpp_prefill_cpu_ms(files["bench"], files["Q4_0"], prompts[0],
                                                                        args.reps)}))
    for tree, tag in ((args.before_tree, " before"), (None, "")):
        if tree is None and tag:
            continue
        for engine, bits, head, name, weights in (
                ("moeflow", None, 8, "moeflow cpu (AWQ)", "AWQ int4 experts, g128"),
                ("moeflow-attn4", 4, 8, "moeflow cpu (AWQ, attention_bits=4)",
                 "AWQ int4 experts, int4 attention, int8 lm_head"),
                ("moeflow-attn4-lm4", 4, 4, "moeflow cpu (AWQ, attention_bits=4, lm_head_bits=4)",
                 "AWQ int4 experts, int4 attention, int4 lm_head (top 16 in int8)")):
            if engine not in engines or (tree is not None and head != 8):
                continue
            if tree is None:
                runs.append((name, weights, lambda b=bits, h=head: moeflow_cpu(
                    files["awq"], prompts, args.tg, args.reps, args.budget, b, args.cpu_time, h)))
            else:
                runs.append((name + tag, weights, lambda b=bits, t=tree: moeflow_in_tree(t, args, b)))
    for name, weights, fn in runs:
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - one failing engine must not lose the others' numbers
            r = {"error": f"{type(e).__name__}: {e}"}
        r.update(weights=weights, wall_s=round(time.perf_counter() - t0, 1), uptime_after=sh("uptime").strip())
        result["engines"][name] = r
        gc.collect()  # the engine's model is gone with its function's frame
        print(name, r, flush=True)
    result["uptime_after"] = sh("uptime").strip()

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (args.out / "peers.md").write_text(
        f"Run {result['date']} on {result['machine']['cpu']} ({result['machine']['torch_cpu_capability']}), "
        f"{THREADS} threads each, torch {torch.__version__}.\n\nuptime before: `{result['uptime_before']}`  \n"
        f"uptime after: `{result['uptime_after']}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
