"""Cold start from GGUF files (issue 37): moeflow's experts as views of the mapped file against copied at load, and
llama.cpp's mmap and reading loads of the same files, against the files' read rate.

For each ``--model`` (a GGUF file, or an HF-layout checkpoint folder), in one run (page cache warm for everyone):

* the file's read rate (one thread, 16 MiB reads);
* cold processes (a fresh interpreter: imports included) of ``MoEModel.from_pretrained(path, device="cpu")``
  (every expert resident, ``kernels="auto"``) with ``mmap=True`` (the default: experts the CPU computes as stored
  are views of the mapped file, :mod:`moeflow.engine.mapped_experts`) and ``mmap=False`` (copied into a pool at
  load: the path before session 16) and ``mmap=True, cpu_form_cache=True`` (resident CPU int4 experts, AWQ and
  Q4_0, mapped from the cache file a warm-up process wrote), best of ``--repeats`` by first token:
  ``from_pretrained`` seconds and CPU seconds, the file's bytes over those seconds against the read rate, and
  the first token (one new token after a 4-token prompt) from process start;
* llama.cpp's ``llama-completion`` (CPU, one new token) with ``--load-mode mmap`` and ``none``: its load time and
  first token from process start (:func:`benchmarks.disk.cold_start.llama_cpp_cold`).

    python -m benchmarks.disk.cold_start_mapped --model A.gguf --model B.gguf --llama-cpp BIN_DIR \\
        --out benchmarks/results/cold_start/gguf-mmap-s16

``--tree before=/work/main --tree after=$PWD`` runs the cold processes of several source trees (each on its own
``PYTHONPATH``), alternating with each other and the modes within every repeat: before and after in one run on a
machine whose load drifts. ``--modes mmap,cache`` runs a subset of the modes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.disk.cold_start import ROOT, cpu_name, llama_cpp_cold, read_single
from benchmarks.peers.peer_report import uptime, write_report

CHILD = r"""
import json, os, resource, sys, time
t_spawn = float(os.environ["COLD_T0"])
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + system seconds, every thread
import torch
from moeflow import MoEModel
t_imported, c_imported = time.time(), cpu()
model = MoEModel.from_pretrained(sys.argv[1], device="cpu", progress=False, mmap=sys.argv[2] != "copy",
                                 cpu_form_cache=sys.argv[2] == "cache")
t_ready, c_ready = time.time(), cpu()
model.generate(torch.tensor([[1, 15, 27, 3]]), max_new_tokens=1, do_sample=False)
t_first, c_first = time.time(), cpu()
def tok_s():  # decode tok/s over 8 tokens after a 4-token prompt
    model.generate(torch.tensor([[1, 15, 27, 3]]), max_new_tokens=9, do_sample=False, eos_token_id=[])
    return 1 / model.stats.tpot_s
early = tok_s()  # (while the background collapse onto huge pages may run: session 18's trees)
try:
    from moeflow.kernels.cpu import hugepages, thp_collapse
    t0 = time.time(); hugepages.wait_collapsed(120); wait_s = time.time() - t0
    collapse = {"collapse_wait_s": wait_s, **vars(thp_collapse.COLLAPSER.stats)}
except (ImportError, AttributeError):  # (a tree without it)
    collapse = {}
print(json.dumps({"import_s": t_imported - t_spawn, "from_pretrained_s": t_ready - t_imported,
                  "from_pretrained_cpu_s": c_ready - c_imported, "first_token_s": t_first - t_spawn,
                  "first_token_cpu_s": c_first - c_imported, "backend": type(model.experts).__name__,
                  "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "early_tok_s": early, "later_tok_s": tok_s(), **collapse}))
model.close()
"""


MODES = ("mmap", "copy", "cache")  # mmap=True; mmap=False; mmap=True with cpu_form_cache=True (written beforehand)


def cold_process(model: Path, mode: str, root: Path = ROOT, extra_env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ, **(extra_env or {}), COLD_T0=repr(time.time()))
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    # run in the tree: ``python -c`` puts the working directory first on sys.path, ahead of PYTHONPATH
    res = subprocess.run([sys.executable, "-c", CHILD, str(model.resolve()), mode], env=env, capture_output=True,
                         text=True, cwd=root)
    if res.returncode:
        raise RuntimeError(f"cold process failed ({model}, {mode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def one_file(model: Path, repeats: int, llama_cpp: Path | None, trees: dict[str, Path], modes: tuple[str, ...],
             tree_env: dict[str, dict[str, str]] | None = None) -> dict:
    tree_env = tree_env or {}
    files = [model] if model.is_file() else sorted(model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    read_single(files)  # page cache warm
    read_gbps, _ = read_single(files)
    for tree, root in trees.items():  # not counted: the tokenizer rebuilt from a GGUF's metadata and the CPU form
        cold_process(model, "cache" if "cache" in modes else modes[0], root, tree_env.get(tree))  # cache written
    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):  # the trees and modes alternate within each repeat (a shared machine's load drifts)
        for tree, root in trees.items():
            for mode in modes:
                runs.setdefault(f"{tree}:{mode}", []).append(cold_process(model, mode, root, tree_env.get(tree)))
    best = {key: min(r, key=lambda x: x["first_token_s"]) for key, r in runs.items()}
    for b in best.values():
        b["load_vs_read"] = round(size / b["from_pretrained_s"] / 1e9 / read_gbps, 3)
    peer = [llama_cpp_cold(llama_cpp, model, mmap) for mmap in (True, False)] \
        if llama_cpp is not None and model.is_file() else None
    return {"model": str(model), "bytes": size, "read_gbps": round(read_gbps, 3), "runs": runs, "best": best,
            "llama_cpp": peer}


NAMES = {"mmap": "mmap=True", "copy": "mmap=False (copied)", "cache": "mmap=True, cpu_form_cache=True"}


def lines_of(r: dict) -> list[str]:
    peer = {p["mmap"]: p for p in r["llama_cpp"] or []}
    out = [f"### {Path(r['model']).name} ({r['bytes'] / 1e9:.2f} GB; read {r['read_gbps']:.2f} GB/s, 1 thread)", "",
           "| | backend | `from_pretrained` s (CPU s) | x of the read rate | first token from process start "
           "(imports) | median first token | max RSS | decode tok/s right after / later | huge-page collapse s "
           "(CPU s) |", "|---|---|---|---|---|---|---|---|---|"]
    for key, b in r["best"].items():
        tree, mode = key.split(":")
        name = f"moeflow{'' if tree == 'moeflow' else f' ({tree})'}, {NAMES[mode]}"
        firsts = sorted(x["first_token_s"] for x in r["runs"][key])
        median = firsts[len(firsts) // 2] if len(firsts) % 2 else sum(firsts[len(firsts) // 2 - 1:][:2]) / 2
        decode = f"{b['early_tok_s']:.1f} / {b['later_tok_s']:.1f}" if "early_tok_s" in b else ""
        collapse = f"{b['collapse_wait_s']:.2f} after; {b['seconds']:.2f} ({b['cpu_seconds']:.2f}), " \
                   f"{b['collapsed']} x 2 MB" if b.get("collapsed") else ""
        out.append(f"| {name} | {b['backend']} | {b['from_pretrained_s']:.2f} ({b['from_pretrained_cpu_s']:.2f}) | "
                   f"{b['load_vs_read']:.2f}x | {b['first_token_s']:.2f} s ({b['import_s']:.2f} s) | {median:.2f} s | "
                   f"{b['max_rss_gb']:.2f} GB | {decode} | {collapse} |")
    for mmap, name in ((True, "llama.cpp --load-mode mmap"), (False, "llama.cpp --load-mode none")):
        if mmap in peer:
            p = peer[mmap]
            load = "?" if p["load_s"] is None else f"{p['load_s']:.2f}"
            out.append(f"| {name} | | {load} (its log) | | {p['first_token_s']:.2f} s | |")
    for key, b in r["best"].items():
        if peer and key.endswith(":mmap"):
            m, tree = b["first_token_s"], key.split(":")[0]
            out += ["", f"{tree} (mmap=True) first token / llama.cpp's: {m / peer[True]['first_token_s']:.2f}x its "
                        f"mmap load, {m / peer[False]['first_token_s']:.2f}x its reading load."]
    return [*out, ""]


def _commit(root: Path) -> str:
    """``root``'s checkout as ``path @ commit`` (and ``+dirty`` with uncommitted changes)."""
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout.strip()
    return f"{root} @ {head or '?'}{' +dirty' if dirty else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, action="append", required=True,
                    help="a GGUF file or an HF-layout checkpoint folder (no llama.cpp run for a folder)")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="a llama.cpp bin/ with llama-completion")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a moeflow source tree to run (repeatable; default: this one, named moeflow), e.g. "
                         "before=/work/main after=$PWD: before and after in one run")
    ap.add_argument("--tree-env", action="append", default=[], metavar="NAME:VAR=VALUE",
                    help="an environment variable for one tree's processes (repeatable), e.g. off:MOEFLOW_HUGEPAGES=0; "
                         "a name may repeat a tree's path: --tree off=$PWD --tree-env off:MOEFLOW_HUGEPAGES=0")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    args = ap.parse_args()
    before = uptime()
    with tempfile.TemporaryDirectory() as cache:  # a fresh user cache: the warm-up process writes it
        os.environ["MOEFLOW_CACHE_DIR"] = cache
        trees = dict(t.split("=", 1) for t in args.tree) or {"moeflow": str(ROOT)}
        modes = tuple(m for m in args.modes.split(",") if m)
        if set(modes) - set(MODES):
            ap.error(f"--modes: expected a subset of {MODES}, got {args.modes!r}")
        tree_env: dict[str, dict[str, str]] = {}
        for item in args.tree_env:
            name, var = item.split(":", 1)
            key, value = var.split("=", 1)
            tree_env.setdefault(name, {})[key] = value
        files = [one_file(m, args.repeats, args.llama_cpp, {k: Path(v) for k, v in trees.items()}, modes, tree_env)
                 for m in args.model]
    result = {"cpu": cpu_name(), "uptime_before": before, "uptime_after": uptime(), "files": files,
              "trees": {k: _commit(Path(v)) + "".join(f" {a}={b}" for a, b in tree_env.get(k, {}).items())
                        for k, v in trees.items()}}
    c = result["cpu"]
    lines = ["# Cold start from GGUF files: experts mapped (mmap=True) or copied at load, llama.cpp beside", "",
             f"CPU: {c['model_name']} ({c['cores']} cores, {', '.join(c['simd'])}); load before: `{before}`, after: "
             f"`{result['uptime_after']}`. `from_pretrained(path, device=\"cpu\")`, every expert resident, cold "
             f"processes, best of {args.repeats} by first token; page cache warm. \"x of the read rate\": the "
             "file's bytes over the `from_pretrained` seconds, over the file's read rate in the same run (mapped "
             "experts are read when first touched, inside the first token). Trees: "
             + "; ".join(f"{k}: `{v}`" for k, v in result["trees"].items()) + ".", ""]
    for r in files:
        lines += lines_of(r)
    write_report(args.out, result, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
