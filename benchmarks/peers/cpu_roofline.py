"""This machine's roofline for the q4 CPU kernel (issue 21): read bandwidth and the maddubs peak, and what they
allow at T tokens for an expert of Mixtral-8x7B's shapes. Builds cpu_roofline.c with the system compiler.

    python -m benchmarks.peers.cpu_roofline --out benchmarks/results/cpu_native/roofline.json

Per 32 weights of one row (one maddubs per token) the kernel reads 16 bytes of int4 plus 8 bytes of fp32 scale
and min per 128 weights: 18 bytes. Each figure is the best of ``--repeats`` runs (the machine is shared). At T
tokens a call takes at least max(bytes / bandwidth, T * blocks / maddubs rate), so bytes/s at T can stay within
``f`` of T = 1 only while T <= f * rate * 18 / bandwidth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BYTES_PER_BLOCK = 16 + 8 * 32 / 128  # int4 weights of one row's 32 features + their share of scale and min


def measure(repeats: int) -> tuple[dict, list[dict]]:
    """The best of ``repeats`` runs per figure (a peak: on a shared machine every run is at or below it), and all."""
    cc = shutil.which("gcc") or shutil.which("cc")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "roofline"
        subprocess.run([cc, "-O2", "-march=native", "-fopenmp", str(HERE / "cpu_roofline.c"), "-o", str(exe)],
                       check=True)
        runs = [json.loads(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)
                for _ in range(repeats)]
    return {k: max(r[k] for r in runs) for k in runs[0]}, runs


def bounds(m: dict, tokens: list[int]) -> list[dict]:
    """Slowdown per byte at T vs T = 1 that no kernel built of maddubs can beat, at each measured rate."""
    bw = m["stream_read_gbps_1_thread"] * 1e9
    t_mem = BYTES_PER_BLOCK / bw  # seconds per block of 32 weights at T = 1
    rows = []
    for t in tokens:
        row = {"tokens": t}
        for name in ("maddubs_g_per_s", "maddubs_paddw_g_per_s", "bcast_maddubs_paddw_g_per_s"):
            t_mul = t / (m[name] * 1e9)
            row[f"min_slowdown_{name.removesuffix('_g_per_s')}"] = round(max(t_mem, t_mul) / t_mem, 2)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    m, runs = measure(args.repeats)
    need = 16 / 1.5 * m["stream_read_gbps_1_thread"] * 1e9 / BYTES_PER_BLOCK / 1e9
    out = {"measured": m, "runs": runs, "bytes_per_block_of_32_weights": BYTES_PER_BLOCK,
           "t16_within_1_5x_needs_maddubs_g_per_s": round(need, 2),
           "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
           "bounds": bounds(m, [1, 2, 4, 8, 16, 32])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
