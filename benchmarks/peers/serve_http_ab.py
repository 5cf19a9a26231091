"""``moeflow serve`` from two or more source trees side by side: what a streamed token costs the server (issue 42).

Each variant is ``label=TREE[:EXTRA_PATH]``: a ``moeflow serve`` run from source tree TREE (its ``PYTHONPATH``),
with EXTRA_PATH put in front when given (a ``pip install --target`` folder holding ``uvloop`` / ``httptools``,
which uvicorn then picks up). Per thread count all variants run at once on the same GGUF file and take turns, one
streaming ``openai`` client, ``/v1/completions``, 32-token prompts (new ids each rep), ``max_tokens`` new tokens,
temperature 0, ``ignore_eos``. Per request: the median gap between token chunks (TPOT) and the CPU the server's
main thread (the event loop: uvicorn, starlette, the SSE chunks) spent, per token, from ``/proc``. Medians over
the reps (the CPU: the mean, /proc counts it in 10 ms ticks); ``uptime`` and the CPU in the result. One command:

    python -m benchmarks.peers.serve_http_ab --threads 1 2 --reps 6 \\
        --variant main=/work/main --variant this=. --variant this+uvloop=.:/tmp/fast \\
        --out benchmarks/results/peers/s19/http_ab
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.peers.peer_report import cpu_line, uptime
from benchmarks.peers.serve_side_by_side import NAME, ServerProc, free_port

TICK = os.sysconf("SC_CLK_TCK")


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of the process's main thread (uvicorn's event loop)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start(label: str, tree: Path, extra: str | None, gguf: Path, threads: int, context: int, log: Path) -> ServerProc:
    port = free_port()
    path = os.pathsep.join([p for p in (extra, str(tree)) if p])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path  # ServerProc prepends this repository: the tree's own path goes first here
    try:
        argv = [sys.executable, "-c", f"import sys; sys.path[:0] = {path.split(os.pathsep)!r}; "
                                      "from moeflow.cli import main; sys.exit(main())",
                "serve", "--model", str(gguf), "--device", "cpu", "--port", str(port), "--threads", str(threads),
                "--max-model-len", str(context), "--served-model-name", NAME]
        return ServerProc(label, argv, port, "/v1/models", threads, log)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def stream_once(server: ServerProc, prompt: list[int], tokens: int) -> dict:
    pid = server.proc.pid
    cpu0 = main_thread_cpu_s(pid)
    stamps = []
    stream = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=tokens, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason is None:
            stamps.append(time.perf_counter())
    cpu = main_thread_cpu_s(pid) - cpu0
    maps = Path(f"/proc/{pid}/maps").read_text()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"tpot_ms": statistics.median(gaps) * 1e3, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "loop_cpu_ms_per_token": cpu * 1e3 / tokens, "chunks": len(stamps),
            "uvloop": "uvloop/loop." in maps, "httptools": "httptools/parser" in maps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=Path("/tmp/peers/mixtral-synth-Q4_0.gguf"))
    ap.add_argument("--variant", action="append", required=True, help="label=TREE[:EXTRA_PATH]")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    args = ap.parse_args()
    variants = []
    for v in args.variant:
        label, _, spec = v.partition("=")
        tree, _, extra = spec.partition(":")
        variants.append((label, Path(tree).resolve(), extra or None))
    logs = Path(tempfile.gettempdir()) / "moeflow-serve-ab"
    logs.mkdir(parents=True, exist_ok=True)
    loads, results = [uptime()], []
    for threads in args.threads:
        servers = []
        try:
            for label, tree, extra in variants:
                log = logs / f"{label}_t{threads}.log"
                servers.append(start(label, tree, extra, args.gguf, threads, args.context, log))
            warm = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(99)).tolist()
            for s in servers:
                stream_once(s, warm, 8)
            time.sleep(5)
            runs: dict[str, list[dict]] = {s.label: [] for s in servers}
            for rep in range(args.reps):
                prompt = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(rep)).tolist()
                for s in servers[rep % len(servers):] + servers[: rep % len(servers)]:
                    runs[s.label].append(stream_once(s, prompt, args.tokens))
        finally:
            for s in servers:
                s.stop()
        loads.append(uptime())
        for label, rs in runs.items():
            results.append({"threads": threads, "variant": label, "reps": rs,
                            **{k: statistics.median(r[k] for r in rs) for k in ("tpot_ms", "decode_tok_s")},
                            # (/proc counts CPU in clock ticks, 10 ms: the mean over all reps, not a median)
                            "loop_cpu_ms_per_token": statistics.fmean(r["loop_cpu_ms_per_token"] for r in rs),
                            "uvloop": rs[0]["uvloop"], "httptools": rs[0]["httptools"]})
    cpu = cpu_line()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "uptime": loads, "variants": args.variant,
                                                         "tokens": args.tokens, "results": results}, indent=1))
    lines = [f"`moeflow serve` variants side by side, one streaming openai client (/v1/completions), 32-token prompts, "
             f"{args.tokens} new tokens, ignore_eos, servers taking turns, median of {args.reps} reps. "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ", f"CPU: {cpu}  ",
             *[f"uptime: `{u}`  " for u in loads], "", "Variants: " + ", ".join(f"`{v}`" for v in args.variant), "",
             "| threads | variant | uvloop + httptools | TPOT ms (median gap) | decode tok/s "
             "| event-loop CPU ms / token |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['variant']} | {'yes' if r['uvloop'] and r['httptools'] else 'no'} | "
              f"{r['tpot_ms']:.2f} | {r['decode_tok_s']:.1f} | "
              f"{r['loop_cpu_ms_per_token']:.3f} |" for r in results]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
