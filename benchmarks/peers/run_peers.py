"""Peer benchmark on the CPU (issue 21): llama.cpp Q4_0 / Q4_K_M, transformers eager fp32 / bf16 and moeflow
``device="cpu"`` (AWQ from ``moeflow quantize``) on one synthetic Mixtral-architecture model, in one run,
2 threads each. Decode (tg) and prefill (pp32, pp512) tokens per second. Not part of CI.

    python benchmarks/peers/run_peers.py --work /tmp/peers --out benchmarks/results/peers

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
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from synthetic_mixtral import CONFIG, parameter_count, write_checkpoint  # noqa: E402

THREADS = 2
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
                attention_bits: int | None = None) -> dict:
    """moeflow ``device="cpu"`` on the AWQ checkpoint (its default kernels: torch's int4 CPU kernel);
    ``attention_bits``: also quantize the 16-bit attention projections at load (as llama.cpp's Q4_0 does)."""
    from moeflow import MoEOffloadedMixtral

    extra = {"attention_bits": attention_bits} if attention_bits is not None else {}
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

    with torch.inference_mode():
        model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=4, do_sample=False, eos_token_id=[])
        return {"kernels": model.kernels, **_timed(prefill, decode, prompts, tg, reps, budget_s)}


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
        cells = [f"{r[f'pp{n}']:.1f}" if r.get(f"pp{n}") else "skipped" for n in prompts]
        ratio = f"{mf / r['tg']:.2f}x" if mf and r.get("tg") else ""
        lines.append(f"| {name} | {r.get('weights', '')} | " + " | ".join(cells) + f" | {r['tg']:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (build, checkpoints, GGUFs)")
    ap.add_argument("--out", type=Path, required=True, help="where peers.json and peers.md go")
    ap.add_argument("--prompts", default="32,512")
    ap.add_argument("--tg", type=int, default=32, help="decode tokens per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per prefill length and engine")
    ap.add_argument("--engines", default="llama.cpp,transformers-fp32,transformers-bf16,moeflow,moeflow-attn4")
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
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
    if "moeflow" in engines:
        runs.append(("moeflow cpu (AWQ)", "AWQ int4 experts, g128", lambda: moeflow_cpu(
            files["awq"], prompts, args.tg, args.reps, args.budget)))
    if "moeflow-attn4" in engines:
        runs.append(("moeflow cpu (AWQ, attention_bits=4)", "AWQ int4 experts, int4 attention, int8 lm_head",
                     lambda: moeflow_cpu(files["awq"], prompts, args.tg, args.reps, args.budget, attention_bits=4)))
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
