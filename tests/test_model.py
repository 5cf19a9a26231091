"""moeflow's Mixtral against transformers' own on tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_checkpoint, make_tiny_model

from moeflow import MoEOffloadedMixtral

CONFIGS = {
    "gqa-2-layers": {},
    "odd-sizes-1-layer": dict(hidden_size=72, intermediate_size=56, num_attention_heads=6, num_key_value_heads=3,
                              num_hidden_layers=1, num_local_experts=5, vocab_size=131),
    "mha-3-layers-top1": dict(num_hidden_layers=3, num_key_value_heads=4, num_experts_per_tok=1,
                              num_local_experts=7),
    "sliding-window": dict(sliding_window=6, num_hidden_layers=2),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    overrides = CONFIGS[name]
    ref = make_tiny_model(seed=1, **overrides)
    ref.save_pretrained(tmp_path)
    model = MoEOffloadedMixtral.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    vocab = ref.config.vocab_size
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    got = model(ids).logits
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-4
    with torch.no_grad():
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    got_tokens = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=[])
    assert torch.equal(got_tokens, want_tokens)


def test_left_padded_batch_matches_transformers(tmp_path):
    ref = make_tiny_model(seed=2)
    ref.save_pretrained(tmp_path)
    model = MoEOffloadedMixtral.from_pretrained(tmp_path)
    ids = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want_logits = ref(ids, attention_mask=mask).logits
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    got_logits = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(got_logits[real], want_logits[real]) < 1e-4
    got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=[])
    assert torch.equal(got, want)


def test_padded_sequence_generates_what_it_generates_alone(tmp_path):
    make_tiny_checkpoint(tmp_path, seed=5)
    model = MoEOffloadedMixtral.from_pretrained(tmp_path)
    short = torch.tensor([[5, 17, 33, 8]])
    long = torch.tensor([[9, 4, 61, 22, 13, 70, 2]])
    alone = model.generate(short, max_new_tokens=10, eos_token_id=[])
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    together = model.generate(batch, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(together[0, 3:], alone[0])


def test_eos_stops_and_pads(tmp_path):
    make_tiny_checkpoint(tmp_path, seed=6)
    model = MoEOffloadedMixtral.from_pretrained(tmp_path)
    ids = torch.tensor([[5, 17, 33, 8]])
    free = model.generate(ids, max_new_tokens=12, eos_token_id=[])
    eos = int(free[0, 4 + 3])  # make the 4th generated token the EOS
    stopped = model.generate(ids, max_new_tokens=12, eos_token_id=eos)
    assert stopped.shape[1] <= 4 + 4
    assert int(stopped[0, -1]) == eos


def test_sampling_is_seeded_and_overrides_generation_config(tmp_path):
    make_tiny_checkpoint(tmp_path, seed=7)
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.7, "top_p": 0.9}')
    model = MoEOffloadedMixtral.from_pretrained(tmp_path)
    assert model.generation_config.do_sample is True
    ids = torch.tensor([[5, 17, 33, 8]])
    a = model.generate(ids, max_new_tokens=12, seed=11, eos_token_id=[])
    b = model.generate(ids, max_new_tokens=12, seed=11, eos_token_id=[])
    assert torch.equal(a, b)
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    greedy2 = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    assert torch.equal(greedy, greedy2)


def test_streamer_receives_prompt_then_each_token(tmp_path):
    make_tiny_checkpoint(tmp_path, seed=8)
    model = MoEOffloadedMixtral.from_pretrained(tmp_path)

    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, ids):
            self.chunks.append(ids.clone())

        def end(self):
            self.ended = True

    rec = Recorder()
    ids = torch.tensor([[5, 17, 33]])
    out = model.generate(ids, max_new_tokens=5, streamer=rec, eos_token_id=[])
    assert rec.ended and torch.equal(rec.chunks[0], ids)
    assert [int(c[0]) for c in rec.chunks[1:]] == out[0, 3:].tolist()


def test_fused_expert_layout_loads_like_classic(tmp_path):
    """Recent transformers keep experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj); read that layout."""
    from safetensors.torch import load_file, save_file

    ref = make_tiny_model(seed=9)
    classic = tmp_path / "classic"
    ref.save_pretrained(classic)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((classic / "config.json").read_text())
    sd = load_file(classic / "model.safetensors")
    cfg = ref.config
    out = {}
    for name, t in sd.items():
        if ".block_sparse_moe.experts." in name:
            continue
        out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer in range(cfg.num_hidden_layers):
        base = f"model.layers.{layer}.block_sparse_moe.experts"
        e_range = range(cfg.num_local_experts)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{base}.{e}.w1.weight"], sd[f"{base}.{e}.w3.weight"]]) for e in e_range])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([sd[f"{base}.{e}.w2.weight"] for e in e_range])
    save_file(out, fused / "model.safetensors")
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    a = MoEOffloadedMixtral.from_pretrained(classic)(ids).logits
    b = MoEOffloadedMixtral.from_pretrained(fused)(ids).logits
    assert torch.equal(a, b)


def test_sharded_checkpoint_with_index(tmp_path):
    ref = make_tiny_model(seed=10)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
    got = MoEOffloadedMixtral.from_pretrained(tmp_path)(ids).logits
    assert rel_err(got, want) < 1e-4
