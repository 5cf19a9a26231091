"""``moeflow serve`` beside llama.cpp's ``llama-server`` on the CPU, one streaming client (issue 42).

Per thread count, three servers run at once on the same model bytes: ``moeflow serve`` on the AWQ directory and on
the Q4_0 GGUF file, ``llama-server`` on the same GGUF (``-t``/``-tb`` threads, its warm-up on, ``-c`` the context
moeflow's rows hold). Each rep sends one prompt (the same fixed token ids to every server, new ids each rep so no
prefix cache helps) to each server in turn, the order rotated per rep, through the ``openai`` client's streaming
``/v1/completions``: temperature 0, ``ignore_eos``, ``max_tokens`` new tokens (every reply must end by length).
From the chunks' arrival times (a token's chunk: each one before the chunk that ends the reply; llama-server
sends one per token, even when its text is empty, and moeflow one per token whose text is complete; ``chunks``
in the JSON): TTFT (request -> first token chunk), decode tok/s ((max_tokens - 1) / (last token chunk - first))
and the median gap between token chunks (TPOT). Medians over the reps, the ratio to
llama-server, ``uptime`` and the CPU's model and flags in the result. One command:

    python -m benchmarks.peers.serve_side_by_side --threads 1 2 --out benchmarks/results/peers/s19/serve_side_by_side

(defaults: ``/tmp/peers/awq-qa``, ``/tmp/peers/mixtral-synth-Q4_0.gguf``,
``/tmp/peers/llama.cpp/build-server/bin/llama-server``; build that with ``-DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF``, see benchmarks/peers/README.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch

from benchmarks.peers.peer_report import cpu_line, uptime, write_report

REPO = Path(__file__).resolve().parents[2]
NAME = "bench"  # the model id every server answers to
START_TIMEOUT_S = 300
SERVERS = ("moeflow-awq", "moeflow-gguf", "llama-server")
SETTLE_S = 10.0  # idle seconds after the warm-up requests, before the reps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """One server in a subprocess (its output in ``log``), ready once ``ready_path`` answers 200."""

    def __init__(self, label: str, argv: list[str], port: int, ready_path: str, threads: int, log: Path) -> None:
        self.label, self.url = label, f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label} exited ({self.proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{label} did not answer {ready_path} in {START_TIMEOUT_S} s:\n"
                                   f"{log.read_text()[-3000:]}")
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


def with_tokenizer(checkpoint: Path, gguf: Path, work: Path) -> Path:
    """``checkpoint``, or where it has no ``tokenizer.json`` (moeflow serve needs one; the synthetic peer model ships
    a sentencepiece ``tokenizer.model``), a folder of links to its files plus the ``tokenizer.json`` moeflow rebuilds
    from the GGUF's metadata (the same vocabulary: the GGUF was converted from that checkpoint)."""
    if (checkpoint / "tokenizer.json").is_file():
        return checkpoint
    from moeflow.io.gguf.files import GGUFFiles
    from moeflow.io.gguf.tokenizer import tokenizer_directory

    source = tokenizer_directory(GGUFFiles(gguf), "mixtral")
    if source is None:
        raise SystemExit(f"{checkpoint} has no tokenizer.json and {gguf} holds no tokenizer to rebuild one from")
    out = work / f"{checkpoint.name}-serve"
    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    if not (out / "tokenizer.json").exists():
        (out / "tokenizer.json").symlink_to(source / "tokenizer.json")
    return out


def moeflow_server(label: str, model: Path, threads: int, context: int, log: Path) -> ServerProc:
    port = free_port()
    return ServerProc(label, [sys.executable, "-m", "moeflow", "serve", "--model", str(model), "--device", "cpu",
                              "--port", str(port), "--threads", str(threads), "--max-model-len", str(context),
                              "--served-model-name", NAME], port, "/v1/models", threads, log)


def llama_server(binary: Path, gguf: Path, threads: int, context: int, log: Path) -> ServerProc:
    port = free_port()
    return ServerProc("llama-server Q4_0", [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1",
                                            "-t", str(threads), "-tb", str(threads), "-c", str(context),
                                            "--alias", NAME], port, "/health", threads, log)


def stream_once(server: ServerProc, prompt: list[int], tokens: int) -> dict:
    """One streamed completion: TTFT ms, decode tok/s, median inter-chunk gap ms, token chunks seen."""
    t0 = time.perf_counter()
    stream = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=tokens, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    stamps, finish = [], None
    for chunk in stream:  # a token's chunk: before the one that ends the reply (or that one, when it has text)
        if chunk.choices and (chunk.choices[0].finish_reason is None or chunk.choices[0].text):
            stamps.append(time.perf_counter())
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    if finish != "length" or len(stamps) < 2:
        raise RuntimeError(f"{server.label}: the reply ended by {finish!r} after {len(stamps)} token chunks; "
                           f"expected {tokens} tokens (ignore_eos)")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "decode_tok_s": (tokens - 1) / (stamps[-1] - stamps[0]),
            "tpot_ms": statistics.median(gaps) * 1e3, "chunks": len(stamps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--awq", type=Path, default=Path("/tmp/peers/awq-qa"))
    ap.add_argument("--gguf", type=Path, default=Path("/tmp/peers/mixtral-synth-Q4_0.gguf"))
    ap.add_argument("--llama-server", type=Path, default=Path("/tmp/peers/llama.cpp/build-server/bin/llama-server"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per request (64-128)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=4096, help="moeflow's --max-model-len and llama-server's -c")
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="which servers run")
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    args = ap.parse_args()
    if "llama-server" in args.servers and not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server}: no llama-server binary (build the llama-server target, "
                         "benchmarks/peers/README.md)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    awq = with_tokenizer(args.awq, args.gguf, Path(tempfile.gettempdir()) / "moeflow-serve-bench")
    loads, results = [uptime()], []
    for threads in args.threads:
        logs = Path(tempfile.gettempdir()) / "moeflow-serve-bench" / "logs"  # (the servers' output, not kept)
        logs.mkdir(parents=True, exist_ok=True)
        servers = []
        try:  # (started one after another: a loading server does not share the cores with another's warm-up)
            if "moeflow-awq" in args.servers:
                servers.append(moeflow_server("moeflow AWQ", awq, threads, args.context,
                                              logs / f"moeflow_awq_t{threads}.log"))
            if "moeflow-gguf" in args.servers:
                servers.append(moeflow_server("moeflow GGUF Q4_0", args.gguf, threads, args.context,
                                              logs / f"moeflow_gguf_t{threads}.log"))
            if "llama-server" in args.servers:
                servers.append(llama_server(args.llama_server, args.gguf, threads, args.context,
                                            logs / f"llama_server_t{threads}.log"))
            warm = torch.randint(3, 32000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(99)).tolist()
            for s in servers:  # one request each first: first-use costs are no rep's
                stream_once(s, warm, 8)
            time.sleep(SETTLE_S)  # (moeflow moves its weights onto huge pages while idle: thp_collapse.py)
            runs: dict[str, list[dict]] = {s.label: [] for s in servers}
            for rep in range(args.reps):
                prompt = torch.randint(3, 32000, (args.prompt_tokens,),
                                       generator=torch.Generator().manual_seed(rep)).tolist()
                for s in servers[rep % len(servers):] + servers[: rep % len(servers)]:
                    runs[s.label].append(stream_once(s, prompt, args.tokens))
        finally:
            for s in servers:
                s.stop()
        loads.append(uptime())
        for label, rs in runs.items():
            results.append({"threads": threads, "server": label, "reps": rs,
                            **{k: statistics.median(r[k] for r in rs) for k in ("ttft_ms", "decode_tok_s", "tpot_ms")}})
    lines = [f"`moeflow serve` beside `llama-server` on the CPU: one streaming client (openai, /v1/completions), "
             f"{args.prompt_tokens}-token prompts (the same ids to every server, new each rep), {args.tokens} new "
             f"tokens, temperature 0, ignore_eos; servers alternating, median of {args.reps} reps; context "
             f"{args.context}. {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ",
             f"CPU: {cpu_line()}  ", *(f"uptime: `{u}`  " for u in loads), "",
             "Decode tok/s: (tokens - 1) / (last token chunk - first), stalls included; TPOT: the median gap between "
             "token chunks, robust to another process taking a core for a while (1000 / TPOT beside it).", "",
             "| threads | server | decode tok/s | TPOT ms (median gap) | 1000 / TPOT | TTFT ms | decode vs "
             "llama-server | 1000 / TPOT vs llama-server | TTFT vs llama-server |", "|" + "---|" * 9]
    for r in results:
        peer = next((x for x in results if x["threads"] == r["threads"] and x["server"].startswith("llama-server")),
                    None)
        ratios = ("n/a",) * 3 if peer is None else (f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}x",
                                                    f"{peer['tpot_ms'] / r['tpot_ms']:.2f}x",
                                                    f"{r['ttft_ms'] / peer['ttft_ms']:.2f}x")
        lines.append(f"| {r['threads']} | {r['server']} | {r['decode_tok_s']:.1f} | {r['tpot_ms']:.2f} | "
                     f"{1e3 / r['tpot_ms']:.1f} | {r['ttft_ms']:.1f} | {' | '.join(ratios)} |")
    write_report(args.out, {"cpu": cpu_line(), "uptime": loads, "args": {k: str(v) for k, v in vars(args).items()},
                            "results": results}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
