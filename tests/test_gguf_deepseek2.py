"""llama.cpp's ``deepseek2`` GGUF files (DeepSeek-V2 / V2-Lite / V3, written here with gguf-py as the converter lays
them out: tests/gguf_deepseek2.py) loaded by ``from_pretrained``: the config from the metadata (MLA sizes, router by
``expert_gating_func``, groups, YaRN with mscale, leading dense layers, shared experts), ``kv_b_proj`` joined from
``attn_k_b`` / ``attn_v_b`` (or the older combined ``attn_kv_b``); fp32 logits and greedy tokens equal transformers'
on the file's dequantized weights; Q4_0 experts into the AWQ format and Q8_0 into the GGUF format; the exact-token
invariant (every offload policy x slot counts x transport) on the Q4_0 file. ~40 s on 2 cores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from gguf_deepseek2 import write_deepseek2_gguf  # noqa: E402
from gguf_models import T, gguf  # noqa: E402
from tiny_families import DEEPSEEK_V2, DEEPSEEK_V3, assert_matches_transformers, make_model  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.errors import CheckpointError  # noqa: E402

OFFLOAD_POLICIES = ("ondemand", "lru", "lfu", "static", "mixtral-offloading")
NEW_TOKENS = 8
# DeepSeek-V3-shaped: q LoRA, groups, a dense first layer, YaRN with llama.cpp's mscale == mscale_all_dim
V3_YARN = dict(DEEPSEEK_V3["qlora-groups-dense"], rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))  # the rebuilt tokenizers


def ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))


def load(path, **kw) -> MoEModel:
    return MoEModel.from_pretrained(path, dtype=torch.float32, kernels="torch", **kw)


@pytest.mark.parametrize("kind, case, kv_b", [("deepseek_v3", "yarn", "split"),
                                              ("deepseek_v2", "greedy-no-qlora", "split"),
                                              ("deepseek_v2", "group-limited-qlora", "combined")])
def test_deepseek2_f32_matches_transformers(tmp_path, kind, case, kv_b):
    ref = make_model(kind, seed=1, **(V3_YARN if case == "yarn" else DEEPSEEK_V2[case]))
    write_deepseek2_gguf(ref, tmp_path / "m.gguf", kv_b=kv_b)
    model = load(tmp_path / "m.gguf")
    try:
        cfg = model.family.config
        assert model.family.name == kind
        assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (16, 16, 8, 12)
        assert cfg.q_lora_rank == ref.config.q_lora_rank and cfg.rope_interleave
        assert (cfg.first_k_dense_replace, cfg.n_shared_experts) == (ref.config.first_k_dense_replace,
                                                                      ref.config.n_shared_experts)
        assert cfg.routed_scaling_factor == pytest.approx(ref.config.routed_scaling_factor)
        assert cfg.norm_topk_prob == bool(ref.config.norm_topk_prob)
        if case == "yarn":
            assert (cfg.scoring_func, cfg.n_group, cfg.topk_group) == ("sigmoid", 4, 2)
            assert cfg.rope_scaling["mscale_all_dim"] == cfg.rope_scaling["mscale"] == pytest.approx(0.8)
        else:
            assert cfg.topk_method == ref.config.topk_method
        assert_matches_transformers(model, ref)
    finally:
        model.close()


@pytest.mark.parametrize("expert_type, kind", [(T.Q4_0, "awq"), (T.Q8_0, "gguf")])
def test_deepseek2_quantized_experts_match_the_dequantized_reference(tmp_path, expert_type, kind):
    ref = make_model("deepseek_v3", seed=2, **DEEPSEEK_V3["no-qlora-unnormalised"])
    write_deepseek2_gguf(ref, tmp_path / "m.gguf", expert_type=expert_type, other_type=T.Q8_0)
    model = load(tmp_path / "m.gguf")
    try:
        assert model.experts.fmt.kind == kind
        assert_matches_transformers(model, ref, new_tokens=16)
    finally:
        model.close()


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds2_invariant") / "m-Q4_0.gguf"
    write_deepseek2_gguf(make_model("deepseek_v3", seed=4, **dict(V3_YARN, num_hidden_layers=2)), path,
                         expert_type=T.Q4_0)
    resident = load(path)
    want = resident.generate(ids(), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
    assert resident.experts.fmt.kind == "awq" and resident.family.moe_layers == (1,)
    resident.close()
    return path, want


@pytest.mark.parametrize("transport", ["sync", "random-delay"])
@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
def test_deepseek2_q4_0_offloaded_matches_resident(q4_0_file, policy, transport, monkeypatch, tmp_path):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(q4_0_file[0].parent / "cache"))
    path, want = q4_0_file
    for slots in (2, 5, 8):
        model = load(path, offload=OffloadConfig(policy=policy, gpu_expert_slots=slots, transport=transport,
                                                 random_delay_ms=0.3, seed=slots))
        try:
            got = model.generate(ids(), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])
            assert torch.equal(got, want), f"{policy}/{transport} with {slots} slots"
            s = model.stats
            assert s.prefill.hits + s.prefill.misses > 0 and s.decode.hits + s.decode.misses > 0
        finally:
            model.close()


def _rewrite(src, dst, drop: tuple[str, ...] = (), override: dict | None = None) -> None:
    """Copy GGUF ``src`` to ``dst`` without the tensors ``drop`` and with the integer metadata ``override``."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "deepseek2")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (override or {}).get(key, field.contents())
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, kind)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, t.data, raw_shape=[int(d) for d in reversed(t.shape.tolist())],
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_deepseek2_bad_files_are_refused_by_name(tmp_path):
    write_deepseek2_gguf(make_model("deepseek_v3", seed=5, **DEEPSEEK_V3["no-qlora-unnormalised"]), tmp_path / "m.gguf")
    _rewrite(tmp_path / "m.gguf", tmp_path / "nobias.gguf", drop=("blk.0.exp_probs_b.bias", "blk.1.exp_probs_b.bias",
                                                                  "blk.2.exp_probs_b.bias"))
    with pytest.raises(CheckpointError, match=r"nobias\.gguf.*exp_probs_b"):
        load(tmp_path / "nobias.gguf")
    _rewrite(tmp_path / "m.gguf", tmp_path / "gating.gguf", override={"deepseek2.expert_gating_func": 3})
    with pytest.raises(CheckpointError, match=r"gating\.gguf.*expert_gating_func=3"):
        load(tmp_path / "gating.gguf")
