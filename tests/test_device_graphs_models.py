"""The exact-token invariant with the captured device part on the formats users run (issue 39 item 3): a tiny gpt-oss
with MXFP4 experts, the same converted to biased AWQ (biases, clamped SwiGLU), and a tiny Qwen3-MoE GGUF (layer 0
Q4_K gate/up with Q6_K down, layer 1 Q8_0) and a smaller all-Q8_0 one generate, offloaded under lru with few slots
and their decode step captured (the CPU recording stand-in, tests/graph_capture.py; the offload backend's expert
GEMMs and combine replayed per layer from static buffers, moeflow/offload/device_step.py), the greedy tokens of the
same model run eagerly and of the all-resident model; no layer runs eagerly after the warm-up. The expert kernels:
the static torch forms, and (MXFP4, biased AWQ, GGUF Q8_0) the Triton kernels interpreted. ~30 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint
from graph_capture import TraceCapture
from test_compile_cuda_graphs import HostArgs

from moeflow import MoEModel, OffloadConfig

LAYERS, EXPERTS, TOP_K = 2, 4, 2
NEW_TOKENS = 5
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_graphs_models")
    shape = dict(num_hidden_layers=LAYERS, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    paths = {"mxfp4": save_gpt_oss_checkpoint(make_gpt_oss_model(seed=7, **shape), root / "mxfp4", mxfp4=True)}
    from moeflow.tools.quantize import quantize_checkpoint

    src = save_gpt_oss_checkpoint(make_gpt_oss_model(seed=11, **shape), root / "src")
    paths["biased-awq"] = quantize_checkpoint(src, root / "awq", group_size=32, dtype=torch.float16, progress=False)
    gguf = pytest.importorskip("gguf")
    from family_models import make_family_model
    from gguf_models import random_k_experts, write_gguf

    H = I = 256  # noqa: E741 (K-quant rows are 256 wide)
    model = make_family_model("qwen3_moe", seed=7, norm_topk_prob=True, hidden_size=H, moe_intermediate_size=I,
                              num_hidden_layers=LAYERS, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    T = gguf.GGMLQuantizationType
    raw = {(0, proj): (random_k_experts(kind, EXPERTS, H if proj == "down" else I, seed), getattr(T, kind))
           for seed, (proj, kind) in enumerate((("gate", "Q4_K"), ("up", "Q4_K"), ("down", "Q6_K")))}
    paths["gguf"] = root / "m.gguf"
    write_gguf(model, paths["gguf"], expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=raw)
    small = make_family_model("qwen3_moe", seed=8, norm_topk_prob=True, num_hidden_layers=LAYERS,
                              num_experts=EXPERTS, num_experts_per_tok=TOP_K)  # the family's tiny sizes
    paths["gguf-q8_0"] = root / "q8.gguf"
    write_gguf(small, paths["gguf-q8_0"], expert_types=T.Q8_0, other_type=T.Q8_0)
    return paths


def _generate(path, kernels: str, offload: OffloadConfig | None, captured: bool, monkeypatch, tmp_path):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    model = MoEModel.from_pretrained(path, dtype=torch.float32, kernels=kernels, offload=offload)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    try:
        if captured:
            step = model.capture_decode(capture_factory=TraceCapture)
            step.inner = model.model  # plain step inputs
            model.use_backend(HostArgs(model.experts))
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
        return out, (step, model.experts.device_graphs, model.experts.fmt, model.stats) if captured else None
    finally:
        model.close()


# the Triton kernels interpreted on the small models (the K-quant model's 256-wide GEMMs: the pool-level test,
# tests/test_device_graphs_formats.py)
CASES = [("mxfp4", "torch"), ("biased-awq", "torch"), ("gguf", "torch"), ("mxfp4", "triton"),
         ("biased-awq", "triton"), ("gguf-q8_0", "triton")]


@pytest.mark.parametrize(("model", "kernels"), CASES)
def test_captured_decode_gives_the_eager_and_resident_tokens(checkpoints, model, kernels, monkeypatch, tmp_path):
    path = checkpoints[model]
    lru = OffloadConfig(policy="lru", gpu_expert_slots=TOP_K + 1)
    want, _ = _generate(path, kernels, None, False, monkeypatch, tmp_path)
    eager, _ = _generate(path, kernels, lru, False, monkeypatch, tmp_path)
    got, (step, device, fmt, _) = _generate(path, kernels, lru, True, monkeypatch, tmp_path)
    assert fmt.capture_unsupported("torch") is None and type(fmt).__name__ == {
        "mxfp4": "MXFP4Format", "biased-awq": "BiasedAWQFormat", "gguf": "GGUFFormat", "gguf-q8_0": "GGUFFormat"}[model]
    assert step.refused is None and device.disabled is None and device.refused == {}, (device.disabled,
                                                                                         device.refused)
    # one bucket (batch 2) captured at the first decode step, replayed for every group and combine after it
    assert device.captures == 1 and device.eager_layers == 0
    assert device.replays > 2 * (NEW_TOKENS - 2) * LAYERS
    assert torch.equal(eager, want) and torch.equal(got, want), (want, eager, got)


def test_hybrid_cpu_experts_with_the_captured_device_part_on_mxfp4(checkpoints, monkeypatch, tmp_path):
    """Misses computed on the CPU (MXFP4's CPU form) are written into the bucket's static ``out`` before the
    combine's replay: the tokens are the same hybrid configuration's run eagerly."""
    config = OffloadConfig(policy="lru", gpu_expert_slots=TOP_K + 1, cpu_compute="always")
    eager, _ = _generate(checkpoints["mxfp4"], "torch", config, False, monkeypatch, tmp_path)
    got, (step, device, _, stats) = _generate(checkpoints["mxfp4"], "torch", config, True, monkeypatch, tmp_path)
    assert step.refused is None and device.refused == {} and device.captures == 1 and device.eager_layers == 0
    assert stats.decode.cpu_experts > 0  # CPU work in the captured decode steps
    assert torch.equal(got, eager)
