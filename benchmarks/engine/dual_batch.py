"""ExpertFlow's dual-batch pipeline: decode round time with and without it, prediction artificially slowed.

Policy ``expertflow`` on the tests' tiny random Mixtral (3 layers, 8 experts, top-2; an expertflow predictor
trained on a short trace of it first; ``--model PATH`` for a checkpoint that ships ``predictors/expertflow.pt``,
e.g. the embedded model, whose CPU expert kernels make a run take minutes), a batch of B left-padded prompts in
micro-batches of m (n = B/m passes per round). Each prediction job (the routing-path scores of one micro-batch)
is slowed by ``delay``; the token scheduler is the real one. Rows:

* ``virtual``: the real generate loop on moeflow.sim's SimClock: every decode pass costs ``decode`` virtual
  seconds and the side work costs what it is told (VirtualLane), the pipeline's lane overlapping the passes or
  run inline. Deterministic: shows the pipeline's dependencies, not this machine's speed.
* ``cpu``: wall clock on this CPU: the worker thread (ThreadLane) against the same work inline (InlineLane); the
  delay is a ``time.sleep`` in the worker (the slowed predictor), the decode is the model's real passes.

Expected: with the pipeline a round takes about max(n * decode, n * (predict + delay) + schedule), without it
their sum.

    PYTHONPATH=$PWD python -m benchmarks.engine.dual_batch [--batch 8] [--micro 4] [--tokens 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine import generate as gen_mod
from moeflow.engine.side_lane import InlineLane, ThreadLane, VirtualLane
from moeflow.offload.policies.expertflow import PLECPredictor
from moeflow.offload.policies.expertflow.pipeline import DualBatchPipeline
from moeflow.sim.engine import SimClock


def tiny_model(directory: Path, slots: int) -> MoEOffloadedMixtral:
    """The tests' tiny random Mixtral with an expertflow predictor trained on 12 prompts (3 epochs)."""
    from moeflow.offload.predictors import train_predictor
    from moeflow.tools.record import record_trace
    from tests.helpers import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(directory / "ckpt", seed=5, num_local_experts=8, num_hidden_layers=3)
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, 97, (int(torch.randint(4, 14, (1,), generator=g)),), generator=g).tolist()
             for _ in range(12)]
    trace = record_trace(MoEOffloadedMixtral.from_pretrained(ckpt), texts, 5)
    path = train_predictor("expertflow", trace, epochs=3, seed=0).save(directory / "expertflow.pt")
    return MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(
        policy="expertflow", gpu_expert_slots=slots, predictor_path=str(path)))


def prompts(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """batch left-padded prompts of 4..16 tokens of ids 32..96: ids, mask [B, T]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 17, (batch,), generator=g).tolist()
    ids = torch.zeros((batch, max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(32, 97, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


def round_times(model, ids, mask, m: int, tokens: int, lane) -> list[float]:
    """Seconds of each decode round after the first (clock: the lane's), through the pipeline on ``lane``."""
    clock, times = lane.clock, []
    real_round = DualBatchPipeline.round

    def timed(self, *a, **k):
        t0 = clock()
        out = real_round(self, *a, **k)
        times.append(clock() - t0)
        return out

    DualBatchPipeline.round = timed
    try:
        gen = model.generation_config.override(max_new_tokens=tokens, eos_token_id=[])
        gen_mod.generate(model._runner, gen, ids, mask != 0, micro_batch_size=m, dual_batch=True, lane=lane)
    finally:
        DualBatchPipeline.round = real_round
    return times[1:]


def virtual_rows(model, ids, mask, m: int, tokens: int, decode: float, schedule: float) -> list[dict]:
    runner = model._runner
    real_pass = runner.forward_pass
    n = -(-ids.shape[0] // m)
    rows = []
    for share, modes in ((0.0, (True,)), (0.5, (True, False)), (0.9, (True, False)), (1.5, (True,))):
        predict = share * decode
        for overlaps in modes:
            clock = SimClock()

            def timed_pass(*a, clock=clock, **k):
                out = real_pass(*a, **k)
                if a[5] == "decode":
                    clock.advance_to(clock.now + decode)
                return out

            runner.forward_pass = timed_pass
            costs = {"_predict": predict, "_schedule": schedule}
            lane = VirtualLane(clock, lambda fn, costs=costs: costs[fn.__name__], overlaps=overlaps)
            try:
                t = statistics.mean(round_times(model, ids, mask, m, tokens, lane))
            finally:
                runner.forward_pass = real_pass
            side = n * predict + schedule
            rows.append(dict(mode="virtual", pipeline=overlaps, decode_round=n * decode, side_round=side,
                             round=t, max=max(n * decode, side), sum=n * decode + side))
            print_row(rows[-1])
    return rows


def cpu_rows(model, ids, mask, m: int, tokens: int, repeats: int) -> list[dict]:
    pred = model.experts.predictor
    assert isinstance(pred, PLECPredictor)
    real_scores = pred.step_scores
    n = -(-ids.shape[0] // m)
    delay = 0.0

    def slowed(step):
        time.sleep(delay)
        return real_scores(step)

    pred.step_scores = slowed

    def measure(lane_kind: str) -> tuple[float, float, float]:
        best = None
        for _ in range(repeats):
            lane = ThreadLane(model.device) if lane_kind == "thread" else InlineLane()
            t = statistics.median(round_times(model, ids, mask, m, tokens, lane))
            st = model.pipeline_stats
            side = (st.lane_busy_s - st.schedule_s) / max(1, st.predict_jobs) * n + st.schedule_s / max(1, st.rounds)
            best = min(best or (t, side, st.exposed_s), (t, side, st.exposed_s))
        return best

    decode_round, _, _ = measure("thread")  # no delay: what a round costs with the predictor as it is
    rows = []
    for share in (0.0, 0.9):
        delay = share * decode_round / n
        for lane_kind in ("thread", "inline"):
            t, side, exposed = measure(lane_kind)
            rows.append(dict(mode="cpu", pipeline=lane_kind == "thread", delay_per_job=delay, decode_round=decode_round,
                             side_round=side, round=t, max=max(decode_round, side), sum=decode_round + side,
                             exposed_s=exposed))
            print_row(rows[-1])
    pred.step_scores = real_scores
    return rows


def print_row(r: dict) -> None:
    print(f"| {r['mode']} | {'on' if r['pipeline'] else 'off'} | {r['decode_round'] * 1e3:.2f} | "
          f"{r['side_round'] * 1e3:.2f} | {r['round'] * 1e3:.2f} | {r['max'] * 1e3:.2f} | {r['sum'] * 1e3:.2f} | "
          f"{r['round'] / r['max']:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", type=Path, help="a checkpoint with predictors/expertflow.pt (default: tiny random)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    tmp = tempfile.TemporaryDirectory()
    if args.model is None:
        model = tiny_model(Path(tmp.name), args.slots)
    else:
        model = MoEOffloadedMixtral.from_pretrained(args.model, offload=OffloadConfig(policy="expertflow",
                                                                                      gpu_expert_slots=args.slots))
    name = args.model.name if args.model is not None else "tiny random Mixtral (3 x 8 experts)"
    ids, mask = prompts(args.batch)
    print(f"expertflow, {name}, B={args.batch}, m={args.micro}, {args.slots} slots, {args.tokens} tokens; "
          f"torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} threads")
    print("| mode | pipeline | decode / round ms | predict + schedule / round ms | round ms | max ms | sum ms |"
          " round / max |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = virtual_rows(model, ids, mask, args.micro, args.tokens, decode=1e-3, schedule=1e-4)
    rows += cpu_rows(model, ids, mask, args.micro, args.tokens, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    model.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
