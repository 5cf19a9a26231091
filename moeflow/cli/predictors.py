"""``moeflow trace``, ``moeflow train-predictor`` and ``moeflow eval-predictor``.

``register(subparsers)`` adds the three subcommands to the ``moeflow`` parser; each handler takes the
parsed arguments and returns an exit status (errors are :class:`~moeflow.errors.MoeflowError`, which
``moeflow.cli.main`` prints).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from moeflow.cli.commands import add_loading_args, loading_from_args

KINDS = ("duoserve", "promoe", "finemoe", "skip-gate", "popularity", "expertflow")


def _threads(args) -> None:
    # the predictors' tensors are small: one thread avoids OpenMP overhead (and contention on busy hosts)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def cmd_trace(args: argparse.Namespace) -> int:
    """Record a routing trace of the prompts in a JSONL file."""
    from moeflow import MoEModel
    from moeflow.tools.record import read_prompts, record_trace

    _threads(args)
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(args.dtype)
    model = MoEModel.from_pretrained(args.model, device=args.device, dtype=dtype, **loading_from_args(args))
    prompts = read_prompts(args.prompts, model.tokenizer)
    if args.limit:
        prompts = prompts[: args.limit]
    too_long = [i for i, p in enumerate(prompts) if len(p) + args.max_new_tokens > model.config.max_position_embeddings]
    if too_long:
        raise ValueError(f"{args.prompts}: prompt(s) {too_long[:5]} plus --max-new-tokens {args.max_new_tokens} exceed "
                         f"max_position_embeddings={model.config.max_position_embeddings}")
    start = time.perf_counter()
    trace = record_trace(model, prompts, args.max_new_tokens, hidden=args.hidden, embed=args.hidden or args.embed,
                         progress=not args.quiet)
    trace.metadata["prompts"] = Path(args.prompts).name
    out = trace.save(args.out)
    print(json.dumps({"out": str(out), "sequences": len(prompts), "tokens": len(trace),
                      "prefill_tokens": int((trace.phase == 0).sum()), "decode_tokens": int((trace.phase == 1).sum()),
                      "hidden": trace.hidden is not None, "embed": trace.embed is not None,
                      "seconds": round(time.perf_counter() - start, 2)}))
    return 0


def cmd_train_predictor(args: argparse.Namespace) -> int:
    """Build a predictor from a trace's training sequences and save it."""
    from moeflow.offload.predictors import train_predictor
    from moeflow.trace import Trace

    _threads(args)
    trace = Trace.load(args.trace)
    options: dict = {}
    if args.kind in ("duoserve", "promoe", "expertflow"):
        if args.epochs is not None:
            options["epochs"] = args.epochs
        if args.max_seconds is not None:
            options["max_seconds"] = args.max_seconds
    if args.kind == "finemoe" and args.capacity is not None:
        options["capacity"] = args.capacity
    if args.kind == "skip-gate":
        if args.model:
            from moeflow.engine.loading import read_routers

            options["routers"] = read_routers(args.model)[0]
    elif args.model:
        raise ValueError("--model is only used by --kind skip-gate (the routers' weights)")
    predictor = train_predictor(args.kind, trace, eval_fraction=args.eval_fraction, seed=args.seed,
                                distance=args.distance, **options)
    out = predictor.save(args.out)
    info = predictor.train_info
    print(json.dumps({"out": str(out), **predictor.describe(), "train_tokens": info.train_tokens,
                      "train_sequences": len(info.train_seq_ids), "held_out_sequences": len(info.eval_seq_ids),
                      "train_seconds": round(info.train_seconds, 2), "notes": info.notes}, default=str))
    return 0


def cmd_eval_predictor(args: argparse.Namespace) -> int:
    """Print held-out accuracy (and the popularity baseline's) as JSON."""
    from moeflow.offload.predictors import evaluate_held_out, load_predictor
    from moeflow.trace import Trace

    _threads(args)
    predictor = load_predictor(args.predictor)
    trace = Trace.load(args.trace)
    result = evaluate_held_out(predictor, trace, args.phase)
    if (args.layer_ms is None) != (args.expert_ms is None):
        raise ValueError("--layer-ms and --expert-ms go together (ProMoE's GoodPred needs both)")
    if args.layer_ms is not None:  # ProMoE §4.1: Accuracy x FetchRate, FetchRate from the timing model
        from moeflow.offload.predictors.evaluate import goodpred

        result["goodpred"] = goodpred(result, predictor.distance, layer_ms=args.layer_ms, expert_ms=args.expert_ms,
                                      predict_ms=args.predict_ms)
    if predictor.kind == "expertflow":  # ExpertFlow eq. 7: batch-level accuracy at batch sizes 1/4/16/32
        from moeflow.offload.policies.expertflow.predictor import batch_level_report
        from moeflow.offload.predictors import held_out_rows

        result["batch_level"] = batch_level_report(predictor, held_out_rows(predictor, trace), phase=args.phase)
    if not args.per_layer:
        result.pop("per_layer_recall", None)
    json.dump(result, sys.stdout, indent=None if args.compact else 2)
    print()
    return 0


def register(subparsers) -> None:
    """Add ``trace``, ``train-predictor`` and ``eval-predictor`` to a ``moeflow`` subparsers object."""
    p = subparsers.add_parser("trace", help="record the routing of prompts (prefill + greedy decode) to safetensors")
    p.add_argument("--model", required=True, help="checkpoint directory or hub id")
    p.add_argument("--prompts", required=True, help='JSONL: {"prompt": "..."} or {"input_ids": [...]} per line')
    p.add_argument("--out", required=True, help="trace file to write (.safetensors)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--hidden", action="store_true", help="also record MoE-layer inputs and token embeddings")
    p.add_argument("--embed", action="store_true", help="record token embeddings (implied by --hidden)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_loading_args(p)
    p.set_defaults(func=cmd_trace)

    p = subparsers.add_parser("train-predictor", help="build an expert predictor from a trace")
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--trace", required=True)
    p.add_argument("--out", required=True, help="predictor file to write")
    p.add_argument("--distance", type=int, default=None,
                   help="layers ahead (default: the paper's: duoserve 1, promoe 2, finemoe 3, capped at layers - 1)")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of sequences held out (default 0.1: 9:1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None, help="training epochs (duoserve / promoe 20, expertflow 30)")
    p.add_argument("--max-seconds", type=float, default=None, help="cap on training time (learned kinds)")
    p.add_argument("--capacity", type=int, default=None, help="finemoe Expert Map Store capacity (default 1000)")
    p.add_argument("--model", default=None, help="checkpoint whose routers skip-gate uses")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.set_defaults(func=cmd_train_predictor)

    p = subparsers.add_parser("eval-predictor", help="held-out accuracy of a predictor on a trace, as JSON")
    p.add_argument("--predictor", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--phase", choices=["all", "prefill", "decode"], default="all")
    p.add_argument("--per-layer", action="store_true", help="include recall per target layer")
    p.add_argument("--compact", action="store_true", help="one-line JSON")
    p.add_argument("--layer-ms", type=float, default=None,
                   help="with --expert-ms: ProMoE's GoodPred = Accuracy x FetchRate, a layer taking this long")
    p.add_argument("--expert-ms", type=float, default=None, help="time to copy one expert host->device")
    p.add_argument("--predict-ms", type=float, default=0.0, help="time one prediction takes (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.set_defaults(func=cmd_eval_predictor)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m moeflow.cli.predictors ...``) until ``moeflow.cli`` registers these."""
    from moeflow.errors import MoeflowError

    parser = argparse.ArgumentParser(prog="moeflow", description=__doc__)
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (MoeflowError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
