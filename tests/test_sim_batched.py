"""Batched replay (moeflow/sim/batched.py, ``simulate(batch=)``, ``moeflow simulate --batch``): B sequences of a
batch-1 trace prefilled in one pass and decoded one pass per step. lru's and lfu's expert loads equal the CPU
runtime's generate of the same prompts as one left-padded batch (batch 2-4); every pass hands begin_step what the
engine hands it for that batch, and on an ideal link (``h2d_gbps=math.inf``: copies land as they are issued)
mixtral-offloading's, duoserve's, promoe's, expertflow's and finemoe's loads equal the (synchronous) runtime's too,
at batch 1 and 3 (a fast finite link does not: pinned); pinned counts. ~25 s on 2 cores."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from moeflow import MoEModel, MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.moe.backend import StepInfo
from moeflow.sim import custom_profile, simulate
from moeflow.sim.batched import BatchError, batch_passes
from moeflow.sim.simulator import SimulationError
from moeflow.tools.record import record_trace
from moeflow.trace import DECODE, PREFILL

pytestmark = pytest.mark.usefixtures("one_thread")

PROFILE = custom_profile(h2d_gbps=20.0, expert_mb=40.0, layer_ms=0.3, expert_ms=0.25, expert_ms_per_token=0.02,
                         head_ms=0.4, sched_ms=0.05, latency_us=12.0)
TEXTS = ("The \"with\" statement is used to wrap", "def add(a, b):", "import os\nimport sys", "class Foo:")
NEW = 8


@pytest.fixture(scope="module")
def recorded():
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch")
    try:
        prompts = [model.tokenizer.encode(p) for p in TEXTS]
        return prompts, record_trace(model, prompts, max_new_tokens=NEW, hidden=True, embed=True)
    finally:
        model.close()


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def runtime(policy: str, slots: int, prompts, seen: list[StepInfo] | None = None):
    model = MoEModel.from_pretrained(embedded_model_path(), kernels="torch",
                                     offload=OffloadConfig(policy=policy, gpu_expert_slots=slots, transport="sync"))
    if seen is not None:
        begin = model.experts.begin_step
        model.experts.begin_step = lambda step: (seen.append(step), begin(step))[1]
    ids, mask = left_padded(prompts)
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    stats, nbytes = model.stats, model.experts.fmt.nbytes
    model.experts.close()
    return stats, nbytes


@pytest.mark.parametrize("batch,slots", [(2, 12), (3, 20), (4, 12)])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_loads_equal_the_runtime_at_batch(recorded, policy, batch, slots):
    prompts, trace = recorded
    stats, nbytes = runtime(policy, slots, prompts[:batch])
    res = simulate(trace.select(range(batch)), policy, slots, PROFILE, timeline=False, batch=batch)
    assert res.prefill_bytes_h2d / PROFILE.expert_bytes == pytest.approx(stats.prefill.bytes_h2d / nbytes)
    assert res.decode_bytes_h2d / PROFILE.expert_bytes == pytest.approx(stats.decode.bytes_h2d / nbytes)
    assert res.decode_hit_rate == pytest.approx(stats.decode.hit_rate)
    assert res.decode_generated_tokens == stats.decode.tokens == batch * (NEW - 1)
    assert res.decode_steps == NEW - 1 and res.sequences == 1
    one = simulate(trace.select(range(batch)), policy, slots, PROFILE, timeline=False)  # one sequence at a time
    assert one.decode_steps == batch * (NEW - 1) and one.decode_hit_rate != pytest.approx(res.decode_hit_rate)


# an ideal link (copies take no time): a copy lands at the instant it is issued, as the runtime's synchronous copies
# do. A fast finite link is not enough: the host clock does not move between a layer's prefetches and the next
# layer's proposals, so copies of even 1e-15 s are still in flight there (LOADING: neither free nor evictable),
# which moves expertflow's whole-budget plan and finemoe's victims (docs/simulator.md "Batched decode")
INSTANT = custom_profile(h2d_gbps=math.inf, expert_mb=0.01, layer_ms=0.3, expert_ms=0.25, expert_ms_per_token=0.02,
                         head_ms=0.4, sched_ms=0.05, latency_us=0.0)
FAST = dataclasses.replace(INSTANT, h2d_gbps=1e7)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", ["mixtral-offloading", "duoserve", "promoe", "expertflow", "finemoe"])
def test_predictive_loads_equal_the_runtime_on_an_instant_link(recorded, policy, batch):
    """The predictors see at batch 3 what the engine's do (their tokens, histories, embeddings, hidden states):
    with copies that take no time their guesses and so their loads are the synchronous runtime's."""
    from moeflow.sim.simulator import load_gates

    prompts, trace = recorded
    stats, nbytes = runtime(policy, 12, prompts[:batch])
    gates = load_gates(embedded_model_path(), trace.num_layers)
    res = simulate(trace.select(range(batch)), policy, 12, INSTANT, timeline=False, batch=batch, gates=gates,
                   predictor_dir=embedded_model_path())
    assert res.prefill_bytes_h2d / INSTANT.expert_bytes == pytest.approx(stats.prefill.bytes_h2d / nbytes)
    assert res.decode_bytes_h2d / INSTANT.expert_bytes == pytest.approx(stats.decode.bytes_h2d / nbytes)
    assert stats.decode.prefetches > 0


def test_a_fast_link_is_not_an_instant_one(recorded):
    """The cause of the difference the instant link removes: on a 1e7 GB/s link expertflow's prefetches are still
    in flight at the next layer's proposal, its plan takes fewer slots, and it loads fewer experts than the
    synchronous runtime (pinned: 100 against 120 experts moved in decode at batch 3)."""
    from moeflow.sim.simulator import load_gates

    prompts, trace = recorded
    stats, nbytes = runtime("expertflow", 12, prompts[:3])
    gates = load_gates(embedded_model_path(), trace.num_layers)
    fast = simulate(trace.select(range(3)), "expertflow", 12, FAST, timeline=False, batch=3, gates=gates,
                    predictor_dir=embedded_model_path())
    assert (fast.decode_bytes_h2d / FAST.expert_bytes, stats.decode.bytes_h2d / nbytes) == (100, 120)


def test_begin_step_gets_what_the_engine_gives(recorded):
    prompts, trace = recorded
    seen: list[StepInfo] = []
    runtime("lru", 12, prompts[:3], seen)
    _, passes = batch_passes(trace.select(range(3)), 3)
    assert len(passes) == 1 and len(passes[0]) == len(seen) == NEW
    for p, real in zip(passes[0], seen, strict=True):
        ours = p.info
        assert ours.phase == real.phase and (p.phase == PREFILL) == (real.phase == "prefill")
        for name in ("input_ids", "positions", "token_mask"):
            a, b = getattr(ours, name), getattr(real, name)
            assert torch.equal(a, b.to(a.dtype)), name
        n = ours.history_ids.shape[1]
        assert torch.equal(ours.history_mask, real.history_mask[:, :n].bool())
        assert torch.equal(ours.history_ids[ours.history_mask], real.history_ids[:, :n][ours.history_mask])
        m = ours.token_mask
        torch.testing.assert_close(ours.embeds[m], real.embeds[m].float(), atol=2e-3, rtol=2e-3)  # (fp16 in traces)


def test_rows_route_as_the_union_and_finished_rows_are_masked(recorded):
    _, trace = recorded
    short = trace.rows(torch.arange(len(trace))[:-2])  # the last sequence ends two decode rows early
    bt, passes = batch_passes(short, 4)
    assert sorted(bt.token_ids.tolist()) == sorted(short.token_ids.tolist())
    dec = [p for p in passes[0] if p.phase == DECODE]
    assert [p.yields for p in dec] == [4] * (NEW - 3) + [3, 3]
    last = dec[-1].info
    assert last.token_mask[:, 0].tolist() == [True, True, True, False] and not last.all_real
    assert [p.rows.stop - p.rows.start for p in dec] == [p.yields for p in dec]


def test_pinned_counts(recorded):
    _, trace = recorded
    got = {}
    for policy in ("lru", "lfu", "expertflow", "finemoe"):
        r = simulate(trace, policy, 12, PROFILE, timeline=False, batch=4, predictor_dir=embedded_model_path())
        got[policy] = (round(r.decode_bytes_h2d / PROFILE.expert_bytes), r.prefetches, r.useful_prefetches)
    # decode loads (experts), prefetches, useful prefetches: 4 sequences at batch 4 with 12 of the 32 experts
    assert got == {"lru": (122, 0, 0), "lfu": (103, 0, 0), "expertflow": (96, 81, 72), "finemoe": (118, 71, 59)}


def test_bad_batches_are_refused(recorded):
    _, trace = recorded
    with pytest.raises(BatchError, match="batch=0"):
        batch_passes(trace, 0)
    with pytest.raises(SimulationError, match="does not take passes="):
        simulate(trace, "lru", 12, PROFILE, batch=2, passes=batch_passes(trace, 2)[1])
    decode_only = trace.rows(trace.phase == DECODE)
    with pytest.raises(SimulationError, match="no prefill rows"):
        simulate(decode_only, "lru", 12, PROFILE, batch=2)


def test_simulate_command_batch(recorded, tmp_path, capsys):
    from moeflow.cli import main

    _, trace = recorded
    trace.save(tmp_path / "t.safetensors")
    base = ["simulate", "--trace", str(tmp_path / "t.safetensors"), "--slots", "12", "--h2d-gbps", "20",
            "--expert-mb", "40", "--layer-ms", "0.3", "--expert-ms", "0.25", "--policy", "resident,lru,oracle"]
    assert main([*base, "--batch", "4"]) == 0
    table = capsys.readouterr().out
    assert "4 sequences, batch 4" in table and "| decode pass ms | ms/token |" in table
    assert "| oracle | 12/32 |" in table
    assert main([*base, "--batch", "4", "--json"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert main([*base, "--json"]) == 0
    one = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    for policy in ("resident", "lru", "oracle"):
        b, s = rows[policy], one[policy]
        assert b["batch"] == 4 and b["decode_generated_tokens"] == s["decode_generated_tokens"] == 4 * (NEW - 1)
        assert b["decode_steps"] == NEW - 1 and b["tpot_s"] > s["tpot_s"]  # a pass of 4 tokens costs more than 1
        assert b["decode_time_s"] < s["decode_time_s"]  # ... and less than 4 passes of one
    assert rows["oracle"]["decode_hit_rate"] >= rows["lru"]["decode_hit_rate"]
