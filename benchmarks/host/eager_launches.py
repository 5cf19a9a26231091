"""Host work of one eager decoder layer on the Triton (GPU) path, counted, not timed: what ``moeflow serve`` and
micro-batches pay per layer on a GPU, where decode runs eagerly (no CUDA graph).

Run on the CPU under ``TRITON_INTERPRET=1``, the decode's Python is the GPU path's (``kernels="triton"``), so these
counts per decoder layer and decode step are deterministic build facts:

* ``triton``: Triton launches by kernel name (the interpreter's entry point; each is one ``JITFunction.run`` on
  a GPU, ~80 us of launcher Python per launch on the lent H100's host);
* ``aten_compute`` / ``aten_meta``: torch ops dispatched outside the launches (a TorchDispatchMode), those that
  launch a device kernel and the metadata-only ones (views, allocations);
* ``stream_objects`` / ``raw_stream_queries``: the CUDA branch of ``kernels.workspace``'s stream key, run against
  stand-ins for each scratch request (on the CPU it never reaches CUDA): ``torch.cuda.current_stream`` calls
  (~18 us each on that host) and raw current-stream queries;
* ``python_calls``: Python and builtin calls outside the launches (``sys.setprofile``, a second pass).

Two synthetic AWQ checkpoints (attention quantized too; ``benchmarks/common/checkpoint.py``): the GPU lane's tiny
Mixtral and one layer of Mixtral-8x7B's exact shapes (vocabulary cut to 256). At Mixtral's shapes the
interpreter would take minutes per layer, so there the launches are counted but not interpreted: all the host
Python up to each launch (configs, checks, scratch, arguments) runs as it does on a GPU, on unwritten outputs
(no value of the path reaches the host with the checks off). The value checks of the kernels' arguments are
off (``MOEFLOW_KERNEL_CHECKS=0``): on a GPU the resident path skips them. ``--before-rev REV``
counts the same for a git revision of this repository (``git archive`` into a temporary folder, run in a
subprocess) and writes both. The configs part lists, for the families' real attention shapes, the packed GEMM
config of q, k, v and of the fused q/k/v: where all are equal and every projection fills whole BLOCK_N tiles, each
column keeps its tile, place and K split, so the fused projection computes it as the three did (bitwise under
the interpreter, tests/test_fused_qkv.py; on a GPU not measured).

    PYTHONPATH=$PWD python -m benchmarks.host.eager_launches --before-rev dd3a7ec \\
        --out benchmarks/results/host_overhead/eager_launches.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
# aten ops that launch no device kernel (metadata, allocation)
META_OPS = {"view", "_unsafe_view", "reshape", "t", "slice", "select", "unsqueeze", "squeeze", "expand", "detach",
            "alias", "as_strided", "new_empty", "empty", "empty_strided", "set_", "lift_fresh", "split",
            "split_with_sizes", "transpose", "permute", "_reshape_alias", "unbind"}
# (name, hidden, heads, kv heads, head_dim): the families' published attention shapes (AWQ group 128)
FAMILY_SHAPES = [("mixtral-8x7b", 4096, 32, 8, 128), ("qwen3-30b-a3b", 2048, 32, 4, 128),
                 ("qwen3-235b-a22b", 4096, 64, 4, 128), ("qwen2-57b-a14b", 3584, 28, 4, 128),
                 ("qwen1.5-moe-a2.7b", 2048, 16, 16, 128), ("olmoe-1b-7b", 2048, 16, 16, 128),
                 ("glm-4.5-air", 4096, 96, 8, 128)]


class Counts:
    """Running totals; a decoder layer's share is the difference across its forward."""

    def __init__(self) -> None:
        self.c: collections.Counter = collections.Counter()
        self.inside_launch = 0

    def snapshot(self) -> collections.Counter:
        return collections.Counter(self.c)


class _AtenOps(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if not self.counts.inside_launch:
            name = func.overloadpacket.__name__
            self.counts.c["aten_meta" if name in META_OPS else "aten_compute"] += 1
            self.counts.c[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def counting(counts: Counts, aten: bool, python: bool, execute: bool = True):
    """Count launches (and aten ops or Python calls) into ``counts`` while inside; ``execute=False``: count each
    launch without interpreting the kernel (its outputs stay unwritten)."""
    from triton.runtime.interpreter import InterpretedFunction

    from moeflow.kernels import workspace

    run = InterpretedFunction.run

    def launch(fn, *args, **kwargs):
        counts.c["triton"] += 1
        counts.c[f"triton.{fn.fn.__name__}"] += 1
        counts.inside_launch += 1  # the interpreter's own work stands for the GPU's
        try:
            return run(fn, *args, **kwargs) if execute else None
        finally:
            counts.inside_launch -= 1

    def current_stream(device=None):
        counts.c["stream_objects"] += 1
        return types.SimpleNamespace(cuda_stream=7)

    def raw_stream(index):
        counts.c["raw_stream_queries"] += 1
        return 7

    stream_key = workspace._stream_key

    def counted_stream_key(device):
        counts.inside_launch += 1  # the stand-in's Python is not the path's
        try:
            with contextlib.ExitStack() as stack:  # the CUDA branch against stand-ins, for its queries
                stack.enter_context(_patched(torch.cuda, "current_stream", current_stream))
                stack.enter_context(_patched(torch.cuda, "current_device", lambda: 0))
                if hasattr(workspace, "_raw_current_stream"):
                    stack.enter_context(_patched(workspace, "_raw_current_stream", raw_stream))
                stream_key(torch.device("cuda", 0))
        finally:
            counts.inside_launch -= 1
        return stream_key(device)

    skip = {launch.__code__, counted_stream_key.__code__, current_stream.__code__, raw_stream.__code__}

    def profile(frame, event, arg):
        if event in ("call", "c_call") and not counts.inside_launch and frame.f_code not in skip:
            counts.c["python_calls"] += 1

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(InterpretedFunction, "run", launch))
        stack.enter_context(_patched(workspace, "_stream_key", counted_stream_key))
        if aten:
            stack.enter_context(_AtenOps(counts))
        if python:
            sys.setprofile(profile)
            stack.callback(sys.setprofile, None)
        yield


def decode_counts(model, groups: dict[str, list], prompt: torch.Tensor, new_tokens: int, aten: bool, python: bool,
                  execute: bool = True) -> dict[str, list[dict]]:
    """For each group of modules, the counts of every call of one of them at decode (one token per row), in
    call order: a greedy ``generate`` of ``new_tokens`` from ``prompt`` [B, T]."""
    counts = Counts()
    calls: dict[str, list[dict]] = {name: [] for name in groups}
    start: list[collections.Counter] = []

    def opened(mod, args):
        start.append(counts.snapshot())

    def closer(name: str):
        def closed(mod, args, out):
            before = start.pop()
            if args[0].shape[1] == 1:
                calls[name].append(dict(counts.c - before))
        return closed

    hooks = [h for name, modules in groups.items() for m in modules
             for h in (m.register_forward_pre_hook(opened), m.register_forward_hook(closer(name)))]
    try:
        with counting(counts, aten, python, execute):
            model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
    finally:
        for h in hooks:
            h.remove()
    return calls


def per_layer_decode(model, prompt: torch.Tensor, new_tokens: int, aten: bool, python: bool,
                     execute: bool = True) -> list[dict]:
    """The counts of every decoder layer call at decode, in call order."""
    return decode_counts(model, {"layers": list(model.model.layers)}, prompt, new_tokens, aten, python,
                         execute)["layers"]


def summarize(layers: list[dict]) -> dict:
    """One decode layer's counts (the first layer of the given step) and whether every layer counted the same."""
    keys = ("triton", "aten_compute", "aten_meta", "stream_objects", "raw_stream_queries", "python_calls")
    first = layers[0]
    same = all(lay.get(k, 0) == first.get(k, 0) for lay in layers for k in keys)
    detail = {k: v for k, v in sorted(first.items()) if "." in k}
    return {**{k: first.get(k, 0) for k in keys}, "stream_queries": first.get("stream_objects", 0)
            + first.get("raw_stream_queries", 0), "layers_in_step": len(layers), "equal_across_layers": same,
            "detail": detail}


def synthetic_model(name: str, dtype: torch.dtype, workdir: Path):
    """"tiny": the GPU lane's tiny AWQ Mixtral (2 layers, hidden 128, group 32, attention quantized);
    "mixtral-8x7b-layer": one layer of Mixtral-8x7B's shapes (group 128), vocabulary 256."""
    from benchmarks.common.checkpoint import MIXTRAL_8X7B, TINY, write_synthetic_awq_checkpoint
    from moeflow import MoEOffloadedMixtral

    config, group = (TINY, 32) if name == "tiny" else ({**MIXTRAL_8X7B, "num_hidden_layers": 1, "vocab_size": 256},
                                                       128)
    ckpt = write_synthetic_awq_checkpoint(workdir / f"{name}-awq", config, group_size=group)
    return MoEOffloadedMixtral.from_pretrained(ckpt, device="cpu", dtype=dtype, kernels="triton", progress=False)


def measure(workdir: Path, models: list[str], new_tokens: int) -> dict:
    """Counts per decode layer of each model, with the current ``moeflow`` import."""
    import moeflow

    torch.manual_seed(0)
    out = {"moeflow": str(Path(moeflow.__file__).parent), "models": {}}
    for name in models:
        model = synthetic_model(name, torch.float16, workdir)
        prompt = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(0))
        fused = [m for m in model.model.modules() if getattr(m, "fused_qkv", False)]
        n = len(model.model.layers)  # the last decode step's layers: one-time caches were filled before
        execute = name == "tiny"  # Mixtral's shapes take the interpreter minutes per layer: counted, not run
        entry = summarize(per_layer_decode(model, prompt, new_tokens, True, False, execute=execute)[-n:])
        python = summarize(per_layer_decode(model, prompt, new_tokens, False, True, execute=execute)[-n:])
        entry["kernels_interpreted"] = execute
        entry["python_calls"] = python["python_calls"]
        entry["fused_qkv_layers"] = len(fused)
        out["models"][name] = entry
    return out


def config_table() -> list[dict]:
    """Packed GEMM configs of q, k, v and the fused q/k/v for the families' shapes, per token count."""
    from moeflow.kernels.experts.configs import packed_linear_config

    rows = []
    for name, h, heads, kv, d in FAMILY_SHAPES:
        n = {"q": heads * d, "k": kv * d, "v": kv * d}
        fused_n = sum(n.values())
        for m in (1, 2, 4, 8, 16, 64, 512):
            cfgs = {p: packed_linear_config(m, width, h, 128) for p, width in n.items()}
            fused = packed_linear_config(m, fused_n, h, 128)
            # a column keeps its arithmetic when the config is the same and it keeps its place in its BLOCK_N tile
            aligned = all(width % fused["BLOCK_N"] == 0 for width in n.values())
            rows.append({"family": name, "m": m, "n_q": n["q"], "n_kv": n["k"], "n_fused": fused_n, "k": h,
                         "split_k": {**{p: c["SPLIT_K"] for p, c in cfgs.items()}, "fused": fused["SPLIT_K"]},
                         "tiles_aligned": aligned,
                         "bitwise_as_unfused": aligned and all(c == fused for c in cfgs.values())})
    return rows


def run_revision(rev: str, workdir: Path, models: list[str], new_tokens: int) -> dict:
    """``measure`` for git revision ``rev`` of this repository (archived into ``workdir``), in a subprocess."""
    tree = workdir / f"tree-{rev}"
    if not tree.is_dir():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    # moeflow from ``tree``; ``benchmarks`` from this checkout unless ``tree`` has it as a package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)]), "TRITON_INTERPRET": "1",
           "MOEFLOW_KERNEL_CHECKS": "0"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--single", "--workdir", str(workdir),
           "--models", ",".join(models), "--new-tokens", str(new_tokens)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,mixtral-8x7b-layer")
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--before-rev", default=None, help="also count this git revision (e.g. the merge base)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "moeflow-eager-launches")
    ap.add_argument("--single", action="store_true", help="print this tree's counts as one JSON line (internal)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ["MOEFLOW_KERNEL_CHECKS"] = "0"  # the value checks (a host sync) run on the CPU only, never on a GPU
    torch.set_num_threads(1)
    models = args.models.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.single:
        print(json.dumps(measure(args.workdir, models, args.new_tokens)))
        return {}
    result = {"what": "per decoder layer, one decode step (1 token), eager Triton path, fp16, resident experts",
              "torch": torch.__version__, "after": measure(args.workdir, models, args.new_tokens),
              "configs": config_table()}
    if args.before_rev:
        result["before_rev"] = args.before_rev
        result["before"] = run_revision(args.before_rev, args.workdir, models, args.new_tokens)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for label in ("before", "after"):
        for name, entry in result.get(label, {}).get("models", {}).items():
            print(f"{label:6s} {name:20s} " + " ".join(f"{k}={entry[k]}" for k in (
                "triton", "aten_compute", "aten_meta", "stream_objects", "raw_stream_queries", "python_calls")))
    return result


if __name__ == "__main__":
    main()
