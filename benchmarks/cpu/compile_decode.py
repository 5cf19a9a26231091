"""Decode tokens/s eager vs ``compile=True`` (inductor) on the CPU, and what compiling costs (issue 14 item 6).

Models: the embedded tiny Mixtral (AWQ, 4 layers) with the torch reference kernels and with the CPU int4
kernels, and a 32-layer tiny fp32 Mixtral (the tests' random checkpoint) - each with every expert resident
(the step compiles as one graph) and with the "lru" offload policy, every expert fitting (one graph break per
layer, the layers sharing their compiled code). Per case: greedy decode of ``--tokens`` tokens, batch 1;
``tok_s`` is 1 / the mean decode step time (``stats.tpot_s``), the median of ``--repeats`` generates;
``compile_s`` is the first compiled generate's wall time minus an eager generate's (tracing + code generation,
with an empty inductor cache unless ``--warm-cache``);
``same_tokens``: the compiled tokens equal the eager ones. The machine is shared: the load average is recorded.

    PYTHONPATH=$PWD python -m benchmarks.cpu.compile_decode --out benchmarks/results/compile/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path

PROMPT = "The \"with\" statement is used to wrap the execution of a block"


def _generate(model, ids, tokens: int) -> tuple[torch.Tensor, float, float]:
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=[])
    return out, time.perf_counter() - t0, 1.0 / model.stats.tpot_s


def measure(path, kernels: str, policy: str, tokens: int, repeats: int, ids: torch.Tensor) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = json.loads((Path(path) / "config.json").read_text())
    every_expert = cfg["num_hidden_layers"] * cfg["num_local_experts"]
    offload = OffloadConfig(policy="lru", gpu_expert_slots=every_expert) if policy == "lru" else None
    ids = ids % cfg["vocab_size"]  # the embedded tokenizer's prompt, folded into a tiny model's vocabulary
    row: dict = {"kernels": kernels, "policy": policy}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        model = MoEOffloadedMixtral.from_pretrained(path, kernels=kernels, offload=offload, compile=mode == "compiled")
        try:
            first, first_s, _ = _generate(model, ids, tokens)
            runs = [_generate(model, ids, tokens) for _ in range(repeats)]
        finally:
            model.close()
        row[f"{mode}_tok_s"] = round(statistics.median(r[2] for r in runs), 2)
        row[f"{mode}_generate_s"] = round(statistics.median(r[1] for r in runs), 3)
        if mode == "eager":
            want = first
        else:
            row["compile_s"] = round(first_s - row["eager_generate_s"], 1)
            row["unique_graphs"] = counters["stats"]["unique_graphs"]
            row["graph_breaks"] = sum(counters["graph_break"].values())
            row["same_tokens"] = bool(torch.equal(first, want) and all(torch.equal(r[0], want) for r in runs))
    row["speedup"] = round(row["compiled_tok_s"] / row["eager_tok_s"], 2)
    return row


def tiny32(directory: Path) -> Path:
    from tests.helpers import make_tiny_checkpoint

    return make_tiny_checkpoint(directory, seed=0, num_hidden_layers=32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="keep inductor's on-disk cache (default: a fresh one, so compile_s is a cold compile)")
    ap.add_argument("--models", nargs="+", default=["embedded", "tiny-32-layer"], help="which models to run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    embedded = embedded_model_path()
    tok = MoEOffloadedMixtral.from_pretrained(embedded).tokenizer
    ids = torch.tensor([tok.encode(PROMPT)])
    rows, load_before = [], os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        deep = tiny32(Path(tmp)) if "tiny-32-layer" in args.models else None
        cases = [("embedded", embedded, "torch", "resident"), ("embedded", embedded, "torch", "lru"),
                 ("embedded", embedded, "cpu-int4", "resident"), ("tiny-32-layer", deep, "torch", "resident"),
                 ("tiny-32-layer", deep, "torch", "lru")]
        for name, path, kernels, policy in (c for c in cases if c[0] in args.models):
            row = {"model": name, **measure(path, kernels, policy, args.tokens, args.repeats, ids)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "threads": args.threads, "load_average_before": load_before,
              "load_average_after": os.getloadavg(),
              "tokens": args.tokens, "repeats": args.repeats, "inductor_cache": "warm" if args.warm_cache else "cold",
              "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
