"""`moeflow serve` under load: throughput, TTFT and time per output token at 1, 4 and 16 concurrent clients.

Starts the server on the embedded model (CPU; or ``--model`` on a GPU machine), then for each concurrency C
runs C client threads of the official ``openai`` client, each sending streamed chat requests back to back
(temperature 0, ``--max-tokens`` tokens each, prompts of mixed length) until ``--requests`` (at least 2*C)
are done. Per request: TTFT (send -> first content chunk) and time per output token ((last chunk - first
chunk) / (tokens - 1)); per level: generated tokens per second over the level's wall time.

Yardsticks measured in the same run: in-process ``generate`` on one prompt (no HTTP, no scheduler) gives
the single-stream decode rate r1; ``ideal C x r1`` is what perfect batching would reach, and each level
reports its throughput as a fraction of it (batching efficiency) and as a multiple of r1.

    python -m benchmarks.engine.serve --out benchmarks/results/serve
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tests.serve_helpers import MODEL_NAME, Server

LEVELS = (1, 4, 16)
PROMPTS = ["What does the import statement do?",
           "Explain how a module finds its submodules when a package is imported from a zip file.",
           "List the string methods.",
           "Describe the difference between a class attribute and an instance attribute, and when the "
           "lookup of an attribute falls back from the instance dictionary to the class and its bases."]


def percentiles(xs: list[float]) -> dict[str, float]:
    t = torch.tensor(sorted(xs), dtype=torch.float64)
    return {f"p{q}": float(torch.quantile(t, q / 100)) * 1e3 for q in (50, 90, 99)}  # milliseconds


def run_level(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    lock, next_job, records = threading.Lock(), [0], []

    def worker() -> None:
        while True:
            with lock:
                job = next_job[0]
                next_job[0] += 1
            if job >= requests:
                return
            messages = [{"role": "user", "content": PROMPTS[job % len(PROMPTS)]}]
            sent = time.perf_counter()
            first = last = None
            usage = None
            for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    last = time.perf_counter()
                    first = first or last
            with lock:
                records.append((first - sent, (last - first) / max(1, usage.completion_tokens - 1),
                                usage.completion_tokens))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(worker) for _ in range(clients)]:
            future.result()  # a failed request fails the benchmark
    wall = time.perf_counter() - start
    tokens = sum(r[2] for r in records)
    return {"clients": clients, "requests": len(records), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "requests_per_s": len(records) / wall,
            "ttft_ms": percentiles([r[0] for r in records]), "tpot_ms": percentiles([r[1] for r in records])}


def single_stream_rate(model_arg: str | None, max_tokens: int) -> float:
    """Tokens/s of in-process greedy generate on one prompt (after a warm-up call)."""
    from moeflow import MoEOffloadedMixtral
    from moeflow.cli import embedded_model_path

    model = MoEOffloadedMixtral.from_pretrained(model_arg or embedded_model_path())
    ids = torch.tensor([model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                                            add_generation_prompt=True)])
    model.generate(ids, max_new_tokens=2, do_sample=False)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=[])
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)


def table(result: dict) -> str:
    r1 = result["single_stream_tokens_per_s"]
    lines = [f"In-process `generate`, one stream: {r1:.1f} tok/s (the yardstick r1).", "",
             "| clients | requests | tok/s | x r1 | of ideal C x r1 | TTFT p50 / p90 / p99 ms | "
             "TPOT p50 / p90 / p99 ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for lv in result["levels"]:
        ttft, tpot = lv["ttft_ms"], lv["tpot_ms"]
        lines.append(f"| {lv['clients']} | {lv['requests']} | {lv['tokens_per_s']:.1f} | "
                     f"{lv['tokens_per_s'] / r1:.2f} | {lv['tokens_per_s'] / (lv['clients'] * r1):.0%} | "
                     f"{ttft['p50']:.0f} / {ttft['p90']:.0f} / {ttft['p99']:.0f} | "
                     f"{tpot['p50']:.1f} / {tpot['p90']:.1f} / {tpot['p99']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads, in process and in the server")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least 2 x clients)")
    p.add_argument("--prefill-chunk", type=int, default=64, help="the server's --prefill-chunk")
    p.add_argument("--prefix-cache", choices=["on", "off"], default="off",
                   help="the server's --prefix-cache (off: the cycled prompts are prefilled every time, as before "
                        "the cache existed, so levels compare with earlier results)")
    p.add_argument("--out", type=Path, default=None, help="write bench_serve.json and README.md here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    server_args = ["--max-model-len", "512", "--max-batch", "16", "--max-queue", "64", "--threads", str(args.threads),
                   "--prefill-chunk", str(args.prefill_chunk), "--prefix-cache", args.prefix_cache]
    if args.model:
        server_args += ["--model", args.model]
    rate = single_stream_rate(args.model, args.max_tokens) if args.device == "cpu" else None
    srv = Server(*server_args, device=args.device)
    try:
        name = MODEL_NAME if args.model is None else Path(args.model).name
        run_level(srv.url, name, 1, 2, 4)  # warm-up
        levels = [run_level(srv.url, name, c, max(args.requests, 2 * c), args.max_tokens) for c in LEVELS]
    finally:
        srv.stop()
    result = {"model": args.model or MODEL_NAME, "device": args.device, "max_tokens": args.max_tokens,
              "prefill_chunk": args.prefill_chunk, "prefix_cache": args.prefix_cache,
              "load_average": list(os.getloadavg()),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "torch_threads": torch.get_num_threads(), "single_stream_tokens_per_s": rate, "levels": levels}
    print(json.dumps(result, indent=2))
    if rate:
        print(table(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"bench_serve_chunk{args.prefill_chunk}"
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        if rate:
            (args.out / f"{name}.md").write_text(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
