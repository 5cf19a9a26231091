"""Tiny random DeepSeek-V2 / V3, GLM-4.5, dots.llm1, MiniMax-M2 and Hunyuan-A13B checkpoints written by
transformers, and the exact-token invariant's steps on such models: predictors trained on a trace, one offloaded
greedy run (shared by several tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=256, n_routed_experts=8, num_experts_per_tok=2,
            tie_word_embeddings=False)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)

DEEPSEEK_V3 = {
    "qlora-groups-dense": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                               norm_topk_prob=True, routed_scaling_factor=2.5),
    "no-qlora-unnormalised": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0,
                                  n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    "yarn-halves-rope": dict(q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=1, rope_interleave=False,
                             norm_topk_prob=True, routed_scaling_factor=1.5, num_experts_per_tok=3,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 32, "mscale": 0.9,
                                              "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}
DEEPSEEK_V2 = {
    "greedy-no-qlora": dict(q_lora_rank=None, topk_method="greedy", first_k_dense_replace=1, n_shared_experts=2,
                            routed_scaling_factor=1.0),
    "group-limited-qlora": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=3.0,
                                num_experts_per_tok=3),
}
GLM4_MOE = {
    "qk-norm-bias-groups": dict(num_key_value_heads=2, head_dim=32, use_qk_norm=True, attention_bias=True,
                                n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                                routed_scaling_factor=2.5, partial_rotary_factor=0.5),
    "plain-unnormalised": dict(num_key_value_heads=4, use_qk_norm=False, attention_bias=False, n_group=1,
                               topk_group=1, first_k_dense_replace=0, norm_topk_prob=False,
                               routed_scaling_factor=1.0, n_shared_experts=2, partial_rotary_factor=0.25),
}

DOTS1 = {
    "groups-dense-shared": dict(num_key_value_heads=2, head_dim=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                                n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    "mha-bias-unnormalised": dict(num_key_value_heads=4, attention_bias=True, n_group=1, topk_group=1,
                                  first_k_dense_replace=0, n_shared_experts=1, norm_topk_prob=False,
                                  routed_scaling_factor=1.0, num_experts_per_tok=3),
}

# MiniMax-M2: every layer MoE, experts of intermediate_size, no shared expert or groups
MINIMAX_BASE = dict({k: v for k, v in BASE.items() if k not in ("n_routed_experts", "moe_intermediate_size")},
                    intermediate_size=32, num_local_experts=8, bos_token_id=None, eos_token_id=None)
MINIMAX_M2 = {
    "qk-norm-partial-rotary": dict(num_key_value_heads=2, head_dim=32, rotary_dim=16, use_qk_norm=True,
                                   use_routing_bias=True),
    "no-qk-norm-no-bias-full-rotary": dict(num_key_value_heads=4, head_dim=16, rotary_dim=16, use_qk_norm=False,
                                           use_routing_bias=False, num_experts_per_tok=3, rope_theta=10000.0),
}

# Hunyuan-A13B: every layer MoE with one shared MLP, experts and shared MLP of intermediate_size; the release's
# rotary (NTK scaling with a fixed alpha) and per-layer lists, as its config.json gives them
HUNYUAN_BASE = dict(MINIMAX_BASE, num_experts=8)
del HUNYUAN_BASE["num_local_experts"]
HUNYUAN = {
    "alpha-rope-lists-tied": dict(num_key_value_heads=2, head_dim=32, moe_topk=[2] * 3, moe_intermediate_size=[32] * 3,
                                  num_shared_expert=[1] * 3, tie_word_embeddings=True, rope_theta=10000.0,
                                  rope_scaling={"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                                                "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"}),
    "bias-no-qk-norm-plain-rope": dict(num_key_value_heads=4, head_dim=16, moe_topk=3, attention_bias=True,
                                       use_qk_norm=False, rope_theta=50000.0),
}


def make_model(kind: str, seed: int = 0, **overrides):
    """A random transformers DeepseekV2/V3ForCausalLM, Glm4MoeForCausalLM, Dots1ForCausalLM, MiniMaxM2ForCausalLM or
    HunYuanMoEV1ForCausalLM (fp32, eval mode), its weights scaled up so routing and logits are far from ties; the
    selection bias is random too (zero where the config says ``use_routing_bias`` false)."""
    import transformers

    classes = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", MLA),
               "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", MLA),
               "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {}),
               "dots1": ("Dots1Config", "Dots1ForCausalLM", {}),
               "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", MLA),
               "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {}),
               "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {})}
    config_name, model_name, attention = classes[kind]
    base = {"minimax_m2": MINIMAX_BASE, "hunyuan_v1_moe": HUNYUAN_BASE}.get(kind, BASE)
    cfg = getattr(transformers, config_name)(**{**base, **attention, **overrides})
    if kind == "minimax_m2" and "partial_rotary_factor" not in cfg.rope_parameters and cfg.rotary_dim:
        # the released checkpoints' rotary_dim, as transformers >= 5.24's config derives the factor from it (5.17, the
        # lent GPU machine's, ignores it: its model would turn the whole head; moeflow reads rotary_dim)
        cfg.rope_parameters["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    model_cls = getattr(transformers, model_name)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.5 if name.endswith(("mlp.gate.weight", "mlp.gate.wg.weight")) else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05 if getattr(cfg, "use_routing_bias", True) else 0.0)
    if not getattr(cfg, "use_qk_norm", True):  # MiniMax-M2's, Hunyuan's "no QK-norm": transformers always builds one
        for layer in model.model.layers:
            for norm in ("q_norm", "k_norm", "query_layernorm", "key_layernorm"):
                if hasattr(layer.self_attn, norm):
                    setattr(layer.self_attn, norm, torch.nn.Identity())
    return model


def make_checkpoint(directory: str | Path, kind: str, seed: int = 0, **overrides) -> tuple[Path, object]:
    """Save a tiny random checkpoint of ``kind`` into ``directory``; returns (directory, the transformers model)."""
    model = make_model(kind, seed, **overrides)
    model.save_pretrained(directory)
    return Path(directory), model


def assert_matches_transformers(model, ref, new_tokens: int = 32, seed: int = 3) -> None:
    """fp32 logits within 1e-4 (relative to the largest) and ``new_tokens`` greedy tokens equal to ``ref``'s."""
    ids = torch.randint(0, ref.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = ref(ids).logits
        want_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    got = model(ids).logits
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert torch.equal(model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[]), want_tokens)


def with_experts(ref, state: dict[str, torch.Tensor], experts: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """``ref`` (a transformers model of these families) carrying ``state`` (checkpoint names) and, per MoE layer,
    ``experts["model.layers.L"] = (w13 [E, 2I, H] gate rows first, w2 [E, H, I])`` in its fused in-memory names."""
    state = {k.replace(".block_sparse_moe.", ".mlp."): v.float() for k, v in state.items()}  # MiniMax-M2's
    for layer, (w13, w2) in experts.items():
        state[f"{layer}.mlp.experts.gate_up_proj"], state[f"{layer}.mlp.experts.down_proj"] = w13, w2
    missing, unexpected = ref.load_state_dict(state, strict=False)
    tied = ["lm_head.weight"] if ref.config.tie_word_embeddings else []
    assert not unexpected and missing == tied, (missing, unexpected)
    return ref.eval()


def dequantized_reference(ref, awq_dir: Path, group: int):
    """``ref`` carrying exactly the weights of its AWQ checkpoint in ``awq_dir`` (``moeflow quantize``'s output:
    experts and any quantized attention dequantized, everything else as saved)."""
    from safetensors.torch import load_file

    from moeflow.quant.awq import dequantize

    cfg, sd = ref.config, load_file(awq_dir / "model.safetensors")
    prefix, names = (("block_sparse_moe", ("w1", "w3", "w2")) if cfg.model_type == "minimax_m2"
                     else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    experts = {}
    for layer in range(getattr(cfg, "first_k_dense_replace", 0), cfg.num_hidden_layers):
        base = f"model.layers.{layer}.{prefix}.experts"
        w = [[dequantize(*(sd[f"{base}.{e}.{p}.{kind}"] for kind in ("qweight", "qzeros")),
                         sd[f"{base}.{e}.{p}.scales"].float(), group).T for p in names]
             for e in range(getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts)]
        experts[f"model.layers.{layer}"] = (torch.stack([torch.cat([g, u]) for g, u, _ in w]),
                                            torch.stack([d for *_, d in w]))
    state = {k: v for k, v in sd.items() if ".experts." not in k and not k.endswith((".qweight", ".qzeros", ".scales"))}
    for name in [k.removesuffix(".qweight") for k in sd if k.endswith(".qweight") and ".experts." not in k]:
        state[f"{name}.weight"] = dequantize(sd[f"{name}.qweight"], sd[f"{name}.qzeros"], sd[f"{name}.scales"].float(),
                                             group).T  # quantized attention (``moeflow quantize --attention``)
    return with_experts(ref, state, experts)


def write_fp8_checkpoint(src: Path, dst: Path, config: dict, block: tuple[int, int],
                         is_fp8: Callable[[str, torch.Tensor], bool]) -> dict[str, torch.Tensor]:
    """``src``'s checkpoint written to ``dst`` with the tensors ``is_fp8`` picks in FP8 with ``block`` scales
    (``<name>_scale_inv``), and ``config`` as its config.json; returns the weights it stands for (FP8 dequantized)."""
    import json

    from safetensors.torch import load_file, save_file

    from moeflow.quant.fp8 import dequantize_fp8_block, quantize_fp8_block

    out, effective = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if is_fp8(name, t):
            q, scale_inv = quantize_fp8_block(t, block)
            out[name], out[f"{name}_scale_inv"] = q, scale_inv
            effective[name] = dequantize_fp8_block(q, scale_inv, block)
        else:
            out[name] = effective[name] = t
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return effective


# ---------------------------------------------------------------- the exact-token invariant on these families
# predictor options of the predictive policies, small enough for the tiny models (6 experts, 97 tokens)
PREDICTOR_OPTIONS = {"duoserve": {"epochs": 2, "widths": [32, 16, 16, 8, 8, 8]}, "promoe": {"epochs": 2},
                     "finemoe": {"capacity": 64}, "expertflow": {"epochs": 2, "vocab_size": 97}}


def train_predictors(resident, path: Path, gen: torch.Generator) -> None:
    """Record the resident model's trace on six random prompts (drawn from ``gen``) and train every predictive
    policy's predictor on it, saved where the policies look by default: ``<path>/predictors/<kind>.pt``."""
    from moeflow.offload.predictors import train_predictor
    from moeflow.tools.record import record_trace

    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 7, 4, 6, 8, 5)]
    trace = record_trace(resident, prompts, max_new_tokens=6, hidden=True)
    for kind, opts in PREDICTOR_OPTIONS.items():
        train_predictor(kind, trace, eval_fraction=0.2, **opts).save(path / "predictors" / f"{kind}.pt")


def expertflow_predictor_file(checkpoint: Path, directory: Path) -> Path:
    """An expertflow predictor for the checkpoint, trained (3 epochs, seed 0) on its trace of 12 random prompts of
    4-13 tokens, 5 new tokens each, saved as ``<directory>/expertflow.pt``."""
    from moeflow import MoEOffloadedMixtral
    from moeflow.offload.predictors import train_predictor
    from moeflow.tools.record import record_trace

    model = MoEOffloadedMixtral.from_pretrained(checkpoint)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (int(torch.randint(4, 14, (1,), generator=g)),), generator=g).tolist()
               for _ in range(12)]
    pred = train_predictor("expertflow", record_trace(model, prompts, 5), epochs=3, seed=0)
    return pred.save(directory / "expertflow.pt")


def offloaded_generate(path: Path, ids: torch.Tensor, mask: torch.Tensor, policy: str, transport: str,
                       n_slots: int, new_tokens: int, early_hits: bool = False):
    """(greedy tokens, stats) of the checkpoint at ``path`` offloaded with ``policy`` into ``n_slots`` slots over
    ``transport`` (random delays of 0.3 ms, seeded by the slot count); the model is closed after."""
    from moeflow import MoEModel, OffloadConfig

    model = MoEModel.from_pretrained(path, offload=OffloadConfig(
        policy=policy, gpu_expert_slots=n_slots, transport=transport, random_delay_ms=0.3, seed=n_slots,
        early_hits=early_hits))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    finally:
        model.experts.close()
    return out, model.stats


def resident_reference(directory: Path, kind: str, seed: int, gen_seed: int, padded_row: int, pad: int,
                       new_tokens: int, **shape) -> tuple[Path, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tiny ``kind`` checkpoint in ``directory`` with every predictive policy's predictor trained on its trace, and
    (its path, prompt ids [2, 9], their mask (row ``padded_row`` left-padded by ``pad``), the all-resident greedy
    tokens): what every offload policy must reproduce."""
    from moeflow import MoEModel, OffloadConfig

    path, _ = make_checkpoint(directory, kind, seed=seed, **shape)
    resident = MoEModel.from_pretrained(path, offload=OffloadConfig(policy="resident"))
    assert resident.family.name == kind
    gen = torch.Generator().manual_seed(gen_seed)
    train_predictors(resident, path, gen)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[padded_row, :pad] = 0
    return path, ids, mask, resident.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


def assert_keeps_resident_tokens(reference: tuple, policy: str, transport: str, slot_counts,
                                 new_tokens: int, total_experts: int | None = None) -> None:
    """``policy`` over ``transport`` at each of ``slot_counts`` gives the all-resident greedy tokens of
    ``reference`` ((path, ids, mask, tokens): :func:`resident_reference`'s), with experts looked up in the prefill
    and in the decode, and (given ``total_experts``) copied to the slots whenever fewer slots than experts. With
    the random-delay transport every odd slot count launches each layer's hits before its read-back (early hits),
    unless the checkpoint is quantized (its CPU int4 slots compute a group only once the routing is on the host)."""
    path, ids, mask, expected = reference
    quantized = "quantization_config" in json.loads((Path(path) / "config.json").read_text())
    for n_slots in slot_counts:
        early = transport == "random-delay" and n_slots % 2 == 1 and not quantized
        out, s = offloaded_generate(path, ids, mask, policy, transport, n_slots, new_tokens, early_hits=early)
        assert torch.equal(out, expected), f"{policy}/{transport} with {n_slots} slots: {out} != {expected}"
        assert s.prefill.hits + s.prefill.misses > 0 and s.decode.hits + s.decode.misses > 0
        if total_experts is not None and n_slots < total_experts:
            assert s.prefill.bytes_h2d + s.decode.bytes_h2d > 0
