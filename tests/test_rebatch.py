"""ExpertFlow's token scheduler: routing-path grouping and micro-batched generation."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.offload.policies.expertflow.scheduler import activated_pairs, group_by_routing, routing_similarity


def contiguous(batch: int, m: int) -> list[list[int]]:
    return [list(range(i, min(i + m, batch))) for i in range(0, batch, m)]


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 24), layers=st.integers(1, 4), experts=st.integers(2, 9), data=st.data())
def test_groups_partition_the_batch_and_never_activate_more_than_contiguous(batch, layers, experts, data):
    m = data.draw(st.integers(1, batch))
    seed = data.draw(st.integers(0, 1000))
    paths = torch.rand(batch, layers, experts, generator=torch.Generator().manual_seed(seed)) < 0.3
    groups = group_by_routing(paths, m, seed=seed)
    assert sorted(i for g in groups for i in g) == list(range(batch))
    assert all(1 <= len(g) <= m for g in groups)
    assert len(groups) == -(-batch // m)  # as few micro-batches as the size allows
    assert activated_pairs(paths, groups) <= activated_pairs(paths, contiguous(batch, m))
    base, extra = divmod(batch, len(groups))  # the balanced split: the first `extra` groups one larger
    bounds = [0]
    for i in range(len(groups)):
        bounds.append(bounds[-1] + base + (i < extra))
    balanced = [list(range(bounds[i], bounds[i + 1])) for i in range(len(groups))]
    assert activated_pairs(paths, groups) <= activated_pairs(paths, balanced)


def test_interleaved_families_are_separated():
    layers, experts = 3, 8
    a = torch.zeros(layers, experts, dtype=torch.bool)
    a[:, :2] = True
    b = torch.zeros(layers, experts, dtype=torch.bool)
    b[:, 5:7] = True
    paths = torch.stack([a if i % 2 == 0 else b for i in range(12)])
    groups = group_by_routing(paths, 6)
    assert groups == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]
    assert activated_pairs(paths, groups) == 2 * 2 * layers  # each group activates one family only
    assert activated_pairs(paths, contiguous(12, 6)) == 2 * 4 * layers


def test_similarity_is_one_minus_normalised_hamming():
    paths = torch.tensor([[[1, 0, 1, 0]], [[1, 1, 0, 0]]], dtype=torch.bool)
    sim = routing_similarity(paths)
    assert torch.allclose(sim, torch.tensor([[1.0, 0.5], [0.5, 1.0]]))


@pytest.mark.parametrize("m", [0, 5, -1])
def test_bad_micro_batch_size(m):
    with pytest.raises(ValueError, match="micro_batch_size"):
        group_by_routing(torch.zeros(4, 2, 3, dtype=torch.bool), m)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rb"), seed=3, num_local_experts=8)


def padded_batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (n,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, width - length:] = torch.randint(3, 97, (length,), generator=g)
        mask[i, width - length:] = 1
    return ids, mask


@pytest.mark.parametrize("policy,slots", [("resident", None), ("lru", 4)])
def test_micro_batched_generation_gives_the_full_batch_tokens(ckpt, policy, slots):
    ids, mask = padded_batch(6, seed=1)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, attention_mask=mask, max_new_tokens=10,
                                                             eos_token_id=[])
    model = MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(gpu_expert_slots=slots, policy=policy))
    for m in (1, 2, 4):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[], micro_batch_size=m)
        assert torch.equal(out, ref), m


def test_every_step_is_grouped_by_the_path_predictor(ckpt):
    model = MoEOffloadedMixtral.from_pretrained(ckpt)
    ids, mask = padded_batch(4, seed=2)
    calls = []

    class Predictor:  # sequences 0 and 2 share a path, 1 and 3 another
        def predict_paths(self, input_ids, attention_mask, last_only=False):
            calls.append((tuple(input_ids.shape), last_only))
            assert torch.equal(attention_mask[:, : ids.shape[1]], mask.bool())
            paths = torch.zeros(4, model.config.num_hidden_layers, 8, dtype=torch.bool)
            paths[::2, :, 0] = True
            paths[1::2, :, 7] = True
            return paths

    seen_rows = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen_rows.append(i[0].clone()))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], micro_batch_size=2,
                         path_predictor=Predictor())
    hook.remove()
    t = ids.shape[1]
    assert calls == [((4, t), False), ((4, t + 1), True), ((4, t + 2), True), ((4, t + 3), True)]
    assert torch.equal(seen_rows[0], ids[[0, 2]]) and torch.equal(seen_rows[1], ids[[1, 3]])  # prefill groups
    assert torch.equal(seen_rows[2][:, 0], out[[0, 2], t])  # first decode step, same grouping
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[]))
    with pytest.raises(ValueError, match="micro_batch_size"):
        model.generate(ids, attention_mask=mask, micro_batch_size=5)
