"""The headline of one GPU loan (issue 36): moeflow against llama.cpp ``--n-cpu-moe`` on a full-size MoE model, at
the same share of the experts on the GPU, decode tok/s side by side with the ratio.

Phases (``--phase``; benchmarks/gpu_loan.sh runs them in order, each in its own process under ``timeout``):

* ``checkpoints``: the synthetic AWQ checkpoint (``common.checkpoint`` for Mixtral-8x7B, ``gpu.families`` for
  Qwen3-30B-A3B) and the Q4_0 GGUF of the same 4-bit weights (``common.gguf_checkpoint``); each reused when present.
* ``llama``: the prebuilt llama.cpp (benchmarks/peers/llama_cpp_prebuilt.py), ``llama-bench -ngl 99 --n-cpu-moe k
  -p <prompt> -n <new tokens>`` for k = 0 and for each share s of the experts on the GPU (k = layers * (1 - s)).
  It runs before moeflow's process exists, so the two never share the GPU.
* ``moeflow``: the checkpoint (``--source awq``: the AWQ one; ``gguf``: the very GGUF file llama.cpp ran, whose Q4_0
  experts load as AWQ with group 32, exactly its weights) loaded ONCE (``MoEModel.from_pretrained``, every expert
  in the pinned host store); then, swapping the expert backend on that model (:func:`swap_backend`, sharing the
  host store): resident, and lru / lru + ``cpu_compute="auto"`` at each share (slots = experts of the llama.cpp
  row), the decode step captured as CUDA graphs (on the CPU: the tests' stand-in), a warm-up generate at the timed
  shape, then one greedy generate of ``--new-tokens`` after a ``--prompt-len`` prompt: decode tok/s, TTFT, hit
  rate, bytes moved, peak device memory, tokens = resident's.
* ``report``: ratios (moeflow / llama.cpp decode per share) and the Markdown table (gpu/headline_report.py).

Every phase reads and rewrites ``--out/headline_<family>.json`` after each point and checks its own deadline
(``--deadline-s`` seconds from its start) before each row, so a command killed at its limit keeps what it measured.
``--tiny``: the tiny shapes on the CPU (the CPU llama.cpp of the same prebuilt archive). ``--experts Q4_K_M``: the
GGUF's experts in llama-quantize's Q4_K_M mixture (random blocks, no AWQ twin: the checkpoints phase writes the GGUF
alone, moeflow reads it with ``--source gguf``), results in ``headline_<family>_Q4_K_M.json``.

    python -m benchmarks.gpu.headline --phase moeflow --family mixtral --out $OUT --deadline-s 200
    python -m benchmarks.gpu.headline --phase all --family mixtral --tiny --out /tmp/headline   # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import MIXTRAL_8X7B, write_synthetic_awq_checkpoint
from benchmarks.common.checkpoint import TINY as MIXTRAL_TINY
from benchmarks.common.gguf_checkpoint import EXPERT_TYPES, write_synthetic_gguf
from benchmarks.gpu import headline_report
from benchmarks.peers.peer_report import uptime

FAMILIES = ("mixtral", "qwen3")
PHASES = ("checkpoints", "llama", "moeflow", "report")


# ------------------------------------------------------------------------------------------ setup
def family_config(family: str, tiny: bool, layers: int | None, experts: str = "Q4_0") -> tuple[dict, int]:
    """(config.json of the synthetic checkpoint, AWQ group size). Tiny with K-quant experts (``experts``
    "Q4_K_M"): hidden and expert intermediate sizes at least 256, a K-quant super-block."""
    if family == "mixtral":
        cfg = dict(MIXTRAL_TINY if tiny else MIXTRAL_8X7B)
    else:
        from benchmarks.gpu.families import QWEN3_30B_A3B
        from benchmarks.gpu.families import TINY as FAMILY_TINY

        cfg = dict(FAMILY_TINY["qwen3_moe"] if tiny else QWEN3_30B_A3B)
    if tiny and experts != "Q4_0":
        inter = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
        cfg["hidden_size"], cfg[inter] = max(256, cfg["hidden_size"]), max(256, cfg[inter])
    if layers:
        cfg["num_hidden_layers"] = layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = layers
    return cfg, 32 if tiny else 128


def experts_per_layer(cfg: dict) -> int:
    return cfg.get("num_local_experts") or cfg["num_experts"]


def budgets(cfg: dict, shares: list[float]) -> list[dict]:
    """llama.cpp's --n-cpu-moe k (the first k layers' experts on the CPU) for every share of experts on the GPU,
    and the same number of moeflow slots; share 1.0 (k = 0) is the all-resident row."""
    L, E = cfg["num_hidden_layers"], experts_per_layer(cfg)
    out = []
    for s in [1.0, *shares]:
        k = L - round(L * s)
        out.append({"share": s, "n_cpu_moe": k, "gpu_experts": (L - k) * E})
    return out


def paths(args: argparse.Namespace) -> tuple[Path, Path]:
    tag = f"{'tiny-' if args.tiny else ''}{args.family}-L{args.config['num_hidden_layers']}"
    base = Path(tempfile.gettempdir())
    awq = args.checkpoint or base / f"moeflow-headline-{tag}-awq"
    gguf = args.gguf or base / f"moeflow-headline-{tag}-{args.experts}.gguf"
    return awq, gguf


class Results:
    """``--out/headline_<family>.json``, read at start and rewritten after every point."""

    def __init__(self, out: Path, family: str, head: dict, experts: str = "Q4_0"):
        self.path = out / f"headline_{family}{'' if experts == 'Q4_0' else '_' + experts}.json"
        out.mkdir(parents=True, exist_ok=True)
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.data.update({k: v for k, v in head.items() if k not in self.data})
        for key in ("llama", "moeflow"):
            self.data.setdefault(key, [])

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


# ------------------------------------------------------------------------------------------ phases
def phase_checkpoints(args, res: Results) -> None:
    awq, gguf = paths(args)
    if args.experts != "Q4_0":  # the K-quant file alone (random blocks: no AWQ twin)
        t0 = time.perf_counter()
        write_synthetic_gguf(gguf, args.family, args.config, group=args.group, experts=args.experts)
        res.data["checkpoints"] = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
                                   "gguf_write_s": round(time.perf_counter() - t0, 1), "experts": args.experts}
        res.save()
        print(f"checkpoints: {res.data['checkpoints']}", flush=True)
        return
    t0 = time.perf_counter()
    if args.family == "mixtral":
        write_synthetic_awq_checkpoint(awq, args.config, group_size=args.group)
    else:
        from benchmarks.gpu.families import write_family_checkpoint

        write_family_checkpoint(awq, "qwen3_moe", args.config, group_size=args.group)
    t1 = time.perf_counter()
    write_synthetic_gguf(gguf, args.family, args.config, group=args.group)
    res.data["checkpoints"] = {
        "awq": str(awq), "awq_bytes": sum(f.stat().st_size for f in awq.glob("*.safetensors")),
        "awq_write_s": round(t1 - t0, 1), "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
        "gguf_write_s": round(time.perf_counter() - t1, 1),
        "same_weights": "the GGUF's Q4_0 blocks hold the AWQ file's 4-bit codes and scales exactly (zero point 8)"}
    res.save()
    print(f"checkpoints: {res.data['checkpoints']}", flush=True)


def phase_llama(args, res: Results, deadline: float) -> None:
    from benchmarks.peers.llama_cpp_prebuilt import find_archive, list_devices, llama_bench, unpack

    archive = find_archive()
    if archive is None:
        res.data["llama_error"] = "no llama-cpp-cuda-sm90.tar.xz (LLAMA_CPP_TARBALL, .peers/, ../shared/peers/)"
        res.save()
        print(res.data["llama_error"], flush=True)
        return
    bin_dir = unpack(archive)
    devices = list_devices(bin_dir)
    res.data["llama_devices"] = devices
    res.save()
    _, gguf = paths(args)
    if args.device == "cuda" and not devices["cuda"]:  # its CPU backends would take minutes per row: none run
        res.data["llama_error"] = ("the prebuilt llama.cpp lists no CUDA device (cuBLAS not found? see llama_devices;"
                                   " fallback: benchmarks/run_all_gpu.sh peers-prep builds it on the device)")
    elif not gguf.is_file():
        res.data["llama_error"] = f"{gguf} was not written (the checkpoints step's log says why)"
    if res.data.get("llama_error"):
        res.save()
        print(res.data["llama_error"], flush=True)
        return
    ngl = 99 if args.device == "cuda" else 0
    order = budgets(args.config, args.shares)
    for b in order[1:] + order[:1]:  # the shares first (the headline), all experts on the GPU last
        row = {"engine": f"llama.cpp {args.experts}", **b}
        if time.perf_counter() > deadline:
            row["error"] = "skipped: phase deadline"
        else:
            try:
                row.update(llama_bench(bin_dir, gguf, ngl=ngl, n_cpu_moe=b["n_cpu_moe"], prompt=args.prompt_len,
                                       gen=args.new_tokens, reps=args.reps, threads=args.threads,
                                       timeout=max(10.0, deadline - time.perf_counter() + 30),
                                       compat=devices["compat_libstdcxx"]))
                row["decode_tok_s"] = row[f"tg{args.new_tokens}"]
                row["ttft_s"] = args.prompt_len / row[f"pp{args.prompt_len}"]
            except Exception as exc:  # noqa: BLE001 - the other budgets go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        res.data["llama"] = [r for r in res.data["llama"] if r["n_cpu_moe"] != b["n_cpu_moe"]] + [row]
        res.save()
        print(json.dumps({k: v for k, v in row.items() if k != "command"}, default=str), flush=True)


def swap_backend(model, host, policy: str, slots: int | None, cpu_compute: str | None):
    """Install a fresh expert backend for ``policy`` at ``slots`` (``cpu_compute``: OffloadConfig's) on the loaded
    ``model``, sharing its filled host store: one load, many rows. The decode step is captured again by the
    caller (pieces recorded around the former backend's calls would be stale)."""
    from benchmarks.gpu.offload import _free, _sync
    from moeflow import OffloadConfig
    from moeflow.moe import ResidentExperts
    from moeflow.offload import create_expert_backend

    _free(model)
    fam, device = model.family, model.device
    layers = len(fam.moe_layers)
    if policy == "resident":
        backend = ResidentExperts(host.fmt, layers, fam.num_experts, device, model.kernels)
        backend.pool.buffer.copy_(host.buffer)  # the store's rows are in the resident slot order
    else:
        blocks = model.model.moe_blocks
        backend = create_expert_backend(
            OffloadConfig(policy=policy, gpu_expert_slots=slots, cpu_compute=cpu_compute), fmt=host.fmt,
            num_layers=layers, num_experts=fam.num_experts, top_k=fam.router_spec().top_k, device=device,
            kernels_backend=model.kernels, gates=[b.gate for b in blocks], route=blocks[0].route, reserved_bytes=0,
            stats=model.stats, host_store=host)
        backend.finish_loading()
    model.use_backend(backend)
    _sync(device)
    return backend


def moeflow_row(model, prompt: torch.Tensor, new_tokens: int, capture_factory) -> tuple[dict, torch.Tensor]:
    """Capture the decode step, warm up at the timed shape (captures, Triton specializations), then one timed
    greedy generate without EOS: decode tok/s, TTFT, hit rate, bytes moved, peak device memory."""
    from benchmarks.gpu.offload import _sync

    runner = model.runner
    runner.decode_fn = getattr(runner.decode_fn, "inner", runner.decode_fn)  # the former backend's capture: gone
    graphs = model.capture_decode(capture_factory)
    try:
        model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=[])
        model.stats.reset()
        cuda = model.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(model.device)
        _sync(model.device)
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
        _sync(model.device)
        s = model.stats
        d = s.as_dict()
        row = {"decode_tok_s": 1 / s.tpot_s if s.tpot_s else None, "ttft_s": s.ttft_s, "tpot_s": s.tpot_s,
               "wall_s": time.perf_counter() - t0, "decode_hit_rate": d["decode"]["hit_rate"],
               "bytes_h2d": d["prefill"]["bytes_h2d"] + d["decode"]["bytes_h2d"],
               "decode_bytes_h2d_per_token": d["decode"]["bytes_h2d"] / max(1, new_tokens - 1),
               "cpu_experts": d["prefill"].get("cpu_experts", 0) + d["decode"].get("cpu_experts", 0),
               "peak_gpu_bytes": torch.cuda.max_memory_allocated(model.device) if cuda else None,
               "graph_captures": graphs.captures, "graphs_refused": graphs.refused, "summary": s.summary()}
        return row, out
    finally:
        runner.decode_fn = getattr(runner.decode_fn, "inner", runner.decode_fn)


def phase_moeflow(args, res: Results, deadline: float) -> None:
    """The moeflow rows on ``--source``: ``awq`` the AWQ checkpoint (group 128), ``gguf`` the very Q4_0 GGUF file
    llama.cpp runs (its Q4_0 experts load as the AWQ format with group 32, exactly its weights: the same file, the
    same bytes). The GGUF rows record whether their tokens equal the AWQ resident row's too (saved as
    ``resident_tokens``), beside the exact-token check against their own resident row."""
    from moeflow import MoEModel, OffloadConfig
    from moeflow.offload import min_slots

    awq, gguf = paths(args)
    source = gguf if args.source == "gguf" else awq
    label = f"moeflow GGUF-{args.experts} " if args.source == "gguf" else "moeflow AWQ "
    device = torch.device(args.device)
    capture_factory = None
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors
        from benchmarks.gpu.engine import cpu_capture_factory

        capture_factory = cpu_capture_factory()
    t0 = time.perf_counter()
    top_k = args.config["num_experts_per_tok"]
    suffix = "_gguf" if args.source == "gguf" else ""
    try:  # every expert into the pinned host store (the backends below share it); graphs captured per row
        model = MoEModel.from_pretrained(
            source, device=device, kernels="torch" if args.tiny else "auto", progress=False, cuda_graphs=False,
            offload=OffloadConfig(policy="lru", gpu_expert_slots=min_slots(OffloadConfig(), top_k)))
    except Exception as exc:  # noqa: BLE001 - recorded for the table
        res.data["moeflow_error" + suffix] = f"loading {source}: {type(exc).__name__}: {str(exc)[-1500:]}"
        res.save()
        raise
    host = model.experts.host
    res.data["moeflow_load_s" + suffix] = round(time.perf_counter() - t0, 1)
    res.data["moeflow_kernels" + suffix] = model.kernels
    res.data["moeflow_format" + suffix] = repr(host.fmt)  # (a dataclass: the kind, the group size, the dtype)
    res.save()
    print(f"moeflow ({args.source}): loaded in {res.data['moeflow_load_s' + suffix]} s ({model.kernels} kernels)",
          flush=True)
    prompt = torch.randint(3, args.config["vocab_size"], (1, args.prompt_len),
                           generator=torch.Generator().manual_seed(0))
    # lru at every share before cpu_compute="auto" (its first backend builds the CPU int4 forms of every expert:
    # the slowest install), so a deadline cuts the auto rows first
    shares = budgets(args.config, args.shares)[1:]
    plan = [("resident", None, budgets(args.config, [])[0])] + [("lru", None, b) for b in shares] + \
        [("lru", "auto", b) for b in shares]
    expected = None
    awq_tokens = res.data.get("resident_tokens") if args.source == "gguf" else None
    for policy, cpu_compute, b in plan:
        row = {"engine": label + policy + (" cpu_compute=auto" if cpu_compute else ""), "policy": policy,
               "cpu_compute": cpu_compute, "source": args.source, **b}
        if time.perf_counter() > deadline:
            row["error"] = "skipped: phase deadline"
        else:
            try:
                slots = None if policy == "resident" else b["gpu_experts"]
                swap_backend(model, host, policy, slots, cpu_compute)
                measured, out = moeflow_row(model, prompt, args.new_tokens, capture_factory)
                row.update(measured)
                if policy == "resident":
                    expected = out
                    if args.source == "awq":
                        res.data["resident_tokens"] = out[0, args.prompt_len:].tolist()
                row["tokens_equal_resident"] = None if expected is None else bool(torch.equal(out, expected))
                if awq_tokens is not None:
                    row["tokens_equal_awq_resident"] = out[0, args.prompt_len:].tolist() == awq_tokens
            except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        res.data["moeflow"] = [r for r in res.data["moeflow"] if r["engine"] != row["engine"]
                               or r["gpu_experts"] != row["gpu_experts"]] + [row]
        res.save()
        print(json.dumps({k: v for k, v in row.items() if k != "summary"}, default=str), flush=True)
    model.close()


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=(*PHASES, "all"), default="all")
    ap.add_argument("--family", choices=FAMILIES, default="mixtral")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--checkpoint", type=Path, default=None, help="the AWQ checkpoint (default in the temp dir)")
    ap.add_argument("--gguf", type=Path, default=None, help="the Q4_0 GGUF (default in the temp dir)")
    ap.add_argument("--source", choices=("awq", "gguf"), default="awq",
                    help="the moeflow phase's checkpoint: the AWQ one, or the GGUF llama.cpp runs")
    ap.add_argument("--experts", choices=EXPERT_TYPES, default="Q4_0",
                    help="the GGUF's experts: Q4_0 (the AWQ weights), Q4_K_M (llama-quantize's mixture, random "
                         "blocks; results in headline_<family>_Q4_K_M.json; moeflow needs --source gguf)")
    ap.add_argument("--shares", default="0.5,0.25", help="shares of the experts on the GPU")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512 (tiny: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (tiny: 8)")
    ap.add_argument("--reps", type=int, default=None, help="llama-bench repetitions (default 2; tiny 1)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp CPU threads (default every core; tiny 2)")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="no new row after this (s from the start)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.deadline_s
    if args.experts != "Q4_0" and args.source != "gguf" and args.phase in ("moeflow", "all"):
        ap.error(f"--experts {args.experts} has no AWQ checkpoint: the moeflow phase needs --source gguf")
    args.config, args.group = family_config(args.family, args.tiny, args.layers, args.experts)
    args.shares = [float(s) for s in args.shares.split(",")]
    args.prompt_len = args.prompt_len or (16 if args.tiny else 512)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 64)
    args.reps = args.reps or (1 if args.tiny else 2)
    args.threads = args.threads or (2 if args.tiny else os.cpu_count() or 1)
    args.device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    head = {"family": args.family, "tiny": args.tiny, "config": args.config, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "shares": args.shares, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "cpu": _cpu_name(), "uptime": uptime(),
            "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "routing_note": "random weights: routing is near uniform, a pessimistic case for caching "
                            "(llama.cpp's static placement does not depend on it)"}
    head["experts"] = args.experts
    res = Results(args.out, args.family, head, args.experts)
    phases = PHASES if args.phase == "all" else (args.phase,)
    for phase in phases:
        if phase == "checkpoints":
            phase_checkpoints(args, res)
        elif phase == "llama":
            phase_llama(args, res, deadline)
        elif phase == "moeflow":
            phase_moeflow(args, res, deadline)
        else:
            res.data["ratios"] = headline_report.ratios(res.data)
            res.save()
            headline_report.write_markdown(args.out)
    return res.data


if __name__ == "__main__":
    main()
