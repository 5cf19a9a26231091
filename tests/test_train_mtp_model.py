"""scripts/train_mtp_model.py: a two-step run of a tiny shape writes a checkpoint in DeepSeek-V3's published names that
moeflow reads with ``mtp=True``; moeflow's main logits and MTP-layer logits equal the training script's forward on the
same weights (so the acceptance measured on the trained model is the trained head's), and speculation on it gives
plain greedy's tokens; benchmarks/engine/mtp_trained.py runs on it. ~40 s on 2 cores (most of it collecting the
corpus)."""

from __future__ import annotations

import json

import pytest
import torch
from mtp_helpers import mtp_layer_logits
from safetensors.torch import load_file

from moeflow import MoEModel

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--steps", "2", "--warmup", "1", "--hidden", "64", "--experts", "8", "--top-k", "2", "--expert-width", "32",
        "--seq-len", "32", "--batch-size", "2", "--eval-windows", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from scripts import train_mtp_model as tm

    threads = torch.get_num_threads()
    out = tmp_path_factory.mktemp("train_mtp") / "ckpt"
    try:
        assert tm.main([*TINY, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_checkpoint_is_read_as_trained(trained):
    from scripts import train_mtp_model as tm

    out = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["num_nextn_predict_layers"] == 1
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 2 and 0.0 <= report["heldout"]["mtp_top1_t_plus_2"] <= 1.0
    tensors = load_file(out / "model.safetensors")
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens", "shared_head.head"):
        assert f"model.layers.4.{name}.weight" in tensors
    assert "model.layers.4.mlp.experts.gate_up_proj" in tensors or "model.layers.4.mlp.experts.0.gate_proj.weight" \
        in tensors

    # the training script's model on the saved weights
    args = tm.parse_args(TINY)
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(tm.make_config(args, with_mtp_block=True)).eval()
    own = {k.removeprefix("model.layers.4."): v for k, v in tensors.items()
           if k.startswith("model.layers.4.") and k.split(".")[3] in ("enorm", "hnorm", "eh_proj", "shared_head")}
    missing, _ = model.load_state_dict({k: v for k, v in tensors.items() if k not in
                                        {f"model.layers.4.{n}" for n in own}}, strict=False)
    assert not missing
    mtp = tm.MTPModule(64, model.config.rms_norm_eps)
    with torch.no_grad():
        mtp.enorm.weight.copy_(own["enorm.weight"])
        mtp.hnorm.weight.copy_(own["hnorm.weight"])
        mtp.eh_proj.weight.copy_(own["eh_proj.weight"])
        mtp.shared_head_norm.weight.copy_(own["shared_head.norm.weight"])
        ids = torch.tensor([list(b"def f(x): return x + 1")])
        want_main, want_mtp = tm.forward(model, mtp, ids, 4)  # main: positions 0..T-2; MTP: 0..T-3

    mf = MoEModel.from_pretrained(out, mtp=True)
    logits, got_mtp = mtp_layer_logits(mf, ids[:, :-1], cache_len=64)
    assert float((logits - want_main).abs().max() / want_main.abs().max()) < 1e-4
    assert float((got_mtp - want_mtp).abs().max() / want_mtp.abs().max()) < 1e-4

    plain = mf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[])
    spec = mf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=[], num_speculative_tokens=2)
    assert torch.equal(plain, spec)


def test_benchmark_on_the_checkpoint(trained, tmp_path):
    """benchmarks/engine/mtp_trained.py in a tiny run: tokens equal plain greedy (it asserts it), and the simulator's
    lru bytes ratio equals the engine's."""
    from benchmarks.engine import mtp_trained

    threads = torch.get_num_threads()
    try:
        report = mtp_trained.main(["--model", str(trained), "--prompts", "1", "--prompt-len", "16", "--new-tokens",
                                   "6", "--ks", "1", "--policies", "lru", "--profiles", "pcie4-24gb",
                                   "--out", str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "r.json").is_file() and report["acceptance"][0]["tokens_equal"]
    engine = {r["experts_fraction"]: r for r in report["engine"]}
    sim = {r["experts_fraction"]: r for r in report["simulated"]}
    assert set(engine) == set(sim) == {0.25, 0.5}
    for frac, row in engine.items():
        assert row["tokens_equal"]
        assert sim[frac]["bytes_ratio"] == pytest.approx(row["bytes_ratio"], rel=1e-3)
