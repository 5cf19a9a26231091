"""GPU peers in the same run (issue 12, item 5): llama.cpp (CUDA, Q4_0 GGUF) and transformers + accelerate
offload (fp16) against moeflow (AWQ from ``moeflow quantize``), all on the same few-layer Mixtral-8x7B-shaped
synthetic model and at the same number of experts held on the GPU.

Two phases (``--phase prep`` and ``--phase bench``; ``all`` = both), each skipping what already exists in --work:

* prep: builds llama.cpp's llama-bench and llama-quantize with CUDA (sm_90 only, no FlashAttention kernels: the
  fewest CUDA template instances; started first, in the background: llama_cpp_build.py) from the subset that
  gpu_peer_sources.sh copied to .peers/llama.cpp; writes the model with transformers' own MixtralForCausalLM +
  save_pretrained (bf16, random weights, a sentencepiece tokenizer trained on the repository's Markdown:
  synthetic_mixtral.py); converts it with the subset's convert_hf_to_gguf.py (bf16 GGUF), quantizes to Q4_0
  with llama-quantize (the bf16 GGUF is then deleted: disk) and, meanwhile, AWQ-quantizes the same weights with
  ``moeflow quantize``.
* bench: prefill (pp<N>) and decode (tg<N>) tokens per second. llama.cpp: ``llama-bench -ngl 99`` with
  ``--n-cpu-moe k`` for k in --cpu-moe-layers (k = 0: every expert on the GPU); its CPU experts run on the CPU
  threads. moeflow at the same GPU budget: ``gpu_expert_slots = (layers - k) * experts`` (one slot = one
  expert; Q4_0 and AWQ g128 experts are ~the same bytes), policy lru (experts stream over PCIe) and lru with
  ``cpu_compute="auto"`` (a missed expert may run on the CPU, as llama.cpp's CPU experts do), and resident for
  k = 0. transformers + accelerate: ``device_map="auto"`` with ``max_memory`` giving the GPU the fp16 bytes of
  the same share of experts (whole decoder layers: accelerate does not split one). Ratios moeflow / peer per
  budget go to the JSON and the Markdown table.

Results: --out/peers_gpu.json after every measurement, and peers_gpu.md. ``--tiny``: a tiny model on the CPU with
a CPU llama.cpp build (--llama-build, e.g. /tmp/peers/llama.cpp/build of build_llama_cpp.sh): the plumbing.

    python -m benchmarks.peers.run_gpu_peers --phase all --work /tmp/moeflow-peers --out $OUT/peers
    python -m benchmarks.peers.run_gpu_peers --tiny --phase all --llama-build /tmp/peers/llama.cpp/build \
        --work /tmp/peers-tiny --out /tmp/peers-tiny/out
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.peers.llama_cpp_build import runtime_env, start_build
from benchmarks.peers.synthetic_mixtral import train_tokenizer

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

SOURCES = REPO / ".peers" / "llama.cpp"  # benchmarks/peers/gpu_peer_sources.sh
MIXTRAL_8X7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
    rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
TINY = {**MIXTRAL_8X7B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4}


def sh(*cmd, timeout: float | None = None, **kw) -> str:
    """Run a command; fail loudly with the end of its output; return its stdout."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if done.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout


def write_hf(out: Path, config: dict, seed: int = 0) -> Path:
    """The bf16 HF checkpoint (transformers' MixtralForCausalLM, its own init, seeded) + sentencepiece tokenizer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if out.is_dir():
        return out
    final, out = out, out.with_name(out.name + ".part")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the host memory and time of fp32 then a cast
    try:
        model = MixtralForCausalLM(MixtralConfig(**config))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    train_tokenizer(out)
    return out.rename(final)


class Report:
    """The JSON written after every measurement (a run cut short keeps what it measured)."""

    def __init__(self, out: Path, head: dict, prep_file: Path):
        self.out, self.prep_file, self.data = out, prep_file, {**head, "prep": {}, "rows": []}
        self.t0 = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        if prep_file.is_file():  # the prep phase's timings, from an earlier command on the same machine
            self.data["prep"] = json.loads(prep_file.read_text())

    def save(self) -> None:
        self.prep_file.parent.mkdir(parents=True, exist_ok=True)
        self.prep_file.write_text(json.dumps(self.data["prep"], indent=1))
        (self.out / "peers_gpu.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "peers_gpu.md").write_text(markdown(self.data))

    def step(self, name: str, fn):
        """Time ``fn`` as prep step ``name``; a failure is recorded, not raised."""
        t0 = time.perf_counter()
        try:
            value = fn()
            self.data["prep"][name] = {"s": round(time.perf_counter() - t0, 1)}
        except Exception as e:  # noqa: BLE001 - the other steps and engines go on
            value = None
            self.data["prep"][name] = {"s": round(time.perf_counter() - t0, 1), "error": f"{type(e).__name__}: {e}"}
        # steps overlap (the build, the conversion and moeflow quantize run at once): when each ended
        self.data["prep"][name]["done_at_s"] = round(time.perf_counter() - self.t0, 1)
        print(f"prep {name}: {self.data['prep'][name]}", flush=True)
        self.save()
        return value

    def row(self, engine: str, gpu_experts: int, fn, **info) -> None:
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        r = {"engine": engine, "gpu_experts": gpu_experts, **info, **r, "wall_s": round(time.perf_counter() - t0, 1)}
        self.data["rows"].append(r)
        print(json.dumps(r, default=str), flush=True)
        self.save()


def prepare(args: argparse.Namespace, report: Report) -> dict[str, Path]:
    """Build llama.cpp (CUDA, background), write the HF model, convert + quantize it both ways (skips what exists)."""
    work, config = args.work, args.config
    work.mkdir(parents=True, exist_ok=True)
    files = {"hf": work / "hf", "q4_0": work / "mixtral-synth-Q4_0.gguf", "awq": work / "awq",
             "bench": args.llama_build / "bin" / "llama-bench", "quantize": args.llama_build / "bin" / "llama-quantize"}
    build = None
    if args.tiny:
        if not files["bench"].is_file() and "llama.cpp" in args.engines:
            args.engines.remove("llama.cpp")
            report.data["llama_cpp_skipped"] = (f"{files['bench']} is not built (--tiny uses a CPU llama.cpp: "
                                                "benchmarks/peers/build_llama_cpp.sh WORKDIR); llama.cpp skipped")
            print(report.data["llama_cpp_skipped"], flush=True)
    else:
        t_build = time.perf_counter()
        build = report.step("build_start", lambda: start_build(args.sources, args.llama_build, args.flash_attn,
                                                               os.cpu_count() or 16, work / "build.log"))
    if not files["hf"].is_dir():
        report.step("write_hf", lambda: write_hf(files["hf"], config))
    # every output is written under a .part name and renamed when complete: a command cut short by its limit
    # leaves nothing that looks done, and the next command redoes that step
    bf16 = work / "mixtral-synth-bf16.gguf"
    procs = {}  # name -> (process, log, the .part output, its final name)
    peer_gguf = "llama.cpp" in args.engines
    if peer_gguf and not files["q4_0"].is_file() and not bf16.is_file():
        part = bf16.with_suffix(".part")
        procs["convert_gguf"] = (subprocess.Popen(
            [sys.executable, str(args.sources / "convert_hf_to_gguf.py"), str(files["hf"]), "--outfile", str(part),
             "--outtype", "bf16"], stdout=(work / "convert.log").open("w"), stderr=subprocess.STDOUT),
            work / "convert.log", part, bf16)
    if not files["awq"].is_dir():  # at the same time (CPU-bound, both)
        part = work / "awq.part"
        procs["moeflow_quantize"] = (subprocess.Popen(
            [sys.executable, "-m", "moeflow", "quantize", "--overwrite", str(files["hf"]), str(part)],
            stdout=(work / "moeflow_quantize.log").open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}),
            work / "moeflow_quantize.log", part, files["awq"])
    for name, (proc, log, part, final) in procs.items():
        report.step(name, lambda p=proc, lg=log, a=part, b=final: (_wait(p, lg), a.rename(b)))
    if build is not None:
        report.step("build", lambda: _wait(build, work / "build.log"))
        report.data["prep"]["build"]["since_start_s"] = round(time.perf_counter() - t_build, 1)
    if peer_gguf and not files["q4_0"].is_file():
        part = files["q4_0"].with_suffix(".part")
        report.step("quantize_q4_0", lambda: (
            sh(files["quantize"], bf16, part, "Q4_0", os.cpu_count(), env=runtime_env()), part.rename(files["q4_0"])))
        if files["q4_0"].is_file():
            bf16.unlink(missing_ok=True)  # disk: the stage-3 checkpoint may be beside it
    report.data["files"] = {k: str(v) for k, v in files.items()}
    report.data["files_bytes"] = {k: _bytes(files[k]) for k in ("hf", "q4_0", "awq")}
    report.save()
    return files


def _wait(proc: subprocess.Popen, log: Path) -> None:
    if proc.wait():
        raise RuntimeError(f"rc={proc.returncode}; end of {log}:\n{log.read_text(errors='ignore')[-2500:]}")


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


# ------------------------------------------------------------------------------------------------ the peers
def llama_bench(bench: Path, gguf: Path, n_cpu_moe: int, prompt: int, tg: int, reps: int, threads: int) -> dict:
    """llama-bench -ngl 99 --n-cpu-moe k: mean (and std) tok/s of pp<prompt> and tg<tg>."""
    rows = json.loads(sh(bench, "-m", gguf, "-ngl", 99, "--n-cpu-moe", n_cpu_moe, "-t", threads, "-p", prompt,
                         "-n", tg, "-r", reps, "-o", "json", timeout=300, env=runtime_env()))
    res = {"build": rows[0].get("build_commit"), "backends": rows[0].get("backends"),
           "gpu": rows[0].get("gpu_info"), "n_cpu_moe": n_cpu_moe, "threads": threads}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        res[key], res[key + "_std"] = r["avg_ts"], r["stddev_ts"]
    return res


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def moeflow_bench(awq: Path, device: torch.device, policy: str, slots: int | None, cpu_compute: str | None,
                  prompt: int, tg: int, reps: int) -> dict:
    """moeflow on the AWQ checkpoint: pp = prompt / TTFT, tg = 1 / mean time per further token (greedy, no EOS)."""
    from moeflow import MoEOffloadedMixtral, OffloadConfig

    offload = None if policy == "resident" else OffloadConfig(policy=policy, gpu_expert_slots=slots,
                                                              cpu_compute=cpu_compute)
    model = MoEOffloadedMixtral.from_pretrained(awq, device=device, offload=offload)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            model.generate(torch.randint(3, vocab, (1, prompt), generator=gen), max_new_tokens=4, do_sample=False,
                           eos_token_id=[])  # warm-up: kernels compiled, graphs captured, calibration done
            pp, tgs = [], []
            for _ in range(reps):
                model.generate(torch.randint(3, vocab, (1, prompt), generator=gen), max_new_tokens=1,
                               do_sample=False, eos_token_id=[])
                pp.append(prompt / model.stats.ttft_s)
                model.generate(torch.randint(3, vocab, (1, 8), generator=gen), max_new_tokens=tg + 1,
                               do_sample=False, eos_token_id=[])
                tgs.append(1.0 / model.stats.tpot_s)
            s = model.stats.as_dict()
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return {f"pp{prompt}": sorted(pp)[len(pp) // 2], f"tg{tg}": sorted(tgs)[len(tgs) // 2], "policy": policy,
                "slots": slots, "cpu_compute": cpu_compute, "decode_hit_rate": s["decode"].get("hit_rate"),
                "peak_gpu_bytes": peak, "kernels": model.kernels}
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def transformers_offload(hf: Path, device: torch.device, gpu_bytes: int | None, prompt: int, tg: int) -> dict:
    """transformers + accelerate: fp16, ``device_map="auto"`` with ``max_memory`` (GPU: ``gpu_bytes``)."""
    from transformers import MixtralForCausalLM

    if device.type == "cuda":
        max_memory = {0: gpu_bytes, "cpu": 120 * 2**30}
    else:
        max_memory = {"cpu": 120 * 2**30}  # the CPU plumbing run: everything on the CPU
    model = MixtralForCausalLM.from_pretrained(hf, dtype=torch.float16 if device.type == "cuda" else torch.float32,
                                               device_map="auto", max_memory=max_memory).eval()
    first = next(model.parameters()).device
    device_map = getattr(model, "hf_device_map", {"": str(first)})
    placed = sorted({str(d) for d in device_map.values()})
    # decoder layers accelerate put on the GPU (the others stream from host memory at every forward)
    on_gpu = {name for name, d in device_map.items() if str(d) in ("0", "cuda:0")}
    n_layers = model.config.num_hidden_layers
    gpu_layers = n_layers if {"", "model", "model.layers"} & on_gpu else \
        sum(1 for i in range(n_layers) if f"model.layers.{i}" in on_gpu)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            model(torch.randint(3, vocab, (1, 8), generator=gen).to(first))  # warm-up
            ids = torch.randint(3, vocab, (1, prompt), generator=gen).to(first)
            _sync(device)
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            _sync(device)
            pp = prompt / (time.perf_counter() - t0)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(tg):
                out = model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            _sync(device)
            return {f"pp{prompt}": pp, f"tg{tg}": tg / (time.perf_counter() - t0), "max_memory_gpu_bytes": gpu_bytes,
                    "devices": placed, "gpu_layers": gpu_layers, "dtype": str(next(model.parameters()).dtype)}
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench(args: argparse.Namespace, files: dict[str, Path], report: Report) -> None:
    c = args.config
    layers, experts = c["num_hidden_layers"], c["num_local_experts"]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    expert_fp16 = 3 * c["hidden_size"] * c["intermediate_size"] * 2
    hf_fp16 = _bytes(files["hf"])  # bf16 on disk = fp16 bytes
    non_expert = hf_fp16 - layers * experts * expert_fp16
    t_end = args.t0 + args.time_budget_s  # from the start of the command (prep included)
    threads = args.threads or os.cpu_count() or 1
    budgets = [(k, (layers - k) * experts) for k in args.cpu_moe_layers if 0 <= k <= layers]

    def in_time(what: str) -> bool:
        if time.perf_counter() < t_end:
            return True
        report.data.setdefault("skipped", []).append(f"{what}: past --time-budget-s")
        return False

    for k, gpu_experts in budgets:  # llama.cpp and moeflow first, every budget; transformers (slowest) after
        if "llama.cpp" in args.engines and in_time(f"llama.cpp n_cpu_moe={k}"):
            report.row("llama.cpp Q4_0", gpu_experts, lambda k=k: llama_bench(
                files["bench"], files["q4_0"], k, args.prompt, args.tg, args.reps, threads), n_cpu_moe=k)
        if "moeflow" not in args.engines:
            continue
        configs = [("resident", None, None)] if k == 0 else [("lru", gpu_experts, None), ("lru", gpu_experts, "auto")]
        for policy, slots, cpu in configs:
            name = "moeflow AWQ " + policy + (" cpu_compute=auto" if cpu else "")
            if in_time(f"{name} at {gpu_experts} experts"):
                report.row(name, gpu_experts, lambda p=policy, s=slots, cc=cpu: moeflow_bench(
                    files["awq"], device, p, s, cc, args.prompt, args.tg, args.reps), n_cpu_moe=k)
    for k, gpu_experts in budgets:
        if "transformers" in args.engines and in_time(f"transformers at {gpu_experts} experts"):
            # + one layer: accelerate keeps room for the largest offloaded layer it streams in; + 1 GiB for the
            # activations and the KV cache. gpu_layers in the row says what it placed.
            layer = experts * expert_fp16 if k else 0
            gpu_bytes = int(non_expert + gpu_experts * expert_fp16 + layer + 2**30)
            report.row("transformers+accelerate fp16", gpu_experts, lambda g=gpu_bytes: transformers_offload(
                files["hf"], device, g, args.prompt, args.tg_transformers), n_cpu_moe=k)
    report.data["ratios"] = ratios(report.data["rows"], f"pp{args.prompt}", f"tg{args.tg}")
    report.save()


def ratios(rows: list[dict], pp: str, tg: str) -> list[dict]:
    """moeflow / peer, per GPU budget (gpu_experts), for prefill and decode."""
    out = []
    for m in (r for r in rows if r["engine"].startswith("moeflow") and "error" not in r):
        for p in (r for r in rows if not r["engine"].startswith("moeflow") and "error" not in r
                  and r["gpu_experts"] == m["gpu_experts"]):
            out.append({"moeflow": m["engine"], "peer": p["engine"], "gpu_experts": m["gpu_experts"],
                        f"{pp}_ratio": m[pp] / p[pp] if p.get(pp) and m.get(pp) else None,
                        "tg_ratio": m[tg] / p[p_tg] if (p_tg := next((k for k in p if k.startswith("tg") and
                                                                      not k.endswith("_std")), None))
                        and m.get(tg) and p.get(p_tg) else None})
    return out


def markdown(data: dict) -> str:
    pp = f"pp{data['prompt']}"
    lines = [f"Peers on {data.get('device_name', 'cpu')}, {data['date']}: a {data['config']['num_hidden_layers']}-"
             f"layer Mixtral-8x7B-shaped synthetic model (hidden {data['config']['hidden_size']}, "
             f"{data['config']['num_local_experts']} experts per layer), same weights for every engine.", "",
             "Prep: " + ", ".join(f"{k} {v.get('s')} s" + (" (error)" if "error" in v else "")
                                  for k, v in data["prep"].items()), "",
             f"| engine | experts on GPU | {pp} tok/s | decode tok/s | note |", "|---|---|---|---|---|"]
    if data.get("llama_cpp_skipped"):
        lines[3:3] = [data["llama_cpp_skipped"], ""]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['gpu_experts']} | error | error | {r['error'][:80]!r} |")
            continue
        dec = next((f"{r[k]:.1f} ({k})" for k in r if k.startswith("tg") and not k.endswith("_std")), "")
        note = f"n_cpu_moe {r['n_cpu_moe']}, {r.get('backends')}" if r["engine"].startswith("llama") else \
            (f"decode hit {r['decode_hit_rate']:.0%}" if r.get("policy") not in (None, "resident") else
             f"{r['gpu_layers']} layers on GPU ({', '.join(r['devices'])})" if "gpu_layers" in r else "")
        lines.append(f"| {r['engine']} | {r['gpu_experts']} | {r.get(pp, 0):.1f} | {dec} | {note} |")
    if data.get("ratios"):
        lines += ["", f"| moeflow | peer | experts on GPU | {pp} ratio | decode ratio |", "|---|---|---|---|---|"]
        for q in data["ratios"]:
            cells = [f"{q[k]:.3g}x" if q[k] else "" for k in (f"{pp}_ratio", "tg_ratio")]
            lines.append(f"| {q['moeflow']} | {q['peer']} | {q['gpu_experts']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("prep", "bench", "all"), default="all")
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU, with a CPU llama.cpp build")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moeflow-peers"), help="build, checkpoints, GGUF")
    ap.add_argument("--out", type=Path, required=True, help="where peers_gpu.json / .md go")
    ap.add_argument("--sources", type=Path, default=SOURCES, help="llama.cpp sources (gpu_peer_sources.sh)")
    ap.add_argument("--llama-build", type=Path, default=None, help="llama.cpp build dir (default --work/build-cuda)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; tiny 2)")
    ap.add_argument("--cpu-moe-layers", default=None, help="llama.cpp --n-cpu-moe values (default 0,L/2,3L/4)")
    ap.add_argument("--engines", default="llama.cpp,moeflow,transformers")
    ap.add_argument("--prompt", type=int, default=None, help="prefill tokens (default 512; tiny 16)")
    ap.add_argument("--tg", type=int, default=None, help="decode tokens (default 64; tiny 2)")
    ap.add_argument("--tg-transformers", type=int, default=None, help="decode tokens of transformers (default 8)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; tiny 1)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp CPU threads (default: every core)")
    ap.add_argument("--flash-attn", action="store_true", help="build llama.cpp's CUDA FlashAttention kernels")
    ap.add_argument("--time-budget-s", type=float, default=400.0,
                    help="no new measurement after this (s since the start)")
    args = ap.parse_args(argv)
    args.t0 = time.perf_counter()
    t = args.tiny
    args.config = dict(TINY if t else MIXTRAL_8X7B)
    if args.layers:
        args.config["num_hidden_layers"] = args.layers
    layers = args.config["num_hidden_layers"]
    args.cpu_moe_layers = [int(x) for x in args.cpu_moe_layers.split(",")] if args.cpu_moe_layers else \
        sorted({0, layers // 2, (3 * layers) // 4})
    args.prompt = args.prompt or (16 if t else 512)
    args.tg = args.tg or (2 if t else 64)
    args.tg_transformers = args.tg_transformers or (2 if t else 8)
    args.reps = args.reps or (1 if t else 3)
    args.engines = args.engines.split(",")
    args.llama_build = args.llama_build or args.work / "build-cuda"
    if t and args.sources == SOURCES and not (SOURCES / "convert_hf_to_gguf.py").is_file():
        args.sources = args.llama_build.parent  # the CPU build's own tree has the converter
    head = {"config": args.config, "prompt": args.prompt, "tg": args.tg, "reps": args.reps, "tiny": t,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "argv": sys.argv[1:] if argv is None else argv, "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        head["device_name"] = torch.cuda.get_device_name(0)
    version = args.sources / "LLAMA_CPP_PYTHON_VERSION"
    head["llama_cpp_python_sdist"] = version.read_text().strip() if version.is_file() else None
    report = Report(args.out, head, args.work / "prep.json")
    files = prepare(args, report) if args.phase in ("prep", "all") else {
        "hf": args.work / "hf", "q4_0": args.work / "mixtral-synth-Q4_0.gguf", "awq": args.work / "awq",
        "bench": args.llama_build / "bin" / "llama-bench"}
    if args.phase in ("bench", "all"):
        bench(args, files, report)
    print(markdown(report.data))
    return report.data


if __name__ == "__main__":
    main()
