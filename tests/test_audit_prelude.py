"""The captured prelude (moeflow/offload/prelude.py) of a router that does not renormalise its top-k weights
(Qwen3-MoE with ``norm_topk_prob=False``): the routing launch captured in the decode step's piece must pass the
layer's ``renormalize`` (its default is True). Issue 35's audit dropped it and no test saw: the captured-prelude
tests use the embedded Mixtral, whose router renormalises.

As in test_captured_prelude: a tiny transformers checkpoint with the torch kernels for the dense part and the
offload backend on the Triton path (``TRITON_INTERPRET=1``), decode steps captured by TraceCapture; the tokens
with the captured prelude equal the eager run's and the resident model's, and the weights the captured launch
computed are the router's own (not renormalised)."""

from __future__ import annotations

import torch
from family_models import make_family_model
from test_captured_prelude import _captured

from moeflow import MoEModel, OffloadConfig
from moeflow.kernels.experts.reference import route_reference
from moeflow.offload import create_expert_backend

NEW_TOKENS = 5


def _offloaded(path, slots: int):
    """The checkpoint at ``path`` (torch kernels) with an lru backend of ``slots`` on the Triton path."""
    model = MoEModel.from_pretrained(path, kernels="torch", offload=OffloadConfig(policy="lru"))
    old = model.experts
    backend = create_expert_backend(
        OffloadConfig(policy="lru", gpu_expert_slots=slots), fmt=old.fmt, num_layers=old.num_layers,
        num_experts=old.num_experts, top_k=model.config.num_experts_per_tok, device="cpu", kernels_backend="triton",
        gates=[b.gate for b in model.model.moe_blocks], reserved_bytes=0, stats=model.stats, checkpoint_dir=path,
        host_store=old.host)
    backend.finish_loading()
    model.use_backend(backend)
    return model


def _generate(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])


def _flat_router_checkpoint(path, seed: int):
    """Qwen3-MoE, ``norm_topk_prob=False``, its routers scaled down: family_models' routers are so peaked (top-1
    ~0.999) that renormalising changes nothing; these spread the top-2 weights (sums 0.29-0.47 here), and renormalised
    weights change the greedy tokens of this seed and prompt (transformers' own model with ``norm_topk_prob=True``
    gives other tokens from the first one)."""
    ref = make_family_model("qwen3_moe", seed=seed, norm_topk_prob=False)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.1)
    ref.save_pretrained(path)
    return path


def test_an_unnormalised_router_through_the_captured_prelude_gives_the_eager_tokens(tmp_path):
    path = _flat_router_checkpoint(tmp_path, seed=1)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    resident = MoEModel.from_pretrained(path, kernels="torch")
    try:
        want = _generate(resident, ids)
    finally:
        resident.close()
    eager = _offloaded(path, 6)
    try:
        routing = eager.model.moe_blocks[0].kernel_routing
        assert routing is not None and not routing.renormalize  # the case under test
        eager_tokens = _generate(eager, ids)
    finally:
        eager.close()
    model = _offloaded(path, 6)
    graphs = _captured(model)
    try:
        got = _generate(model, ids)
        calls = graphs.step.calls
    finally:
        model.close()
    assert graphs.refused is None and graphs.captures == 1
    assert calls and all(c.prelude is not None for c in calls)  # every layer's routing ran in the piece
    assert torch.equal(eager_tokens, want)
    assert torch.equal(got, want)
    # and the routing the piece replayed last is the layer's own, unnormalised (router_logits fp32 [T, E])
    for c in calls:
        want_ids, want_weights = route_reference(c.router_logits.float(), c.kernel_routing.top_k, renormalize=False)
        assert torch.equal(c.prelude.topk_ids.long(), want_ids.long()), c.layer
        torch.testing.assert_close(c.prelude.topk_weights, want_weights.float(), rtol=1e-5, atol=1e-6)
        assert float(c.prelude.topk_weights.sum(-1).max()) < 0.99  # far from a renormalised sum of 1
