"""The ``moeflow`` command: demo, generate and quantize here, the other subcommands from :data:`COMMAND_MODULES`
(the ``--help`` description lists them all, read from the parser)."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
from importlib import resources
from pathlib import Path

import torch

# modules that add their subcommands through register(subparsers)
COMMAND_MODULES = ("moeflow.cli.predictors", "moeflow.sim.cli", "moeflow.cli.serve")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
EMBEDDED_MODEL = "tiny-mixtral-awq"
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}  # --cuda-graphs / --early-hits -> None / True / False


def embedded_model_path() -> Path:
    """The small AWQ Mixtral shipped inside the package (trained by scripts/train_tiny_model.py)."""
    return Path(str(resources.files("moeflow") / "data" / EMBEDDED_MODEL))


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def offload_from_args(args, slots: int | None, policy: str | None):
    """The OffloadConfig the flags ask for; None (``from_pretrained``'s own placement: every expert on the device
    when they fit, else offloaded with "auto") when no --policy, budget or offload flag was given."""
    from moeflow import OffloadConfig

    given = dict(gpu_expert_slots=slots, gpu_memory_gb=getattr(args, "gpu_memory_gb", None),
                 host_memory_gb=getattr(args, "host_memory_gb", None),
                 early_hits=AUTO_ON_OFF[getattr(args, "early_hits", "auto")])
    background = bool(getattr(args, "background_load", False))
    if policy is None:
        if all(v is None for v in given.values()):
            if background:
                raise SystemExit("--background-load needs an offloading placement: give --slots, --gpu-memory-gb "
                                 "or --policy")
            return None
        policy = "auto" if slots is not None or given["gpu_memory_gb"] is not None else "resident"
    if background and policy == "resident":
        raise SystemExit("--background-load needs an offloading policy (not 'resident'): give --slots, "
                         "--gpu-memory-gb or --policy")
    return OffloadConfig(policy=policy, background_load=background, **given)


def speculative_from_args(args) -> int | None:
    """``--num-speculative-tokens`` as ``generate``'s / the engine's ``num_speculative_tokens``: None without
    ``--speculative``, K (default 1) with ``--speculative mtp`` (vLLM's flags). ValueError for K without
    ``--speculative``, or with ``--prompt-lookup`` (two ways to draft)."""
    method, k = getattr(args, "speculative", None), getattr(args, "num_speculative_tokens", None)
    if method is None:
        if k is not None:
            raise ValueError("--num-speculative-tokens needs --speculative mtp (the drafts come from the model's "
                             "multi-token-prediction layers)")
        return None
    if getattr(args, "prompt_lookup", None):
        raise ValueError("--speculative and --prompt-lookup are two ways to draft: pass one")
    k = 1 if k is None else k
    if k < 1:
        raise ValueError(f"--num-speculative-tokens must be a positive integer, got {k}")
    return k


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """``--speculative mtp`` and ``--num-speculative-tokens K`` (vLLM's names), read by
    :func:`speculative_from_args`."""
    p.add_argument("--speculative", choices=["mtp"], default=None,
                   help="draft with the model's own multi-token-prediction layers (loads them: mtp=True) and "
                        "verify the drafts in one pass")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per pass with --speculative (default 1, the published use)")


def add_loading_args(p: argparse.ArgumentParser) -> None:
    """``--no-mmap`` and ``--cpu-form-cache``: from_pretrained's ``mmap`` and ``cpu_form_cache`` (llama.cpp's
    names where it has one), read by :func:`loading_from_args`."""
    p.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="copy a GGUF file's experts into memory at load instead of mapping the file (llama.cpp's "
                        "flag; mapping, the default, applies on --device cpu with every expert resident, to experts "
                        "the CPU runs as stored: Q8_0, Q4_K, Q5_K, Q6_K)")
    p.add_argument("--cpu-form-cache", action="store_true",
                   help="on --device cpu with every expert resident: write AWQ / all-Q4_0 GGUF experts' converted "
                        "CPU int4 form once to $MOEFLOW_CACHE_DIR/cpu_forms (default ~/.cache/moeflow/cpu_forms) "
                        "and map it on later loads instead of converting; costs disk space equal to the experts' "
                        "converted size (about their size in the checkpoint), one file per checkpoint")


def loading_from_args(args: argparse.Namespace) -> dict[str, bool]:
    """``--no-mmap`` / ``--cpu-form-cache`` as from_pretrained's keyword arguments ``mmap`` and
    ``cpu_form_cache``."""
    return {"mmap": args.mmap, "cpu_form_cache": args.cpu_form_cache}


def _load(args, slots: int | None, policy: str | None):
    from moeflow import MoEModel

    mtp = speculative_from_args(args) is not None
    offload = offload_from_args(args, slots, policy)
    dtype = DTYPES[args.dtype] if args.dtype else None
    return MoEModel.from_pretrained(args.model, device=args.device, dtype=dtype, offload=offload,
                                    kernels=args.kernels, cuda_graphs=AUTO_ON_OFF[args.cuda_graphs], mtp=mtp,
                                    **loading_from_args(args))


def _run_prompt(model, prompt: str, args) -> int:
    from moeflow.streaming import TextStreamer

    if model.tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json; pass token ids with --ids instead", file=sys.stderr)
        return 2
    enc = model.tokenizer(prompt)
    if args.warmup:
        # the first call pays one-time costs (op registration, lazy imports: ~2 s on a CPU); keep them out of TTFT
        model.generate(enc["input_ids"][:, :1], max_new_tokens=1, do_sample=False)  # (no drafts: one token)
    streamer = TextStreamer(model.tokenizer)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    model.stats.reset()
    do_sample = True if args.sample else (False if args.greedy else None)  # None: the checkpoint's default
    model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=args.max_new_tokens,
                   do_sample=do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   prompt_lookup_num_tokens=args.prompt_lookup, num_speculative_tokens=speculative_from_args(args),
                   streamer=streamer, seed=args.seed)
    print(model.stats.summary())  # with the disk tier's traffic when experts are read from disk
    print(model.memory_plan().summary())
    if args.json:
        print(json.dumps(model.stats.as_dict()))
    return 0


def cmd_demo(args) -> int:
    args.model = str(embedded_model_path())
    if not Path(args.model).is_dir():
        print(f"error: the embedded model is missing from {args.model}", file=sys.stderr)
        return 2
    from moeflow.io.checkpoint import read_json

    cfg = read_json(Path(args.model) / "config.json")
    experts = cfg["num_local_experts"]
    # half of all experts fit on the device: enough for a cache to matter, too few to hold the model
    if args.slots is not None:
        slots = args.slots  # OffloadConfig refuses < 1 with a clear error
    else:
        slots = None if args.gpu_memory_gb else cfg["num_hidden_layers"] * experts // 2
    model = _load(args, slots, args.policy)
    slots = getattr(model.experts, "n_slots", slots)
    print(f"moeflow demo: {cfg['num_hidden_layers']} layers x {experts} experts, {slots} expert slots "
          f"(policy {model.offload.policy!r}) on {model.device}\n")
    if args.seed is None:
        args.seed = 0  # the embedded model samples by default (its generation_config.json): keep the demo repeatable
    return _run_prompt(model, args.prompt, args)


def cmd_generate(args) -> int:
    model = _load(args, args.slots, args.policy)
    return _run_prompt(model, args.prompt, args)


def cmd_quantize(args) -> int:
    from moeflow.tools.quantize import quantize_checkpoint

    dst = quantize_checkpoint(args.src, args.dst, group_size=args.group_size, dtype=DTYPES[args.dtype],
                              quantize_attention=args.quantize_attention, overwrite=args.overwrite)
    print(f"wrote AWQ 4-bit checkpoint (group size {args.group_size}) to {dst}")
    return 0


def _gb_or_auto(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GB or 'auto', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of GB, got {text!r}")
    return value


def _add_generation_args(p: argparse.ArgumentParser, default_policy: str | None) -> None:
    p.add_argument("--prompt", default="The import statement")
    p.add_argument("--max-new-tokens", type=int, default=None)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sample", action="store_true", help="sample (default: the checkpoint's generation_config)")
    mode.add_argument("--greedy", action="store_true", help="greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None, help="transformers' (1: none)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                   help="prompt lookup decoding: draft up to N tokens per pass from earlier n-grams (greedy)")
    add_speculative_args(p)
    p.add_argument("--device", default=_default_device())
    p.add_argument("--dtype", choices=list(DTYPES), default=None)
    p.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--slots", type=int, default=None, help="GPU expert slots")
    p.add_argument("--gpu-memory-gb", type=_gb_or_auto, default=None,
                   help="device memory budget in GB, or 'auto' (free memory minus a margin); sizes the slots")
    p.add_argument("--host-memory-gb", type=_gb_or_auto, default=None,
                   help="host memory budget in GB, or 'auto'; experts that do not fit are read from disk")
    p.add_argument("--policy", default=default_policy,
                   help="an offload policy (default: every expert on the device when they fit, else 'auto'; "
                        "'auto' when --slots or --gpu-memory-gb is given)" if default_policy is None else None)
    add_device_switches(p, "step")
    add_loading_args(p)
    p.add_argument("--json", action="store_true", help="also print the stats as JSON")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the very first call too (by default a one-token warm-up runs first)")


def add_device_switches(p: argparse.ArgumentParser, what: str) -> None:
    """``--cuda-graphs`` and ``--early-hits`` (auto / on / off, read through :data:`AUTO_ON_OFF`); ``what`` the
    decode work the graphs replay ("step", or the server's "passes")."""
    p.add_argument("--cuda-graphs", choices=list(AUTO_ON_OFF), default="auto",
                   help=f"replay the decode {what} as CUDA graphs (auto: on when --device is CUDA)")
    p.add_argument("--early-hits", choices=list(AUTO_ON_OFF), default="auto",
                   help="compute each offloaded layer's experts already in slots while its routing is read back "
                        "(OffloadConfig.early_hits; auto: on for CUDA with the Triton kernels)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeflow")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the embedded tiny Mixtral with fewer expert slots than experts")
    _add_generation_args(p, "auto")
    p.set_defaults(func=cmd_demo, max_new_tokens=120)
    p = sub.add_parser("generate", help="generate text with any supported MoE checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory, hub id, or GGUF file (.gguf)")
    _add_generation_args(p, None)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("quantize", help="convert an fp16/bf16/fp32 MoE checkpoint to AWQ 4-bit")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                   help="dtype of the tensors that stay unquantized")
    p.add_argument("--quantize-attention", action="store_true",
                   help="also quantize q/k/v/o projections (and dense MLP layers and shared experts)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_quantize)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    # from the registered subcommands, so that the description cannot miss one
    parser.description = (f"moeflow runs Mixture-of-Experts LLMs on one GPU holding part of the model. Commands: "
                          f"{', '.join(sub.choices)}.")
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that ``finally`` and ``except
    BaseException`` blocks clean up (``quantize``'s temporary directory) before the process exits 143."""


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run one ``moeflow`` command; its exit status: 2 for an error it names, 130 after Ctrl-C, 143 after SIGTERM
    (128 + the signal, as a shell reports a process the signal ended), without a traceback."""
    from moeflow.errors import MoeflowError

    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal refuses other threads
    # servers install their own handlers while they run (uvicorn's) and restore this one after
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (MoeflowError, ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the terminal echoed ^C on
        return 128 + signal.SIGINT
    except Terminated:
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
