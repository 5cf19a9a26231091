"""The tail of gpt-oss's one-call CPU decode step (kernels/cpu/step_gptoss.c's mf_gptoss_decode_step,
engine/cpu_layers_gpt_oss.py's ``NativeGptOssLayers.logits``): the final RMSNorm and the lm_head after the last
layer, in the same parallel region (step_head.c's mf_head_team, the Mixtral-style step's code). Each decode step's
logits are, bit for bit, what the per-call path computes from the same last-layer output (``lm_head(norm(x))``:
mf_rmsnorm, then mf_q8_linear / mf_q4_linear, the refined int4 head's int8 candidates), at 1, 2 and 3 threads, with
the greedy tokens of the layers run one by one; for the heads a gpt-oss model gets on the CPU: int8 (the default
for a safetensors checkpoint), a GGUF file's Q8_0 output.weight on the file's own blocks (GGUFLinear: llama.cpp
writes it Q8_0 for gpt-oss at any file type, its hidden size 2880 taking no K-quant; gguf.c's mf_gguf_linear_team
in the tail), int4, the refined int4 head. A hook on the final norm leaves the tail
to Python. ~9 s on 2 cores (loaded)."""

from __future__ import annotations

import pytest
import torch
from decode_tail_helpers import check_tail, record_tails
from gpt_oss_helpers import gpt_oss_checkpoint_pair

import moeflow.engine.cpu_layers_gpt_oss as cpu_layers_gpt_oss
from moeflow import MoEModel
from moeflow.kernels.cpu.gguf import GGUFLinear
from moeflow.kernels.cpu.lm_head import RefinedInt4LmHead
from moeflow.kernels.cpu.native import native_available
from moeflow.kernels.cpu.quant_linear import CpuQuantLinear, quantize_linear_cpu

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")
SHAPE = dict(num_hidden_layers=3, intermediate_size=96, vocab_size=112)  # sliding, full, sliding (window 4); 4
# experts, top-2; a vocabulary of whole 16-row items (the int4 heads)


@pytest.fixture
def tails(monkeypatch):
    """Every call of the step with a tail: (the last layer's output [1, 1, H], the logits [1, 1, V]) as copies."""
    return record_tails(monkeypatch, cpu_layers_gpt_oss, "gpt_oss_step")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny gpt-oss as a safetensors MXFP4 checkpoint and as a GGUF file (MXFP4 experts, Q8_0 attention and
    output.weight)."""
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gpt_oss_head")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEFLOW_CACHE_DIR", str(root / "cache"))
    yield gpt_oss_checkpoint_pair(root, 12, **SHAPE)
    mp.undo()


def _generate(model: MoEModel, n: int) -> torch.Tensor:
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])


def _check(model: MoEModel, n: int, tails: list) -> None:
    assert isinstance(model.model.layers_step, cpu_layers_gpt_oss.NativeGptOssLayers)
    check_tail(model, lambda k: _generate(model, k), n, tails)


@pytest.mark.parametrize("form", ["mxfp4", "gguf"])
def test_the_tail_is_the_per_call_head_on_1_2_3_threads(checkpoints, form, tails):
    """The int8 head (safetensors) or the file's Q8_0 blocks (GGUF)."""
    model = MoEModel.from_pretrained(checkpoints[form], device="cpu", dtype=torch.float32)
    try:
        head = model.model.lm_head
        if form == "gguf":  # the file's Q8_0 output.weight, its bytes as stored
            import gguf

            assert isinstance(head, GGUFLinear) and head.type.name == "Q8_0"
            raw = next(t for t in gguf.GGUFReader(checkpoints[form]).tensors if t.name == "output.weight")
            assert torch.equal(head.blocks.reshape(-1), torch.from_numpy(raw.data.copy()).view(torch.uint8)
                               .reshape(-1))
        else:
            assert isinstance(head, CpuQuantLinear) and head.bits == 8
        _check(model, 5, tails)
        if form == "mxfp4":  # an int4 head (a native CpuQuantLinear of 4 bits): the tail runs it too
            model.model.lm_head = quantize_linear_cpu(head.dequantized(), bits=4, group_size=32)
            tails.clear()
            _check(model, 4, tails)
    finally:
        model.close()


def test_the_tail_runs_the_refined_int4_head(checkpoints, tails):
    """lm_head_bits=4 (RefinedInt4LmHead): the int4 logits across the team, then its candidates recomputed in int8
    by one thread (step_head.c's mf_head_refine): its forward's numbers."""
    model = MoEModel.from_pretrained(checkpoints["mxfp4"], device="cpu", dtype=torch.float32, lm_head_bits=4)
    try:
        assert isinstance(model.model.lm_head, RefinedInt4LmHead)
        _check(model, 5, tails)
        x, logits = tails[-1]
        with torch.inference_mode():
            int4 = model.model.lm_head.int4(model.model.norm(x))
        assert 0 < int((logits != int4).sum()) <= model.model.lm_head.candidates  # the candidates' differ
    finally:
        model.close()


def test_a_hooked_final_norm_runs_the_tail_in_python(checkpoints, tails):
    """A hook on the final norm: the layers still take the one call (without a tail), the norm runs as a module
    every pass; without the hook the tail runs again."""
    model = MoEModel.from_pretrained(checkpoints["mxfp4"], device="cpu", dtype=torch.float32)
    calls, seen = [0], []
    inner = cpu_layers_gpt_oss.gpt_oss_step

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    try:
        cpu_layers_gpt_oss.gpt_oss_step = counted
        hook = model.model.norm.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        try:
            _generate(model, 3)
        finally:
            hook.remove()
        assert not tails and len(seen) == 3 and calls[0] == 2
        _generate(model, 3)
        assert len(tails) == 2 and calls[0] == 4
    finally:
        cpu_layers_gpt_oss.gpt_oss_step = inner
        model.close()
