"""``generate(num_speculative_tokens=k)`` with DeepSeek-V3's MTP layer: greedy tokens = plain greedy, resident and
under every offload policy that runs with the MTP layer x slot counts x sync / random-delay transport; the draft /
accept counters pinned on a deterministic case and on oracle drafts (the verify loop's accept and reject paths); the
MTP layer's experts go through the offload backend; the draft-informed prefetch (each proxy, and none) leaves the
tokens unchanged under every policy x transport and counts its predictions. ~45 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from mtp_helpers import make_mtp_checkpoint, routed_layers
from test_mtp import GLM_SHAPE, SHAPE
from tiny_families import train_predictors

import moeflow.engine.mtp as mtp_engine
from moeflow import MoEModel, OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.offload.policies import POLICY_NAMES

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 10
EXPERTS, MOE_LAYERS = 6, 3  # 2 decoder MoE layers + the MTP layer's
# policies whose trained predictor files know the decoder's layers only: refused with mtp=True (below);
# fiddler needs AWQ experts (tests/test_hybrid.py)
TRAINED = ("duoserve", "promoe", "expertflow")
POLICIES = tuple(p for p in POLICY_NAMES if p not in ("resident", "fiddler", *TRAINED))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _, _ = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp_gen"), seed=5, **dict(SHAPE))
    model = MoEModel.from_pretrained(path, mtp=True)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    return path, model, ids, plain


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_resident_tokens_equal_plain_greedy(tiny, k):
    _, model, ids, plain = tiny
    model.stats.reset()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=k)
    assert torch.equal(out, plain)
    s = model.stats
    assert s.generated_tokens == NEW and s.draft_tokens >= s.decode.steps - 1 and s.accepted_tokens <= s.draft_tokens


def test_left_padding_eos_and_token_limit(tiny):
    _, model, ids, plain = tiny
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                         num_speculative_tokens=3)
    assert torch.equal(got, want)
    eos = int(plain[0, 9 + 4])  # stops at the fifth new token (or earlier, where it appears before)
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    for k in (1, 4):
        assert torch.equal(model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                                          num_speculative_tokens=k), want)
    for limit in (1, 2, 3):
        assert torch.equal(model.generate(ids, max_new_tokens=limit, do_sample=False, eos_token_id=[],
                                          num_speculative_tokens=3), plain[:, :9 + limit])


def test_draft_and_accept_counts_pinned(tiny):
    """Checkpoint seed 5, prompt seed 5, 24 new tokens: the random MTP layer's drafts (a deterministic fp32 CPU run)."""
    _, model, _, _ = tiny
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(5))
    counts = []
    for k in (1, 2, 3):
        model.stats.reset()
        model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=[], num_speculative_tokens=k)
        counts.append((model.stats.draft_tokens, model.stats.accepted_tokens, model.stats.decode.steps))
    assert counts == [(21, 1, 22), (41, 1, 22), (60, 1, 22)]


@pytest.mark.parametrize("wrong_every", [None, 3])
def test_oracle_drafts_accepted_and_rejected(tiny, monkeypatch, wrong_every):
    """Drafts from the plain greedy tokens (every ``wrong_every``-th position wrong): all accepted, a bonus token
    per pass; or cut at each wrong one, the model's own token kept."""
    _, model, ids, plain = tiny
    seq = plain[0].tolist()
    t = ids.shape[1]

    def oracle(drafter, mtp_in, k, n, pad, history, device, choose=None):
        draft = [(tok + 1) % 97 if wrong_every and (n + j) % wrong_every == 0 else tok
                 for j, tok in enumerate(seq[n:n + k])]
        return draft, [None] * len(draft)

    monkeypatch.setattr(mtp_engine, "propose", oracle)
    k = 3
    model.stats.reset()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=k)
    assert torch.equal(out, plain)
    s = model.stats
    # replay the rounds: n tokens kept; a pass drafts min(k, room - 1) and keeps the accepted prefix + one token
    n, drafted, accepted, passes = t + 1, 0, 0, 0
    while n < t + NEW:
        draft, _ = oracle(None, None, min(k, t + NEW - n - 1), n, 0, None, None)
        ok = 0
        while ok < len(draft) and draft[ok] == seq[n + ok]:
            ok += 1
        drafted, accepted, passes, n = drafted + len(draft), accepted + ok, passes + 1, n + ok + 1
    assert (s.draft_tokens, s.accepted_tokens, s.decode.steps) == (drafted, accepted, passes)
    if wrong_every is None:
        assert accepted == drafted and passes == -(-(NEW - 1) // (k + 1))
    else:
        assert 0 < accepted < drafted


# the draft-informed prefetch's proxy per slot count (engine/mtp_prefetch.py), each one under every policy x transport
PREFETCH = {2: "mtp", 3: None, 7: "embed", EXPERTS * MOE_LAYERS: "mtp-only"}


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", POLICIES)
def test_offloaded_tokens_equal_plain_greedy(tiny, policy, transport):
    path, _, ids, plain = tiny
    for n_slots, prefetch in PREFETCH.items():
        early = transport == "random-delay" and n_slots % 2 == 1  # each layer's hits launched before its read-back
        model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(
            policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3, seed=n_slots,
            early_hits=early))
        try:
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=2,
                                 mtp_prefetch=prefetch)
        finally:
            model.experts.close()
        assert torch.equal(out, plain), f"{policy}/{transport}/{n_slots} slots/prefetch {prefetch}"
        s = model.stats
        assert s.decode.hits + s.decode.misses > 0
        if n_slots < EXPERTS * MOE_LAYERS:
            assert s.bytes_per_generated_token is not None and s.bytes_per_generated_token > 0
        dp = s.draft_prefetch
        assert (dp.predicted > 0) == (prefetch is not None) and (dp.needed > 0) == (prefetch is not None)
        assert dp.queued <= dp.predicted and dp.predicted_used <= min(dp.predicted, dp.needed)
        if prefetch is not None:
            assert dp.needed >= 2 * s.decode.steps  # every verify pass uses >= top-k experts in each of 2 layers


def test_draft_prefetch_counts_and_refusal(tiny):
    """Resident: the prefetch predicts (and queues nothing: every expert is in place); the "mtp" proxy's last draft
    row comes from its embedding, "mtp-only" leaves it out, so it predicts no more pairs. An unknown proxy is refused
    naming the argument."""
    _, model, ids, plain = tiny
    seen = {}
    for proxy in ("mtp", "mtp-only", "embed"):
        model.stats.reset()
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=1,
                             mtp_prefetch=proxy)
        assert torch.equal(out, plain)
        dp = model.stats.draft_prefetch
        assert dp.queued == 0 and dp.predicted > 0 and 0 < dp.predicted_used <= dp.needed
        seen[proxy] = dp.predicted
    assert seen["mtp-only"] <= seen["mtp"]
    with pytest.raises(ValueError, match="mtp_prefetch must be one of"):
        model.generate(ids, max_new_tokens=2, num_speculative_tokens=1, mtp_prefetch="router")


def test_mtp_layer_experts_go_through_the_offload_backend(tiny):
    """With lru over 2 slots the MTP passes route through MoE layer 2 (the MTP layer's): its experts are looked up."""
    path, _, ids, plain = tiny
    model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(policy="lru", gpu_expert_slots=2))
    with routed_layers(model) as seen:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=2)
    assert torch.equal(out, plain)
    assert seen.count(2) > 0 and {0, 1, 2} == set(seen)


def test_trained_predictor_policies_refused_naming_mtp(tiny, tmp_path):
    path, _, _, _ = tiny
    import shutil

    copy = shutil.copytree(path, tmp_path / "ckpt")
    train_predictors(MoEModel.from_pretrained(copy), copy, torch.Generator().manual_seed(2))
    for policy in TRAINED:
        with pytest.raises(SchedulingError, match=r"num_layers=2 but the model has num_layers=3.*mtp=True"):
            MoEModel.from_pretrained(copy, mtp=True, offload=OffloadConfig(policy=policy, gpu_expert_slots=3))


def test_glm_tokens_equal_plain_greedy(tmp_path):
    path, _, _ = make_mtp_checkpoint(tmp_path, seed=3, kind="glm4_moe", **dict(GLM_SHAPE))
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    resident = MoEModel.from_pretrained(path, mtp=True)
    plain = resident.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    for k in (1, 3):
        assert torch.equal(resident.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                                             num_speculative_tokens=k), plain)
    model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(
        policy="lru", gpu_expert_slots=3, transport="random-delay", random_delay_ms=0.3, seed=3))
    try:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=2)
    finally:
        model.experts.close()
    assert torch.equal(out, plain) and model.stats.bytes_per_generated_token > 0


# ------------------------------------------------------------------ speculative sampling
def test_sampling_with_top_k_1_is_greedy(tiny):
    """top_k=1 makes p and q one-hot: a draft is kept exactly when it is the main model's argmax, the residual is
    the argmax: plain greedy's tokens, through every branch of the sampling rule (accepts are rare here)."""
    _, model, ids, plain = tiny
    for k in (1, 3):
        model.stats.reset()
        out = model.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=[], seed=7,
                             num_speculative_tokens=k)
        assert torch.equal(out, plain)
        assert model.stats.draft_tokens > 0


def test_sampling_with_top_k_1_is_greedy_offloaded(tiny):
    path, _, ids, plain = tiny
    model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(
        policy="lru", gpu_expert_slots=3, transport="random-delay", random_delay_ms=0.3, seed=3))
    try:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=[], seed=7,
                             num_speculative_tokens=2)
    finally:
        model.experts.close()
    assert torch.equal(out, plain)


def test_sampled_tokens_stay_in_the_target_support_and_repeat_per_seed(tiny):
    """top_k=3 at temperature 2: every sampled token lies in the main model's top 3 at its position (the
    target's support, whatever the drafts), and one seed gives one output."""
    _, model, ids, _ = tiny
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=3, temperature=2.0, eos_token_id=[],
                  num_speculative_tokens=2)
    outs = [model.generate(ids, seed=s, **kwargs) for s in (1, 2, 1)]
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])
    for out in outs[:2]:
        logits = model(out).logits[0]  # [T, V]: position j's logits predict token j + 1
        top3 = logits[ids.shape[1] - 1:-1].topk(3, dim=-1).indices
        assert bool((top3 == out[0, ids.shape[1]:, None]).any(dim=-1).all())


def test_awq_checkpoint_keeps_the_mtp_layer_on_cpu_int4(tiny, tmp_path):
    """`moeflow quantize` keeps the MTP layer (its experts in AWQ, its copies of the embedding and head dropped); the
    CPU int4 kernels then draft and verify with the plain greedy tokens of the same quantized model."""
    from safetensors import safe_open

    from moeflow.tools.quantize import quantize_checkpoint

    path, _, ids, _ = tiny
    dst = quantize_checkpoint(path, tmp_path / "awq", group_size=32, progress=False)
    with safe_open(dst / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.3.mlp.experts.0.gate_proj.qweight" in names and "model.layers.3.eh_proj.weight" in names
    assert "model.layers.3.embed_tokens.weight" not in names and "model.layers.3.shared_head.head.weight" not in names
    for offload in (OffloadConfig(), OffloadConfig(policy="lru", gpu_expert_slots=3)):
        model = MoEModel.from_pretrained(dst, mtp=True, offload=offload)
        assert model.kernels == "cpu-int4"
        try:
            plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=3)
        finally:
            model.experts.close()
        assert torch.equal(out, plain)


def test_disk_tier_reads_the_mtp_layer_experts(tiny):
    """A host budget below the 18 experts (the smallest this machine's plan accepts): some experts, the MTP layer's
    among the candidates, are read from disk through the checkpoint's index; tokens = plain greedy."""
    path, _, ids, plain = tiny
    for budget in (x / 1e6 for x in range(500, 1200, 40)):
        try:
            model = MoEModel.from_pretrained(path, mtp=True, offload=OffloadConfig(
                policy="lru", gpu_expert_slots=3, host_memory_gb=budget))
        except SchedulingError:  # below the plan's minimum (non-expert weights, KV cache, staging): a larger budget
            continue
        try:
            assert model.experts.host.on_disk and model.memory_plan().host_experts < EXPERTS * MOE_LAYERS
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=2)
        finally:
            model.close()
        assert torch.equal(out, plain)
        return
    pytest.fail("no host budget in 0.5-1.2 MB loaded with experts on disk")


def test_streamer_gets_every_token_once(tiny):
    _, model, ids, plain = tiny
    got = []

    class Collect:
        def put(self, value):
            got.append(value.reshape(-1).tolist())

        def end(self):
            got.append("end")

    model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], num_speculative_tokens=3,
                   streamer=Collect())
    assert got[0] == ids[0].tolist() and got[-1] == "end"
    assert sum(got[1:-1], []) == plain[0, ids.shape[1]:].tolist()
