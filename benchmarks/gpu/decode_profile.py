"""Steady-state decode on a GPU: is it host-bound? (issue 14's GPU criterion; issue 12 stage 3 follow-up)

For ``resident`` and ``lru`` (every expert fitting, and half of them), on the synthetic Mixtral-8x7B-shaped AWQ
checkpoint (``--layers`` of its 32 layers), a greedy decode is first run twice at the measured shape (prompt and
token count: every Triton specialization and cuDNN plan built), then timed (``--new-tokens`` decode steps), then
profiled for a few steps with ``torch.profiler``. Reported per policy: ms per decode step, and per MoE layer the
host time (wall time of a step / layers: the host issues a layer's work no faster than this) against the GPU time
(sum of the step's kernel and copy durations in the trace / layers). ``host_bound`` is wall > 1.5x GPU busy.
Optionally (``--graphs``) the same with the decode step captured as CUDA graphs (``model.capture_decode()``). lru
runs with early hits on and off, and (every expert fitting) with the captured prelude off (``captured_preludes``).

    python -m benchmarks.gpu.decode_profile --layers 8 --out $OUT/decode_profile.json
    python -m benchmarks.gpu.decode_profile --tiny --out /tmp/decode_profile.json   # the CPU sizes (no GPU times)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common.checkpoint import add_checkpoint_args, mixtral_setup, write_synthetic_awq_checkpoint
from benchmarks.gpu.engine import cpu_capture_factory, load_in_ram
from benchmarks.gpu.offload import _sync, install_backend


class _StepClock:
    """A streamer (``put``/``end``) that stamps each token as it reaches the host: put #0 is the prompt, #1 the
    prefill's token, each later one a decode step's."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, ids: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _decode(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Seconds per decode step of one generate at the warmed-up shape (no new cache, no recapture)."""
    clock = _StepClock()
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], streamer=clock)
    return (clock.stamps[-1] - clock.stamps[1]) / (len(clock.stamps) - 2), out


def _profile(model, prompt: torch.Tensor, steps: int) -> dict:
    """GPU busy ms per decode step from a trace of (prefill + steps) minus a trace of prefill alone (with CUDA
    graphs the two shapes each capture once more: the wall time then includes captures; the GPU time does not
    count a capture's work twice only approximately)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def busy(n: int) -> tuple[float, float]:
        _sync(model.device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=[])
            _sync(model.device)
            wall = time.perf_counter() - t0
        gpu = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e3  # ms
        # top-level kernels only: key_averages' CUDA rows are the kernels and memcpys themselves
        return wall * 1e3, gpu
    w1, g1 = busy(1)
    wn, gn = busy(1 + steps)
    return {"profiled_wall_ms_per_step": (wn - w1) / steps,
            "gpu_busy_ms_per_step": (gn - g1) / steps if cuda else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--graphs", action="store_true", help="also with the decode step captured as CUDA graphs")
    ap.add_argument("--graphs-only", action="store_true", help="only the CUDA-graph rows (eager is slow at 32 layers)")
    ap.add_argument("--slots", default=None, help="comma-separated lru slot counts (default: all experts, half)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    device, dtype, config, kernels, group, ckpt = mixtral_setup(args)
    write_synthetic_awq_checkpoint(ckpt, config, group_size=group)
    L, E = config["num_hidden_layers"], config["num_local_experts"]
    model = load_in_ram(ckpt, device, dtype, kernels, L * E)  # eager (the eager rows); --graphs captures
    host = model.experts.host
    prompt = torch.randint(3, config["vocab_size"], (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result: dict = {"device": name, "torch": torch.__version__, "layers": L,
                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": []}
    expected = None
    modes = ([] if args.graphs_only else ["eager"]) + (["cuda_graphs"] if args.graphs or args.graphs_only else [])
    lru = [int(n) for n in args.slots.split(",")] if args.slots else [L * E, L * E // 2]
    # lru twice: hits launched before the read-back (the default on CUDA) and the serial schedule (early_hits off);
    # at every expert fitting also with the routing and read-back staging left eager between the captured pieces
    # (PreludeCapture.enabled off: moeflow/offload/prelude.py), which only the cuda_graphs rows can tell apart
    runs = [("resident", L * E, None, True)] + [("lru", n, e, True) for n in lru for e in (None, False)]
    runs.insert(2, ("lru", lru[0], None, False))
    for policy, slots, early, preludes in runs:
        backend = install_backend(model, host, policy, slots, "auto", early_hits=early)
        prelude = getattr(backend, "prelude", None)  # the offloading backend's (the resident one has none)
        if prelude is not None:
            prelude.enabled = preludes
        for mode in modes:
            row: dict = {"policy": policy, "slots": slots, "mode": mode,
                         "early_hits": getattr(backend, "early_hits", None),
                         "captured_preludes": prelude.enabled if prelude is not None else None}
            try:
                if mode == "cuda_graphs":
                    graphs = model.capture_decode(None if device.type == "cuda" else cpu_capture_factory())
                for _ in range(2):  # every specialization, plan and capture made at this shape
                    model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=[])
                step_s, out = _decode(model, prompt, args.new_tokens)
                expected = out if expected is None else expected
                if mode == "cuda_graphs":
                    calls = graphs.step.calls if graphs.step is not None else []
                    row.update(captures=graphs.captures, refused=graphs.refused,
                               layers_with_prelude=sum(getattr(c, "prelude", None) is not None for c in calls))
                row.update(ms_per_step=step_s * 1e3, tok_s=1 / step_s, tokens_equal_resident=bool(
                    torch.equal(out, expected)), **_profile(model, prompt, args.profile_steps))
                row["host_ms_per_layer"] = row["ms_per_step"] / L
                if row["gpu_busy_ms_per_step"] is not None:
                    row["gpu_ms_per_layer"] = row["gpu_busy_ms_per_step"] / L
                    row["host_bound"] = row["ms_per_step"] > 1.5 * row["gpu_busy_ms_per_step"]
            except Exception as exc:  # one failing row must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                if mode == "cuda_graphs":
                    model.runner.decode_fn = getattr(model.runner.decode_fn, "inner", model.runner.decode_fn)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
