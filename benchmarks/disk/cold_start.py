"""Cold start (issue 37): how fast a checkpoint becomes a model that answers, against how fast its files read.

Writes the Mixtral-8x7B-shaped AWQ checkpoint (``--layers`` of its 32 layers; ``--tiny``: the GPU lane's tiny
model) with the GPU lane's writer (benchmarks/common/checkpoint.py), then in one run:

* the files' read bandwidth with the page cache warm (one thread, 16 MiB reads; and ``workers`` threads of
  ``preadv``, the loader's way), the number every load figure is compared with;
* the qweight layout conversions per core (CPU thread time) of one expert's w13: the unpacking references
  against :mod:`moeflow.kernels.repack` (pool panels and the CPU q4 rows);
* from a cold process (a fresh interpreter: imports included) on ``device="cpu"`` with
  ``OffloadConfig(policy="lru", gpu_expert_slots=4)``: the ``from_pretrained`` time and GB/s, time to ready and
  to the first token, with and without ``background_load``.

    python -m benchmarks.disk.cold_start --layers 2          # ~2 GB slice, results/cold_start/
    python -m benchmarks.disk.cold_start --tiny --out /tmp/x  # seconds: exercises the code (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import MIXTRAL_8X7B, TINY, checkpoint_bytes, write_synthetic_awq_checkpoint
from benchmarks.peers.peer_report import uptime, write_report

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, resource, sys, time
t_spawn = float(os.environ["COLD_T0"])
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + system seconds, every thread
import torch
from moeflow import MoEModel, OffloadConfig
t_imported, c_imported = time.time(), cpu()
model = MoEModel.from_pretrained(sys.argv[1], device="cpu", progress=False, background_load=sys.argv[2] == "1",
                                 offload=OffloadConfig(policy="lru", gpu_expert_slots=4))
t_ready, c_ready = time.time(), cpu()
ids = torch.tensor([[1, 15, 27, 3]])
model.generate(ids, max_new_tokens=1, do_sample=False)
t_first = time.time()
host = model.experts.host
filled = host.wait_filled(timeout=600) if hasattr(host, "wait_filled") else True
t_filled, c_filled = time.time(), cpu()
print(json.dumps({"import_s": t_imported - t_spawn, "from_pretrained_s": t_ready - t_imported,
                  "from_pretrained_cpu_s": c_ready - c_imported, "ready_s": t_ready - t_spawn,
                  "first_token_s": t_first - t_spawn, "all_experts_in_ram_s": t_filled - t_spawn,
                  "cpu_s_to_all_experts_in_ram": c_filled - c_imported, "filled": filled}))
model.close()
"""


def cpu_name() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    pick = lambda key: next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(key)), "?")  # noqa: E731
    flags = pick("flags").split()
    return {"model_name": pick("model name"), "cores": os.cpu_count(),
            "simd": [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni") if f in flags]}


def shard_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def read_single(files: list[Path]) -> tuple[float, float]:
    """(GB/s, GB per CPU-second) of one thread reading every file with 16 MiB reads (page cache warm)."""
    buf, n = bytearray(16 * 2**20), 0
    t, c = time.perf_counter(), time.thread_time()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while (got := fh.readinto(buf)):
                n += got
    return n / (time.perf_counter() - t) / 1e9, n / max(time.thread_time() - c, 1e-9) / 1e9


def read_threads(files: list[Path], workers: int, chunk: int = 64 * 2**20) -> float:
    """GB/s of ``workers`` threads reading 64 MiB ranges of the files with ``preadv`` into their own buffers."""
    jobs = [(f, off, min(chunk, f.stat().st_size - off)) for f in files for off in range(0, f.stat().st_size, chunk)]
    lock, total = threading.Lock(), [0]

    def work() -> None:
        buf = memoryview(bytearray(chunk))
        while True:
            with lock:
                if not jobs:
                    return
                f, off, n = jobs.pop()
            fd = os.open(f, os.O_RDONLY)
            try:
                got = os.preadv(fd, [buf[:n]], off)
            finally:
                os.close(fd)
            with lock:
                total[0] += got

    t = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return total[0] / (time.perf_counter() - t) / 1e9


def conversions(config: dict, group: int) -> dict:
    """Per-core GB/s (thread CPU time, best of 2) of one expert's w13 qweight conversions, old and new."""
    from moeflow.kernels import repack
    from moeflow.kernels.cpu.native import library, native_available
    from moeflow.kernels.cpu.q4_matrix import pack_q4
    from moeflow.kernels.formats.plain_layout import awq_panel, to_kernel_layout_reference
    from moeflow.quant.awq import unpack_int4

    H, I = config["hidden_size"], config["intermediate_size"]  # noqa: E741
    q = torch.randint(-(2**31), 2**31 - 1, (H, 2 * I // 8), dtype=torch.int64).to(torch.int32)
    gb = q.numel() * 4 / 1e9
    torch.set_num_threads(1)
    cases = {
        "pool panels, unpacking reference": lambda: to_kernel_layout_reference("w13_qweight", q, I, group),
        "pool panels, packed words": lambda: repack.awq_to_panels(q, awq_panel(group), True, lib=library()),
        "cpu q4 rows, unpacking reference": lambda: pack_q4(unpack_int4(q).T.to(torch.uint8)),
        "cpu q4 rows, packed words": lambda: repack.awq_to_q4_packed(q, lib=library()),
    }
    out = {}
    for name, f in cases.items():
        best = float("inf")
        for _ in range(2):
            t = time.thread_time()
            f()
            best = min(best, time.thread_time() - t)
        out[name] = round(gb / best, 3)
    out["native"] = native_available()
    torch.set_num_threads(os.cpu_count() or 1)
    return out


def cold_process(ckpt: Path, background: bool) -> dict:
    env = dict(os.environ, COLD_T0=repr(time.time()))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    t0 = float(env["COLD_T0"])
    res = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), "1" if background else "0"], env=env,
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"cold process failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.time() - t0
    return out


def llama_cpp_cold(bin_dir: Path, gguf: Path, mmap: bool) -> dict:
    """One cold ``llama-completion`` process (CPU, one new token): wall time from spawn to exit, and its load time
    from its own log's timestamps (from "load the model" to the next line)."""
    cmd = [str(bin_dir / "llama-completion"), "-m", str(gguf), "-p", "hi", "-n", "1", "-ngl", "0", "--no-warmup",
           "--temp", "0", "-c", "4096", "--load-mode", "mmap" if mmap else "none"]
    t = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(res.stderr or res.stdout)[-2000:]}")
    stamps = [ln for ln in (res.stderr + res.stdout).splitlines() if ln[:2] == "0." and " I " in ln]
    at = lambda ln: sum(float(x) * m for x, m in zip(ln.split()[0].split(".")[:3], (60, 1, 1e-3), strict=True))  # noqa: E731
    start = next((i for i, ln in enumerate(stamps) if "load the model" in ln), None)
    load = at(stamps[start + 1]) - at(stamps[start]) if start is not None and start + 1 < len(stamps) else None
    return {"mmap": mmap, "load_s": load, "first_token_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny model (seconds; exercises the code)")
    ap.add_argument("--layers", type=int, default=2, help="layers of Mixtral-8x7B to write (default 2: ~2 GB)")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cold_start")
    ap.add_argument("--repeats", type=int, default=1, help="cold processes per mode")
    ap.add_argument("--llama-cpp", type=Path, default=None,
                    help="a llama.cpp bin/ with llama-completion: its load of a same-shape Q4_0 GGUF, side by side")
    args = ap.parse_args()
    config, group = (dict(TINY), 32) if args.tiny else (dict(MIXTRAL_8X7B), 128)
    config["num_hidden_layers"] = args.layers if not args.tiny else config["num_hidden_layers"]
    ckpt = args.checkpoint or Path(tempfile.gettempdir()) / (
        f"moeflow-synthetic-{'tiny' if args.tiny else 'mixtral-8x7b'}-awq-L{config['num_hidden_layers']}")
    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    files, size = shard_files(ckpt), checkpoint_bytes(ckpt)
    from moeflow.config import load_workers

    workers = load_workers()
    load_before = uptime()
    read_single(files)  # warm the page cache
    (read1, read_cpu), readn = read_single(files), read_threads(files, workers)
    conv = conversions(config, group)
    runs = {mode: [cold_process(ckpt, mode == "background_load") for _ in range(args.repeats)]
            for mode in ("full_load", "background_load")}
    peer = None
    if args.llama_cpp is not None:
        from benchmarks.disk.cold_start_gguf import write_q4_0_gguf

        gguf = write_q4_0_gguf(ckpt.with_name(ckpt.name + "-q4_0.gguf"), config)
        read_single([gguf])  # page cache warm, as for the safetensors files
        peer = {"gguf": str(gguf), "bytes": gguf.stat().st_size,
                "runs": [llama_cpp_cold(args.llama_cpp, gguf, mmap) for mmap in (True, False)]}
    best = {mode: min(r, key=lambda x: x["first_token_s"]) for mode, r in runs.items()}
    full = best["full_load"]
    load_gbps = size / full["from_pretrained_s"] / 1e9
    result = {
        "checkpoint": str(ckpt), "layers": config["num_hidden_layers"], "bytes": size, "cpu": cpu_name(),
        "uptime_before": load_before, "uptime_after": uptime(), "load_workers": workers,
        "torch_threads": torch.get_num_threads(), "read_gbps_1_thread": round(read1, 3),
        f"read_gbps_{workers}_threads": round(readn, 3), "conversion_gbps_per_core": conv,
        "read_gb_per_cpu_s": round(read_cpu, 3),
        "from_pretrained_gbps": round(load_gbps, 3), "load_vs_read": round(load_gbps / max(read1, readn), 3),
        "from_pretrained_gb_per_cpu_s": round(size / full["from_pretrained_cpu_s"] / 1e9, 3),
        "runs": runs, "llama_cpp": peer,
    }
    name = "tiny" if args.tiny else f"mixtral-8x7b-L{config['num_hidden_layers']}"
    lines = [
        f"# Cold start: {name} AWQ checkpoint ({size / 1e9:.2f} GB), device=cpu, lru 4 slots",
        "",
        f"CPU: {result['cpu']['model_name']} ({result['cpu']['cores']} cores, {', '.join(result['cpu']['simd'])}); "
        f"load before: `{load_before}`, after: `{result['uptime_after']}`; loader threads {workers}.",
        "",
        "| what | value |",
        "|---|---|",
        f"| file read, 1 thread (page cache warm) | {read1:.2f} GB/s |",
        f"| file read, {workers} threads of preadv | {readn:.2f} GB/s |",
        f"| `from_pretrained` (full load, in the cold process) | {full['from_pretrained_s']:.2f} s = "
        f"{load_gbps:.2f} GB/s = **{result['load_vs_read']:.2f}x** the faster read |",
        f"| CPU work: read / `from_pretrained` (user + system seconds, all threads) | {read_cpu:.2f} / "
        f"{result['from_pretrained_gb_per_cpu_s']:.2f} GB per CPU-second |",
        f"| full load: ready / first token (from process start) | {full['ready_s']:.2f} s / "
        f"{full['first_token_s']:.2f} s (imports {full['import_s']:.2f} s) |",
        f"| background_load: ready / first token / every expert in RAM | {best['background_load']['ready_s']:.2f} s"
        f" / {best['background_load']['first_token_s']:.2f} s / {best['background_load']['all_experts_in_ram_s']:.2f}"
        " s |",
        *([f"| llama.cpp (--load-mode {'mmap' if r['mmap'] else 'none'}), same-shape Q4_0 GGUF "
           f"({peer['bytes'] / 1e9:.2f} GB): load / first token from process start | "
           f"{r['load_s'] if r['load_s'] is None else round(r['load_s'], 2)} s / {r['first_token_s']:.2f} s |"
           for r in peer["runs"]] if peer else []),
        "",
        "Layout conversion of one expert's w13 qweight, GB/s per core (thread CPU time):",
        "",
        *[f"* {k}: {v}" for k, v in conv.items() if k != "native"],
        "",
        "The machine is shared (see the load averages): wall-clock figures vary from run to run.",
    ]
    write_report(args.out / name, result, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
