"""The decode loop takes its strategy from the policy (``PolicySpec.decode``, moeflow/moe/decode.py): a user policy
that declares one gets it from ``generate(micro_batch_size=...)``, ``dual_batch=False`` keeps the plain loop, and a
policy without one runs the plain loop (``dual_batch=True`` is refused). Tokens stay the resident model's."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.engine.decode import PlainDecode
from moeflow.errors import SchedulingError
from moeflow.moe.decode import DecodeLoop
from moeflow.offload import PolicySpec, register_policy, unregister_policy
from moeflow.offload.policies import evict


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("decode"), seed=3)


class CountingDecode:
    """A policy's strategy: the plain loop (reversed-order micro-batches), counting its steps and regroupings."""

    made: list[CountingDecode] = []

    def __init__(self, loop: DecodeLoop) -> None:
        self.inner = PlainDecode(loop, loop.runner.backend.predict_paths)
        self.steps = self.regroups = 0
        self.stats = {"steps": 0}
        CountingDecode.made.append(self)

    def regroup(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        self.regroups += 1
        b = paths.shape[0]
        return [list(range(i, min(i + micro_batch_size, b))) for i in range(0, b, micro_batch_size)][::-1]

    def step(self, tok, next_pos, n, done):
        self.steps += 1
        self.stats["steps"] = self.steps
        return self.inner.step(tok, next_pos, n, done)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def counted_policy():
    register_policy(PolicySpec("lru-counted", "lru with a counting decode strategy", eviction=evict("lru"),
                               decode=CountingDecode))
    CountingDecode.made.clear()
    yield "lru-counted"
    unregister_policy("lru-counted")


def test_generate_asks_the_policy_for_its_strategy(ckpt, counted_policy):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (5, 7), generator=g)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, max_new_tokens=4, eos_token_id=[])
    model = MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(policy=counted_policy,
                                                                            gpu_expert_slots=5))
    out = model.generate(ids, max_new_tokens=4, eos_token_id=[], micro_batch_size=2)
    assert torch.equal(out, ref)
    (made,) = CountingDecode.made
    # lru predicts no paths: micro-batches regrouped by the observed ones, after the prefill and each decode step
    assert made.steps == 3 and made.regroups == 1 + 3
    assert model.pipeline_stats == {"steps": 3}
    # dual_batch=False: the plain loop, not the policy's; without micro-batches the default is the plain loop too
    for kwargs in ({"micro_batch_size": 2, "dual_batch": False}, {}):
        CountingDecode.made.clear()
        assert torch.equal(model.generate(ids, max_new_tokens=4, eos_token_id=[], **kwargs), ref)
        assert not CountingDecode.made and model.pipeline_stats is None, kwargs
    model.close()


def test_a_policy_without_a_strategy_runs_the_plain_loop(ckpt):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (4, 6), generator=g)
    ref = MoEOffloadedMixtral.from_pretrained(ckpt).generate(ids, max_new_tokens=3, eos_token_id=[])
    lru = MoEOffloadedMixtral.from_pretrained(ckpt, offload=OffloadConfig(policy="lru", gpu_expert_slots=5))
    assert lru.runner.decode_strategy is None
    assert torch.equal(lru.generate(ids, max_new_tokens=3, eos_token_id=[], micro_batch_size=2), ref)
    with pytest.raises(SchedulingError, match="decode strategy.*'lru'"):
        lru.generate(ids, max_new_tokens=3, eos_token_id=[], micro_batch_size=2, dual_batch=True)


def test_the_generate_loop_names_no_policy():
    """generate() asks the policy (engine/decode.py); the loop itself imports nothing of a policy's folder."""
    from test_architecture import imports_of, module_names

    modules = module_names()
    name = "moeflow.engine.generate"
    found = imports_of(name, modules[name], modules)
    assert "moeflow.engine.decode" in found
    assert not [m for m in found if m.startswith("moeflow.offload.policies")], found
