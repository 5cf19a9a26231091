"""`moeflow serve` on a GPU: concurrent OpenAI chat requests, exact greedy text against `generate`, tokens/s.

    python -m benchmarks.gpu.serve --out $OUT/serve              # a GPU: the embedded model, resident and lru
    python -m benchmarks.gpu.serve --tiny --out /tmp/serve       # the same on the CPU, fewer requests (CI)

For each server configuration (``--configs``: ``resident`` and ``lru:S``, S GPU expert slots) and each decode mode
(``--graphs``: ``off`` eager, ``on`` the decode passes as CUDA graphs; both on a GPU, ``off`` in ``--tiny``) the server
is started as a user starts it (``moeflow serve --device D --port 0 --cuda-graphs MODE``, a subprocess;
tests/serve_helpers.Server) on the embedded tiny Mixtral, and for each concurrency level C (``--levels``) C client
threads send non-streamed greedy
chat completions (temperature 0, ``--max-tokens``) over the prompts of benchmarks/engine/serve.py, ``--requests``
per level. Every reply's text is compared with single-request in-process greedy ``generate`` of the resident model
on the same device and dtype (tests/serve_helpers.Reference): continuous batching, chunked prefill and offloading
must not change a token. Reported per level: requests, completion tokens per second over the level's wall time,
request latency p50 / max, how many replies equal the reference, and the server's own account of its decode graphs
(``/metrics``: state on/off/refused, steps captured); the yardstick is the in-process single-stream decode rate on
the same device. ``graphs_vs_eager`` pairs each level's ``on`` row with its ``off`` row: the tok/s ratio, and
whether every reply text of the two is the same.

The official ``openai`` client is used when it imports (on the lent GPU machine: carry the wheels of
benchmarks/gpu_wheels.sh), else the same requests go over plain HTTP (``urllib``). Results are rewritten to
``--out/serve_results.json`` after every level, each level prints one line, and a failing level or server start
is recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.engine.serve import PROMPTS
from tests.serve_helpers import MODEL_NAME, Reference, Server

ROOT = Path(__file__).resolve().parents[2]


def chat_client(url: str):
    """fn(messages, max_tokens) -> (text, completion tokens) through the openai client, else plain HTTP."""
    try:
        import openai
    except ImportError:
        openai = None
    if openai is not None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=300)

        def ask(model: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
            return r.choices[0].message.content or "", r.usage.completion_tokens

        return ask, "openai " + openai.__version__

    def ask(model: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:  # the same request body
        body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        req = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer bench"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            r = json.loads(resp.read())
        return r["choices"][0]["message"]["content"] or "", r["usage"]["completion_tokens"]

    return ask, "http (openai not importable)"


def run_level(ask, model: str, clients: int, requests: int, max_tokens: int, want: dict[int, str]) -> dict:
    """``requests`` chat completions from ``clients`` threads; each reply compared with ``want[prompt index]``."""
    def one(job: int) -> tuple[int, float, str, int]:
        t0 = time.perf_counter()
        text, n = ask(model, [{"role": "user", "content": PROMPTS[job % len(PROMPTS)]}], max_tokens)
        return job, time.perf_counter() - t0, text, n

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    latencies = sorted(d[1] for d in done)
    tokens = sum(d[3] for d in done)
    mismatches = [{"prompt": job % len(PROMPTS), "got": text, "want": want[job % len(PROMPTS)]}
                  for job, _, text, _ in done if text != want[job % len(PROMPTS)]]
    texts: dict[str, list[str]] = {}
    for job, _, text, _ in done:  # every distinct reply per prompt (greedy: one each when batching changes nothing)
        texts.setdefault(str(job % len(PROMPTS)), [])
        if text not in texts[str(job % len(PROMPTS))]:
            texts[str(job % len(PROMPTS))].append(text)
    return {"clients": clients, "requests": requests, "completion_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "latency_p50_s": latencies[len(latencies) // 2],
            "latency_max_s": latencies[-1], "replies_equal_generate": requests - len(mismatches),
            "mismatches": mismatches[:4], "texts": texts}


def graphs_metrics(url: str) -> dict:
    """The server's decode-graph state ("on" / "off" / "refused") and steps captured, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    state = [m.group(1) for m in re.finditer(r'^moeflow_decode_graphs\{state="(\w+)"\} 1\.0$', text, re.M)]
    captures = re.search(r"^moeflow_decode_graph_captures_total (\S+)$", text, re.M)
    return {"graphs_state": state[0] if state else None,
            "graph_captures": int(float(captures.group(1))) if captures else None}


def graphs_vs_eager(rows: list[dict]) -> list[dict]:
    """Each (config, clients) measured with graphs on and off: tok/s on / off, and whether the two levels' replies
    are the same texts (each reply is also checked against generate: replies_equal_generate)."""
    eager = {(r["config"], r["clients"]): r for r in rows if r.get("cuda_graphs") == "off" and "error" not in r}
    out = []
    for r in rows:
        e = eager.get((r["config"], r.get("clients")))
        if r.get("cuda_graphs") != "on" or "error" in r or e is None:
            continue
        out.append({"config": r["config"], "clients": r["clients"], "graphs_tokens_per_s": r["tokens_per_s"],
                    "eager_tokens_per_s": e["tokens_per_s"], "speedup": r["tokens_per_s"] / e["tokens_per_s"],
                    "replies_equal_eager": r["texts"] == e["texts"], "graphs_state": r.get("graphs_state")})
    return out


def single_stream_rate(ref: Reference, max_tokens: int) -> float:
    """Decode tokens/s of in-process greedy generate on one prompt (after a warm-up), no HTTP, no scheduler."""
    ids = torch.tensor([ref.chat_ids([{"role": "user", "content": PROMPTS[0]}])])
    ref.model.generate(ids, max_new_tokens=2, do_sample=False)
    if ref.model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = ref.model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=[])
    if ref.model.device.type == "cuda":
        torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def server_args(config: str, graphs: str, args) -> list[str]:
    """``resident`` or ``lru:S``, and the decode mode (on/off) -> `moeflow serve` arguments."""
    common = ["--max-model-len", "512", "--max-batch", str(args.max_batch), "--prefill-chunk", str(args.prefill_chunk),
              "--cuda-graphs", graphs]
    if config == "resident":
        return common
    policy, _, slots = config.partition(":")
    return common + ["--policy", policy, "--slots", slots or "8"]


def summary(row: dict) -> str:
    head = f"serve {row['config']:>10} graphs {row.get('cuda_graphs', '?'):>3} on {row['device']}"
    if "error" in row:
        return f"{head}: error {row['error']}"
    return (f"{head}, {row['clients']:>2} clients: {row['requests']} requests, {row['tokens_per_s']:.1f} tok/s, "
            f"p50 {row['latency_p50_s'] * 1e3:.0f} ms, replies = generate: {row['replies_equal_generate']}/"
            f"{row['requests']}, graphs {row.get('graphs_state')} ({row.get('graph_captures')} captured)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="the CPU, levels 1 and 3, 3 requests of 6 tokens")
    p.add_argument("--configs", default="resident,lru:8", help="comma list of resident / POLICY:SLOTS")
    p.add_argument("--levels", default="1,8", help="concurrent clients per level")
    p.add_argument("--graphs", default=None,
                   help="comma list of decode modes, off (eager) / on (CUDA graphs); default off,on on CUDA, else off")
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least the clients)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_serve")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.levels, args.requests, args.max_tokens = "cpu", "1,3", 3, 6
    if args.graphs is None:
        args.graphs = "off,on" if args.device.startswith("cuda") else "off"
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    result: dict = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
                    "max_tokens": args.max_tokens, "model": MODEL_NAME, "rows": []}
    if args.device.startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name()

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - t_start
        (args.out / "serve_results.json").write_text(json.dumps(result, indent=1, default=str))

    ref = Reference(device=args.device)
    want = {i: ref.greedy(ref.chat_ids([{"role": "user", "content": q}]), args.max_tokens)[0]
            for i, q in enumerate(PROMPTS)}
    result["single_stream_tokens_per_s"] = single_stream_rate(ref, args.max_tokens)
    del ref
    save()
    for config in args.configs.split(","):
        for graphs in args.graphs.split(","):
            run_server(config, graphs, args, want, result, save)
    result["graphs_vs_eager"] = graphs_vs_eager(result["rows"])
    for c in result["graphs_vs_eager"]:
        print(f"serve {c['config']:>10}, {c['clients']:>2} clients: graphs {c['graphs_tokens_per_s']:.1f} tok/s, "
              f"eager {c['eager_tokens_per_s']:.1f} ({c['speedup']:.2f}x), replies equal: {c['replies_equal_eager']}",
              flush=True)
    save()
    return result


def run_server(config: str, graphs: str, args, want: dict[int, str], result: dict, save) -> None:
    """One server (``config``, decode mode ``graphs``): every level into ``result["rows"]``; errors recorded."""
    base = {"config": config, "cuda_graphs": graphs, "device": args.device}
    try:
        srv = Server(*server_args(config, graphs, args), device=args.device)
    except Exception as exc:  # e.g. fastapi missing on the machine: the reason is the result
        result["rows"].append({**base, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})
        print(summary(result["rows"][-1]), flush=True)
        save()
        return
    try:
        ask, result["client"] = chat_client(srv.url)
        ask(MODEL_NAME, [{"role": "user", "content": PROMPTS[0]}], 4)  # warm-up (kernel compilation)
        top = max(int(c) for c in args.levels.split(","))  # and the batch sizes' graphs, mostly, before timing
        with ThreadPoolExecutor(top) as pool:
            list(pool.map(lambda i: ask(MODEL_NAME, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], 4),
                          range(top)))
    except Exception as exc:  # the server answers nothing: record why, try the next configuration
        srv.stop()
        result["rows"].append({**base, "error": f"{type(exc).__name__}: {exc}"})
        print(summary(result["rows"][-1]), flush=True)
        save()
        return
    try:
        for clients in (int(c) for c in args.levels.split(",")):
            try:
                row = run_level(ask, MODEL_NAME, clients, max(clients, args.requests), args.max_tokens, want)
                row.update(graphs_metrics(srv.url))
            except Exception as exc:  # one failing level must not lose the others
                row = {"clients": clients, "error": f"{type(exc).__name__}: {exc}"}
            result["rows"].append({**base, **row})
            print(summary(result["rows"][-1]), flush=True)
            save()
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
