"""Hunyuan-A13B (``hunyuan_v1_moe``: Tencent's Hunyuan-A13B-Pretrain / -Instruct, 80B parameters, 13B active).

Every layer: grouped-query attention whose queries and keys are RMS-normalised per head *after* the rotary
(``self_attn.query_layernorm`` / ``key_layernorm``), biases on q/k/v/o when ``attention_bias``; then an MoE block
(:mod:`.llama_moe`): a softmax router ``mlp.gate.wg`` whose top-k (``moe_topk``) is always renormalised, routed
experts ``mlp.experts.E.{gate,up,down}_proj`` of ``intermediate_size``, and one shared gated MLP ``mlp.shared_mlp``
of ``intermediate_size`` added to every token. The rotary of the release is ``rope_scaling`` ``{"type": "dynamic",
"alpha": A}``: NTK scaling with a fixed alpha, i.e. the base ``rope_theta x A^(d / (d - 2))`` at every length.

config.json gives ``moe_topk``, ``moe_intermediate_size`` and ``num_shared_expert`` as per-layer lists (one value
repeated in the release). Refused by name (no release uses them; transformers' ``HunYuanMoEV1ForCausalLM`` cannot
run most of them either): per-layer values that differ, experts or shared MLPs of another size than
``intermediate_size``, cross-layer attention (``use_cla``), latent attention (``use_mla``), layers without an MoE
block, dynamic NTK scaling by ``factor`` (length-dependent) or linear scaling, other routers
(``group_limited_greedy``, a scaling factor).
``use_qk_norm`` false (no release) drops the QK-norm, as the flag says (transformers 5.x ignores it: always a norm).
The router's linear layer computes in the model's dtype (transformers: fp32), as for the other families.
"""

from __future__ import annotations

from typing import Any

from moeflow.errors import CheckpointError
from moeflow.families.base import ExpertLayout
from moeflow.families.llama_moe import LlamaMoEConfig, LlamaMoEFamily, common_fields, require
from moeflow.moe.routing import RouterSpec

RENAMES = {".mlp.shared_expert.": ".mlp.shared_mlp.", ".mlp.gate.weight": ".mlp.gate.wg.weight",
           ".self_attn.q_norm.": ".self_attn.query_layernorm.", ".self_attn.k_norm.": ".self_attn.key_layernorm."}


def one_value(raw: dict[str, Any], source: str, key: str, default: Any = None) -> Any:
    """config.json's ``key``: a number, or a per-layer list of one repeated value (refused when they differ)."""
    value = raw.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1 or len(value) != raw.get("num_hidden_layers"):
            raise CheckpointError(f"{source}: {key}={value} is not one value for each of the num_hidden_layers="
                                  f"{raw.get('num_hidden_layers')} layers (moeflow needs every layer alike)")
        value = value[0]
    return value


def rotary_base(raw: dict[str, Any], source: str, head_dim: int) -> float:
    """The rotary base: ``rope_theta``, times ``alpha^(d / (d - 2))`` with NTK-alpha scaling (``"dynamic"`` + alpha)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "dynamic" and rope.get("alpha"):
        return theta * float(rope["alpha"]) ** (head_dim / (head_dim - 2))
    if kind != "default":
        raise CheckpointError(f"{source}: rope type {kind!r} with {rope} is not supported for hunyuan_v1_moe (the "
                              f"default rotary, or 'dynamic' with a fixed alpha as Hunyuan-A13B)")
    return theta


def parse_hunyuan(raw: dict[str, Any], source: str) -> LlamaMoEConfig:
    """config.json -> :class:`LlamaMoEConfig` (see the module docstring for what is refused)."""
    for key, ok, what in (
        ("use_cla", lambda v: not v, "cross-layer attention"), ("use_mla", lambda v: not v, "latent attention"),
        ("use_mixed_mlp_moe", lambda v: v in (None, True), "MoE blocks without the shared MLP"),
        ("moe_layer_num_skipped", lambda v: not v, "layers without an MoE block"),
        ("use_rotary_pos_emb", lambda v: v in (None, True), "attention without rotary"),
        ("mlp_bias", lambda v: not v, "biased MLPs"), ("hidden_act", lambda v: v in (None, "silu"), "only silu"),
        ("group_limited_greedy", lambda v: not v, "group-limited routing"),
        ("routed_scaling_factor", lambda v: v in (None, 1, 1.0), "a routed scaling factor"),
        ("norm_topk_prob", lambda v: v in (None, True), "unnormalised top-k weights"),
        ("num_experts", lambda v: not isinstance(v, list), "per-layer expert counts"),
    ):
        if not ok(raw.get(key)):
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported for hunyuan_v1_moe ({what}; the "
                                  f"released Hunyuan-A13B checkpoints use none)")
    require(raw, source, "hidden_size", "num_attention_heads", "intermediate_size", "num_experts", "moe_topk")
    head_dim = int(raw.get("head_dim") or raw.get("attention_head_dim")
                   or raw["hidden_size"] // raw["num_attention_heads"])
    fields = common_fields({**raw, "num_experts_per_tok": one_value(raw, source, "moe_topk"), "head_dim": head_dim,
                            "rope_theta": rotary_base(raw, source, head_dim), "rope_parameters": None,
                            "rope_scaling": None}, source)
    size = int(raw["intermediate_size"])
    expert_size = one_value(raw, source, "moe_intermediate_size", size)
    shared = one_value(raw, source, "num_shared_expert", 1)
    if expert_size != size or shared != 1:
        raise CheckpointError(f"{source}: moe_intermediate_size={expert_size} and num_shared_expert={shared} must be "
                              f"intermediate_size={size} and 1 (the experts and the shared MLP are intermediate_size "
                              f"wide in transformers' HunYuanMoEV1; the release agrees)")
    bias = bool(raw.get("attention_bias", False))
    fields.update(norm_topk_prob=True, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)))
    return LlamaMoEConfig(
        **fields, num_experts=int(raw["num_experts"]), experts_key="num_experts", moe_intermediate_size=size,
        moe_layer_ids=tuple(range(fields["num_hidden_layers"])), shared_expert_intermediate_size=size,
        qkv_bias=bias, o_bias=bias, qk_norm="head_after_rotary" if raw.get("use_qk_norm", True) else None)


class HunyuanV1MoeFamily(LlamaMoEFamily):
    name = "hunyuan_v1_moe"
    model_types = ("hunyuan_v1_moe",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaMoEConfig:
        return parse_hunyuan(raw, source)

    def router_spec(self) -> RouterSpec:
        return RouterSpec(top_k=self.config.num_experts_per_tok, scoring="softmax", renormalize=True)

    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        for ours, theirs in RENAMES.items():
            param_path = param_path.replace(ours, theirs)
        return super().checkpoint_name(param_path, layout)

    def attention_linear(self, name: str) -> str | None:
        """The attention projections and the shared MLP (built by the same linear factory: quantized together)."""
        module = super().attention_linear(name.replace(".mlp.shared_mlp.", ".mlp.shared_expert."))
        return module.replace(".mlp.shared_expert.", ".mlp.shared_mlp.") if module else None
