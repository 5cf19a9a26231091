"""Tokens that are not real (left padding, finished rows) never pull, count or compute experts.

The batch below is left-padded to unequal lengths, and a router stub sends every padding token to experts 6 and 7,
which no real token ever chooses: routed like real tokens, the padding would need them in every prefill layer.
The invariant (every policy x slot count x transport gives the resident tokens) holds, experts 6 and 7 are never
copied, and the hit/miss counts are exactly the experts the real tokens need. The control test runs the same
batch with the masking switched off and sees the padding pull 6 and 7 in: the construction bites.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_awq_checkpoint, make_tiny_checkpoint
from torch import nn

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.moe import StepInfo

LAYERS, EXPERTS, TOP_K = 2, 8, 2
PAD_ONLY = (6, 7)  # the experts only padding would choose
NEW_TOKENS = 6


class PadSeekingGate(nn.Module):
    """The router stub: the real gate's logits, with experts 6 and 7 made unreachable for real tokens and the
    top choice of padding. It knows the prefill's layout (``mask`` [B, T]); a decode step's tokens are all real.
    ``needed`` records, per call, the experts the real tokens choose (what hits + misses must count)."""

    def __init__(self, gate: nn.Linear, mask: torch.Tensor, top_k: int) -> None:
        super().__init__()
        self.inner, self.mask, self.top_k = gate, mask.bool(), top_k
        self.out_features = gate.out_features
        self.needed: list[set[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.inner(x).clone()
        pad = ~self.mask.reshape(-1) if x.shape[0] == self.mask.numel() else torch.zeros(x.shape[0], dtype=torch.bool)
        logits[:, list(PAD_ONLY)] = torch.where(pad[:, None], 1e4, -1e4).to(logits.dtype)
        self.needed.append(set(torch.topk(logits[~pad], self.top_k).indices.reshape(-1).tolist()))
        return logits


def install_stub(model, mask: torch.Tensor) -> list[PadSeekingGate]:
    gates = []
    for block in model.model.moe_blocks:
        block.gate = PadSeekingGate(block.gate, mask, block.top_k)
        gates.append(block.gate)
    return gates


def request_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 9, 5 and 2 tokens, left-padded: ids, mask [3, 9]."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_padding"), seed=11, num_hidden_layers=LAYERS,
                                num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return with_resident_tokens(path)


def with_resident_tokens(path) -> tuple:
    """(path, ids, mask, the resident model's greedy tokens with the stub) for :func:`request_batch`."""
    ids, mask = request_batch()
    resident = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy="resident"))
    install_stub(resident, mask)
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[])
    return path, ids, mask, expected


def run_offloaded(path, ids, mask, **config):
    """Tokens, stats, the (layer, expert) loads queued while generating, and the real tokens' needed sets."""
    model = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(**config))
    gates = install_stub(model, mask)
    loads: list[tuple[int, int]] = []
    engine = model.experts.engine
    submit = engine.submit

    def recording_submit(layer, expert, *args, **kwargs):
        loads.append((layer, expert))
        return submit(layer, expert, *args, **kwargs)

    engine.submit = recording_submit
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    finally:
        model.close()
    return out, model.stats, loads, [n for g in gates for n in g.needed]


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", ["ondemand", "lru", "lfu"])
def test_padding_never_pulls_or_counts_experts(tiny, policy, transport):
    path, ids, mask, expected = tiny
    for n_slots in (2, 4, 8, LAYERS * EXPERTS):
        out, stats, loads, needed = run_offloaded(path, ids, mask, policy=policy, gpu_expert_slots=n_slots,
                                                  transport=transport, random_delay_ms=0.3, seed=n_slots)
        where = f"{policy}/{transport} with {n_slots} slots"
        assert torch.equal(out, expected), f"{where}: {out} != {expected}"
        assert loads or n_slots == LAYERS * EXPERTS, where  # the scheduler did copy experts (the test can bite)
        assert not [key for key in loads if key[1] in PAD_ONLY], f"{where}: padding pulled experts in: {loads}"
        counted = sum(p.hits + p.misses for p in (stats.prefill, stats.decode))
        assert counted == sum(len(n) for n in needed), where  # one hit or miss per expert a real token needs
        assert stats.prefill.tokens == int(mask.sum()), where  # the stats count real tokens only


def test_without_the_masking_padding_pulls_its_experts_in(tiny, monkeypatch):
    """The control: padding routed like real tokens needs 6 and 7 (the construction bites), and the resident
    tokens of the real positions are those of today's unmasked batch."""
    path, ids, mask, expected = tiny
    monkeypatch.setattr(StepInfo, "real_tokens", property(lambda step: None))
    out, _, loads, _ = run_offloaded(path, ids, mask, policy="lru", gpu_expert_slots=4, transport="sync")
    assert {e for _, e in loads} >= set(PAD_ONLY)
    assert torch.equal(out, expected)
    assert torch.equal(with_resident_tokens(path)[3], expected)  # the resident model, unmasked


@pytest.mark.parametrize(("kernels", "policy"), [("torch", "resident"), ("triton", "resident"), ("torch", "lru")])
def test_padding_rows_come_out_zero_and_leave_the_real_rows_alone(tiny, kernels, policy):
    """At the seam: whatever a padding row holds (NaN here) gives output 0 and ids -1, and the real rows are
    bitwise those of a pass over the real tokens alone (the resident Triton path's fused route + plan included)."""
    path, *_ = tiny
    slots = None if policy == "resident" else 4
    model = MoEOffloadedMixtral.from_pretrained(path, kernels=kernels,
                                                offload=OffloadConfig(policy=policy, gpu_expert_slots=slots))
    backend, block = model.experts, model.model.moe_blocks[0]
    mask = torch.tensor([[False, False, True, True], [False, True, True, True]])
    real = mask.reshape(-1)
    x = torch.randn(8, block.gate.in_features, generator=torch.Generator().manual_seed(3))
    x[~real] = float("nan")
    logits = block.gate(x)

    def layer(tokens: torch.Tensor, m: torch.Tensor):
        zeros = torch.zeros(m.shape, dtype=torch.long)
        backend.begin_step(StepInfo(zeros, zeros, m, "prefill"))
        return backend.forward_logits(0, x[tokens], logits[tokens], block.route, block.kernel_routing, True)

    try:
        out, ids = layer(torch.ones(8, dtype=torch.bool), mask)
        alone, alone_ids = layer(real, torch.ones((1, int(real.sum())), dtype=torch.bool))
    finally:
        model.close()
    assert torch.equal(out[~real], torch.zeros_like(out[~real])) and bool((ids[~real] == -1).all())
    assert torch.equal(out[real], alone) and torch.equal(ids[real], alone_ids)


def routed_tokens(backend) -> list[tuple[int, int]]:
    """Records (layer, tokens) of every layer the backend computes (the tokens that reach routing)."""
    calls: list[tuple[int, int]] = []
    inner = backend._route_and_forward

    def recording(layer, x, *args):
        calls.append((layer, x.shape[0]))
        return inner(layer, x, *args)

    backend._route_and_forward = recording
    return calls


@pytest.mark.parametrize(("policy", "micro_batch_size"), [("resident", None), ("lru", None), ("lru", 2)])
def test_finished_rows_route_nothing(tiny, policy, micro_batch_size):
    """Once a row generated EOS its later tokens (padding, discarded) reach no expert; the other rows' tokens
    are the ones generated without EOS."""
    path, ids, mask, expected = tiny
    new = expected[:, ids.shape[1]:]
    eos = int(new[0, 1])  # row 0 finishes at its second token
    finish = [row.tolist().index(eos) if eos in row.tolist() else NEW_TOKENS for row in new]
    slots = None if policy == "resident" else 4
    model = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy=policy, gpu_expert_slots=slots))
    install_stub(model, mask)
    calls = routed_tokens(model.experts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                         micro_batch_size=micro_batch_size)
    model.close()
    for r, f in enumerate(finish):  # each row's tokens up to its EOS are the EOS-free run's
        assert torch.equal(out[r, : ids.shape[1] + f + 1], expected[r, : ids.shape[1] + f + 1]), r
    passes = out.shape[1] - ids.shape[1]  # the prefill, then one decode pass per token but the last
    want = [int(mask.sum())] + [sum(f > j - 1 for f in finish) for j in range(1, passes)]
    layer0 = [n for layer, n in calls if layer == 0]  # one per pass (per micro-batch with micro_batch_size)
    assert sum(layer0) == sum(want)
    if micro_batch_size is None:
        assert layer0 == want
    assert min(finish) < passes - 1  # some decode pass did run with a finished row


def test_finemoe_searches_and_counts_real_tokens_only(tiny):
    """FineMoE's inputs: the semantic query holds the real tokens' embeddings, and its expert frequencies (the
    eviction's priority) count each real token's k experts, never the padding's 6 and 7; tokens stay resident."""
    path, ids, mask, expected = tiny
    model = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy="finemoe", gpu_expert_slots=4))
    install_stub(model, mask)
    pred = model.experts.predictor.predictor
    queries: list[int] = []
    begin = pred.begin_iteration

    def recording(embed=None):
        queries.append(embed.shape[0])
        begin(embed)

    pred.begin_iteration = recording
    freq_before = pred.freq.clone()
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    finally:
        model.close()
    assert torch.equal(out, expected)
    real = int(mask.sum())
    assert queries == [real] + [ids.shape[0]] * (NEW_TOKENS - 1)
    counted = pred.freq - freq_before  # [L, E]
    assert counted.sum(1).tolist() == [float(TOP_K * sum(queries))] * LAYERS
    assert not counted[:, list(PAD_ONLY)].any()


@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory):
    """AWQ experts (the hybrid CPU path needs them); reference: the resident CPU int4 path, with the stub."""
    awq = make_tiny_awq_checkpoint(tmp_path_factory.mktemp("tiny_padding_awq"), seed=11, num_hidden_layers=LAYERS,
                                   num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return with_resident_tokens(awq)


@pytest.mark.parametrize(("policy", "cpu_compute"), [("fiddler", None), ("lru", "always")])
def test_the_cpu_or_copy_choice_sees_real_tokens_only(tiny_awq, policy, cpu_compute):
    """Hybrid execution: the misses handed to the CPU-vs-copy choice and the token counts it weighs are the real
    tokens' (never the padding's experts 6 and 7); the tokens are the resident CPU int4 path's."""
    path, ids, mask, expected = tiny_awq
    model = MoEOffloadedMixtral.from_pretrained(path, offload=OffloadConfig(policy=policy, gpu_expert_slots=4,
                                                                            cpu_compute=cpu_compute))
    install_stub(model, mask)
    cpu = model.experts.cpu
    seen: list[tuple[int, list[int]]] = []  # (tokens, misses) per layer the choice planned
    start = cpu.start_layer

    def recording(layer, x, topk_ids, topk_weights, misses, *args):
        seen.append((topk_ids.shape[0], list(misses)))
        return start(layer, x, topk_ids, topk_weights, misses, *args)

    cpu.start_layer = recording
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    finally:
        model.close()
    assert torch.equal(out, expected)
    tokens = [n for n, _ in seen]
    assert tokens == [int(mask.sum())] * LAYERS + [ids.shape[0]] * (len(seen) - LAYERS)
    assert any(misses for _, misses in seen) and not [m for _, ms in seen for m in ms if m in PAD_ONLY]
    assert model.stats.prefill.cpu_experts + model.stats.decode.cpu_experts > 0
