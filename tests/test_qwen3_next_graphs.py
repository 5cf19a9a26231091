"""The decode step of a hybrid model (Qwen3-Next: Gated DeltaNet states beside the KV cache) captured piecewise as
CUDA graphs, on the CPU through test_compile_cuda_graphs' :class:`TraceCapture` (CUDA-graph semantics: the pieces'
ops replayed on the tensors they were captured on; a host read or data-dependent shape while capturing is refused):
the replayed steps give the eager tokens, and a second call on the kept cache (its states cleared) captures nothing
more and gives them again. The conv and recurrent states are written in place, so the replays carry them. And the
decode step compiled (torch.compile) gives the eager tokens."""

from __future__ import annotations

import pytest
import torch
from test_compile_cuda_graphs import HostArgs, TraceCapture, on_device
from tiny_hybrid import QWEN3_5_MOE, QWEN3_NEXT, make_checkpoint

from moeflow import MoEModel, OffloadConfig

CASES = {"qwen3_next": QWEN3_NEXT["interval2-gqa-dense-first"], "qwen3_5_moe": QWEN3_5_MOE["full-first-mrope"]}


@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=9)], ids=["resident", "lru"])
@pytest.mark.parametrize("kind", list(CASES))
def test_replayed_pieces_give_the_eager_tokens(tmp_path, kind, offload):
    path, _ = make_checkpoint(tmp_path, kind, seed=11, **CASES[kind])
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ref = MoEModel.from_pretrained(path, kernels="torch", offload=offload)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[])
    ref.close()
    model = MoEModel.from_pretrained(path, kernels="torch", offload=offload)
    graphs = model.capture_decode(capture_factory=TraceCapture)
    graphs.inner = on_device(model.model)
    model.use_backend(HostArgs(model.experts))
    try:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[])
        again = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[])
    finally:
        model.close()
    assert graphs.refused is None
    assert torch.equal(got, want) and torch.equal(again, want)
    assert graphs.captures == 1
    assert len(graphs.step.replays) == len(model.family.moe_layers) + 1


def test_a_refused_capture_decodes_eagerly_from_the_states_before_it(tmp_path):
    """The warm-up and the refused capture ran the step on the cache: its states are put back, so the eager step
    that follows advances them once (the tokens are the eager ones)."""
    def syncing(decoder):
        def decode(embeds, *args):
            if float(embeds.as_subclass(torch.Tensor).abs().sum()) < 0:  # a host read in the captured region
                raise AssertionError("unreachable")
            return decoder(embeds, *args)
        return decode

    path, _ = make_checkpoint(tmp_path, "qwen3_next", seed=12, **CASES["qwen3_next"])
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    ref = MoEModel.from_pretrained(path, kernels="torch")
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    model = MoEModel.from_pretrained(path, kernels="torch")
    graphs = model.capture_decode(capture_factory=TraceCapture)
    graphs.inner = syncing(model.model)
    model.use_backend(HostArgs(model.experts))
    try:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    finally:
        model.close()
    assert graphs.refused and "aten.item" in graphs.refused
    assert torch.equal(got, want)


@pytest.mark.parametrize("offload", [None, OffloadConfig(policy="lru", gpu_expert_slots=9)], ids=["resident", "lru"])
def test_compiled_decode_gives_the_eager_tokens(tmp_path, offload):
    """compile_decode on a hybrid model: dynamo traces the linear-attention step (its in-place state writes
    included), breaks only at the offload backend, and a second generate compiles nothing new."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    path, _ = make_checkpoint(tmp_path, "qwen3_next", seed=15, **CASES["qwen3_next"])
    ids = torch.tensor([[1, 5, 7, 9], [3, 2, 8, 4]])
    model = MoEModel.from_pretrained(path, kernels="torch", offload=offload)
    try:
        want = model.generate(ids, max_new_tokens=7, do_sample=False, eos_token_id=[])
        model.compile_decode(backend="eager")
        torch._dynamo.reset()
        counters.clear()
        got = model.generate(ids, max_new_tokens=7, do_sample=False, eos_token_id=[])
        breaks = list(counters["graph_break"])
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = model.generate(ids, max_new_tokens=7, do_sample=False, eos_token_id=[])
    finally:
        model.close()
        torch._dynamo.reset()
    assert torch.equal(got, want) and torch.equal(again, want)
    assert all("OffloadedExperts.forward" in b for b in breaks) and (offload is None) == (not breaks)
