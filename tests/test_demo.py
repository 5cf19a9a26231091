"""The embedded model and `moeflow demo`, as a user runs them."""

from __future__ import annotations

import json
import math

import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path, main


def test_embedded_model_is_a_small_awq_checkpoint_with_a_tokenizer():
    path = embedded_model_path()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 8 * 2**20
    model = MoEOffloadedMixtral.from_pretrained(path, kernels="torch")
    assert model.experts.fmt.kind == "awq"
    assert model.config.num_local_experts == 8 and model.config.num_experts_per_tok == 2
    text = "def f(x):\n    return x  # é"
    assert model.tokenizer.encode(text) == list(text.encode("utf-8"))
    assert model.tokenizer.decode(model.tokenizer.encode(text)) == text


def test_embedded_model_learned_text_and_non_uniform_routing():
    report = json.loads((embedded_model_path() / "report.json").read_text())
    assert report["awq_torch"]["bits_per_byte"] < 3.0  # uniform bytes would be 8, unigram English ~4.5
    usage = torch.tensor(report["fp32"]["usage_share"])  # [layers, experts] share of routed tokens
    assert bool((usage > 0.02).all()), "an expert is (nearly) unused: routing collapsed"
    # per token the router is far from uniform even though load is balanced over the text
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), kernels="torch")
    ids = torch.tensor([list(b"The import statement is used to bring a module into scope.")])
    probs = []
    hooks = [layer.block_sparse_moe.gate.register_forward_hook(lambda m, i, o: probs.append(o.softmax(-1)))
             for layer in model.model.layers]
    model(ids)
    for h in hooks:
        h.remove()
    for p in probs:
        entropy = float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean()) / math.log(p.shape[-1])
        assert entropy < 0.98


def test_demo_streams_text_and_prints_stats(capsys):
    assert main(["demo", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "expert slots" in out and "TTFT" in out and "hit rate" in out
    generated = out.split("\n\n", 1)[1]
    assert generated.startswith("The import statement") and len(generated.splitlines()[0]) > len("The import statement")


def test_demo_policies_keep_the_resident_tokens():
    path = embedded_model_path()
    ids = torch.tensor([list(b"The import statement")])
    want = MoEOffloadedMixtral.from_pretrained(path, kernels="torch").generate(ids, max_new_tokens=16,
                                                                               do_sample=False)
    for policy, slots in (("lru", 16), ("mixtral-offloading", 8), ("ondemand", 2)):
        model = MoEOffloadedMixtral.from_pretrained(path, kernels="torch",
                                                    offload=OffloadConfig(gpu_expert_slots=slots, policy=policy))
        assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False), want), policy
