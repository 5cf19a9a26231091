"""The int8 CPU kernel against a base commit's, in one process, beside the int4 kernel and a streaming read of
the same bytes (issue 21): ``cpu_q8_ab.c`` links this tree's kernels with the base commit's ``native.c``
(its ``mf_q8_linear`` renamed), calls the four in turn rep after rep (the shared machine's load hits all alike)
and reports GB/s of weight bytes of each one's fastest rep, so ratios come from one run.

    python -m benchmarks.peers.cpu_q8_ab --base 5533550 --out benchmarks/results/cpu_native/s5_q8_ab.json

Shapes: N rows x K = 4096: lm_head 32000 / 151936 rows (131 / 622 MB: read from memory); attention 4096 / 1024
rows (16.8 / 4.2 MB: mostly from this CPU's 32 MB L3 when called back to back, as here - the streaming read of
the same bytes shows how much).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parent.parent / "moeflow" / "kernels" / "cpu"
# the base commit's C library: moeflow/kernels/cpu/ since the kernels were laid out by operation, flat before
BASE_LAYOUTS = (("cpu/native.c", "cpu/native.h"), ("cpu_native.c", "cpu_native.h"))
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]  # as moeflow/kernels/cpu/native.py builds


def build(base: str, tmp: Path) -> Path:
    """The harness against this tree's kernels and ``base``'s native.c (its q8 entry renamed)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    old = tmp / "base"
    old.mkdir()
    for layout in BASE_LAYOUTS:
        shown = [subprocess.run(["git", "-C", str(KERNELS), "show", f"{base}:moeflow/kernels/{name}"],
                                capture_output=True, text=True) for name in layout]
        if all(s.returncode == 0 for s in shown):
            break
    else:
        raise SystemExit(f"{base}: no moeflow/kernels/{BASE_LAYOUTS[0][0]} nor moeflow/kernels/{BASE_LAYOUTS[1][0]}")
    for name, s in zip(layout, shown, strict=True):
        (old / Path(name).name).write_text(s.stdout)
    base_c = old / Path(layout[0]).name
    renames = [f"-D{a}=base_{a.removeprefix('mf_')}" for a in ("mf_q8_linear", "mf_q4_linear", "mf_q4_expert",
                                                               "mf_simd")]
    subprocess.run([cc, *FLAGS, "-c", str(base_c), f"-I{old}", *renames, "-o", str(tmp / "base.o")],
                   check=True)
    exe = tmp / "ab"
    sources = [str(KERNELS / f) for f in ("native.c", "q4.c", "q8.c")]
    subprocess.run([cc, *FLAGS, *sources, str(tmp / "base.o"), str(HERE / "cpu_q8_ab.c"), "-o", str(exe), "-lm"],
                   check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="5533550", help="the commit whose mf_q8_linear is the baseline")
    ap.add_argument("--rows", default="32000,151936,4096,1024")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1, help="the whole set again (rows taken in turn)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    up = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    result = {"base": args.base, "uptime": [up()], "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.base, Path(tmp))
        for r in range(args.rounds):
            for n in args.rows.split(","):
                reps = args.reps * (4 if int(n) <= 4096 else 1)  # small shapes: more, shorter reps
                out = subprocess.run([str(exe), n, args.tokens, args.threads, str(reps)], capture_output=True,
                                     text=True, check=True).stdout
                for line in out.splitlines():
                    row = json.loads(line) | {"round": r}
                    row["q8_vs_base"] = round(row["q8_gbps"] / row["base_q8_gbps"], 2)
                    row["q8_vs_q4"] = round(row["q8_gbps"] / row["q4_gbps"], 2)
                    row["q8_vs_stream"] = round(row["q8_gbps"] / row["stream_read_gbps"], 2)
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
            result["uptime"].append(up())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
