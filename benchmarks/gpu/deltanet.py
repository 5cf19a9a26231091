"""One Qwen3-Next-80B-A3B Gated DeltaNet layer's core on a GPU: the torch reference against the Triton kernels.

    python -m benchmarks.gpu.deltanet --out $OUT/deltanet.jsonl          # Qwen3-Next-80B shapes, on a GPU
    python -m benchmarks.gpu.deltanet --tiny --out /tmp/deltanet.jsonl   # tiny shapes, CPU (interpreter)

The core is what :class:`~moeflow.families.gated_deltanet.GatedDeltaNet` runs between its input projections and
its output norm: the causal conv + SiLU and the gated delta rule (gates, L2 norms, query scale), both states
advanced. Qwen3-Next-80B-A3B's linear-attention sizes (config.json: ``linear_num_key_heads`` 16,
``linear_num_value_heads`` 32, ``linear_key_head_dim`` = ``linear_value_head_dim`` = 128,
``linear_conv_kernel_dim`` 4; :meth:`HybridMoEConfig.deltanet_shape`), bf16 activations, fp32 recurrent state:

* decode (1 token) at 1 / 8 / 64 rows: torch ``conv`` + ``rule_inputs`` + ``recurrent_gated_delta_rule`` against
  ``deltanet.conv_decode`` + ``deltanet.recurrent``;
* prefill of one prompt of 512 / 4096 / 32768 tokens: torch ``conv`` + ``chunk_gated_delta_rule`` (64-token
  chunks) against torch ``conv`` + the Triton recurrence (one launch for the whole prompt), as the layer runs them.

Each implementation is timed eagerly and under CUDA-graph replay (``gpu.timing.time_ours``; ``us`` is the replay's
median, the eager one where capture failed, the error recorded). ``bytes`` counts the least a launch must move:
the recurrent state read and written once (fp32), the conv state read and written, the conv input, the gates and
the output; ``frac_of_copy_bw`` divides bytes/s by the device-copy bandwidth measured at the start (decode only:
there the state traffic is the cost; a prompt's recurrence is bound by its serial token loop). The Triton line of
a point also carries ``max_abs_diff`` of its output and ``max_abs_diff_state`` of its recurrent state against the
torch reference from the same inputs (``ref_max_abs``: the reference output's magnitude, for scale).

Every measurement prints one JSON line (and appends it to ``--out``) as it is taken; a failing one is recorded
with its error and the run goes on; ``--budget-s`` stops starting new points. The first line describes the run
(device, versions, shapes, copy bandwidth). ``--tiny`` runs tiny shapes in fp32 on the CPU, the Triton side under
``TRITON_INTERPRET=1`` (set here when unset, before torch imports Triton), one call timed by the wall clock: a
smoke, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

if "--tiny" in sys.argv[1:]:  # torch imports triton: the interpreter must be chosen before (a CLI run; tests set it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from benchmarks.gpu.timing import copy_bandwidth, median, time_fn, time_ours
from moeflow.families.gated_deltanet import (
    DeltaNetShape,
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

# name: (linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, conv kernel)
SHAPES = {"qwen3-next-80b": (16, 32, 128, 128, 4), "tiny": (2, 4, 8, 6, 4)}
HIDDEN = {"qwen3-next-80b": 2048, "tiny": 24}  # the projections are not run: only the layer's own parameters
DECODE_ROWS, PREFILL_TOKENS = (1, 8, 64), (512, 4096, 32768)
TINY_DECODE_ROWS, TINY_PREFILL_TOKENS = (1, 3), (8, 70)  # 70: past one 64-token chunk, a ragged tail


def make_layer(shape_name: str, dtype: torch.dtype, device: str, seed: int = 0) -> GatedDeltaNet:
    """A Gated DeltaNet of the named sizes with random conv weights, decays and gate biases (A_log in [log 0.2,
    log 2], as trained layers spread them)."""
    hk, hv, dk, dv, kw = SHAPES[shape_name]
    shape = DeltaNetShape(HIDDEN[shape_name], hk, hv, dk, dv, kw, fused_projections=True)
    layer = GatedDeltaNet(shape, 0, lambda n, i, o: torch.nn.Linear(i, o, bias=False, dtype=dtype), dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen) * 0.3)
        layer.A_log.copy_(torch.empty(hv).uniform_(-1.6, 0.7, generator=gen))
        layer.dt_bias.copy_(torch.randn(hv, generator=gen) * 0.5)
    return layer.to(device)


def point_inputs(layer: GatedDeltaNet, rows: int, t: int, dtype: torch.dtype, device: str, seed: int) -> dict:
    """Random conv input qkv [rows, t, C], gates a/b [rows, t, Hv], conv state [rows, K-1, C], recurrent state fp32
    [rows, Hv, dk, dv] and an all-real mask [rows, t] (what the layer reads from its cache)."""
    s = layer.shape
    gen = torch.Generator(device=device).manual_seed(seed)
    return {"qkv": torch.randn(rows, t, s.conv_dim, device=device, generator=gen).to(dtype),
            "a": torch.randn(rows, t, s.num_v_heads, device=device, generator=gen).to(dtype),
            "b": torch.randn(rows, t, s.num_v_heads, device=device, generator=gen).to(dtype),
            "conv": (torch.randn(rows, s.conv_kernel - 1, s.conv_dim, device=device, generator=gen)).to(dtype),
            "state": torch.randn(rows, s.num_v_heads, s.k_head_dim, s.v_head_dim, device=device, generator=gen) * 0.1,
            "mask": torch.ones(rows, t, dtype=torch.bool, device=device)}


def torch_core(layer: GatedDeltaNet, x: dict) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The reference: conv, then the recurrent rule (1 token) or the chunked one (a prompt) -> (o [B, T, Hv, dv],
    the recurrent state after). Reads fresh copies of nothing: the states it returns are new tensors."""
    t = x["qkv"].shape[1]
    rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        qkv, _ = layer.conv(x["qkv"], x["conv"], x["mask"])
        out, state = rule(*layer.rule_inputs(qkv, x["a"], x["b"], x["mask"]), x["state"])
        return out.transpose(1, 2).to(x["qkv"].dtype), state
    return run


def triton_core(layer: GatedDeltaNet, x: dict) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """The kernels as the layer launches them, on copies of the states (advanced in place by every call) -> (the
    call returning o [B, T, Hv, dv], the recurrent state it advances)."""
    from moeflow.kernels import deltanet

    s = layer.shape
    conv_state, state = x["conv"].clone(), x["state"].clone()
    t = x["qkv"].shape[1]

    def run() -> torch.Tensor:
        if t == 1:
            qkv = deltanet.conv_decode(x["qkv"], conv_state, layer.conv1d.weight, x["mask"])
        else:
            qkv, _ = layer.conv(x["qkv"], conv_state, x["mask"])
        return deltanet.recurrent(qkv, x["a"], x["b"], layer.A_log, layer.dt_bias, x["mask"], state, s.num_k_heads,
                                  s.k_head_dim, x["qkv"].dtype)
    return run, state


def moved_bytes(layer: GatedDeltaNet, rows: int, t: int, elt: int) -> dict[str, int]:
    """The least one call reads and writes: recurrent state (fp32) and conv state once each way, the conv input,
    the gates a/b and the output o."""
    s = layer.shape
    state = rows * s.num_v_heads * s.k_head_dim * s.v_head_dim * 4
    conv = rows * (s.conv_kernel - 1) * s.conv_dim * elt
    io = rows * t * (s.conv_dim + 2 * s.num_v_heads + s.value_dim) * elt
    return {"state_bytes": 2 * (state + conv), "bytes": 2 * (state + conv) + io}


def points(decode_rows: tuple[int, ...], prefill_tokens: tuple[int, ...]) -> Iterator[tuple[str, int, int]]:
    yield from (("decode", r, 1) for r in decode_rows)
    yield from (("prefill", 1, t) for t in prefill_tokens)


def reps(t: int, quick: bool, tiny: bool) -> int:
    return 1 if tiny else 3 if quick else 30 if t == 1 else 10 if t <= 512 else 3


def measure(layer: GatedDeltaNet, mode: str, rows: int, t: int, args: argparse.Namespace, copy_bps: float | None,
            emit: Callable[[dict], None]) -> None:
    """Both implementations at one point: one line each (the Triton one with the differences to torch)."""
    x = point_inputs(layer, rows, t, args.dtype, args.device, seed=rows * 100003 + t)
    base = {"mode": mode, "shape": args.shape, "rows": rows, "tokens": t, "dtype": str(args.dtype)[6:],
            **moved_bytes(layer, rows, t, x["qkv"].element_size())}
    n = reps(t, args.quick, args.tiny)
    ref = None
    for impl in args.impls:
        row = {**base, "impl": impl}
        try:
            with torch.no_grad():
                if impl == "torch":
                    fn = torch_core(layer, x)
                    ref = fn()
                else:
                    fn, state = triton_core(layer, x)
                    out = fn()  # one call from the reference's states: compared before timing advances them
                    if ref is not None:
                        row.update(max_abs_diff=float((out.float() - ref[0].float()).abs().max()),
                                   max_abs_diff_state=float((state - ref[1]).abs().max()),
                                   ref_max_abs=float(ref[0].float().abs().max()),
                                   all_finite=bool(torch.isfinite(out).all()))
                timed = time_ours(fn, args.device, n) if args.device.startswith("cuda") else {
                    "ours_s": median(time_fn(fn, args.device, n, warmup=0)), "timed_as": "wall_clock"}
        except Exception as exc:  # one failing measurement (out of memory, a compile error) must not stop the run
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            emit(row)
            continue
        sec = timed["ours_s"]
        row.update(us=sec * 1e6, timed_as=timed["timed_as"], eager_us=timed.get("ours_eager_s", sec) * 1e6,
                   tokens_per_s=rows * t / sec)
        if "ours_graph_error" in timed:
            row["graph_error"] = timed["ours_graph_error"][:300]
        if mode == "decode" and copy_bps:
            row["frac_of_copy_bw"] = row["bytes"] / sec / copy_bps
        emit(row)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes in fp32 on the CPU (Triton interpreted)")
    ap.add_argument("--decode-rows", default=None, help=f"comma list (default {DECODE_ROWS})")
    ap.add_argument("--prefill-tokens", default=None, help=f"comma list (default {PREFILL_TOKENS})")
    ap.add_argument("--impls", default="torch,triton", help="comma list of torch, triton (torch first: reference)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="3 repetitions per measurement")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new points after this long")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file too")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.tiny:
        args.shape, args.device, args.dtype = "tiny", "cpu", torch.float32
        rows_default, tokens_default = TINY_DECODE_ROWS, TINY_PREFILL_TOKENS
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny on the CPU")
        args.shape, args.device, args.dtype = "qwen3-next-80b", "cuda", getattr(torch, args.dtype)
        rows_default, tokens_default = DECODE_ROWS, PREFILL_TOKENS
    decode_rows = tuple(int(r) for r in args.decode_rows.split(",") if r) if args.decode_rows else rows_default
    prefill = tuple(int(t) for t in args.prefill_tokens.split(",") if t) if args.prefill_tokens else tokens_default
    args.impls = [i for i in args.impls.split(",") if i]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    lines: list[dict] = []

    def emit(row: dict) -> None:
        lines.append(row)
        text = json.dumps(row)
        print(text, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(text + "\n")

    fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim")
    env = {"kind": "env", "shape": args.shape, "sizes": dict(zip(fields, SHAPES[args.shape], strict=True)),
           "device": args.device, "torch": torch.__version__, "python": platform.python_version(),
           "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    copy_bps = None
    if args.device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name()
        copy_bps = copy_bandwidth(args.device, 2**30)["bytes_per_s"]
        env["copy_bytes_per_s"] = copy_bps
    emit(env)
    layer = make_layer(args.shape, args.dtype, args.device)
    for mode, rows, t in points(decode_rows, prefill):
        if time.perf_counter() - t_start > args.budget_s:
            emit({"mode": mode, "rows": rows, "tokens": t, "error": "skipped: time budget"})
            continue
        measure(layer, mode, rows, t, args, copy_bps, emit)
    return lines


if __name__ == "__main__":
    main()
