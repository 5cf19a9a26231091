"""MiniMax-M2 / M2.1 / M2.5 (``minimax_m2``: 230B parameters, 10B active; 256 experts, top-8, in every layer).

Mixtral's checkpoint layout (``block_sparse_moe.experts.E.{w1,w2,w3}``, router ``block_sparse_moe.gate``;
:mod:`.mixtral`) with two differences:

* attention: grouped-query with RMS QK-norm over the whole q / k projection (``self_attn.q_norm`` of
  ``heads x head_dim``, before the split into heads: ``qk_norm_type`` "per_layer"), then rotary on the first
  ``rotary_dim`` values of each head only (published: ``rotary_dim``; transformers 5.x writes
  ``rope_parameters.partial_rotary_factor`` too);
* router: sigmoid scores, the top-k chosen on the scores plus ``block_sparse_moe.e_score_correction_bias`` and
  weighted by the unbiased scores, always renormalised, never scaled; no groups, no shared expert.

``use_qk_norm`` / ``use_routing_bias`` false (no released checkpoint) drop the norm / the bias, as the flags say
(transformers 5.x ignores both and always builds them). The multi-token-prediction modules
(``use_mtp``, ``num_mtp_modules``) are never read. Published FP8 (``quant_method`` "fp8", 128 x 128 block scales)
is dequantized at load, experts requantized to int4 (:mod:`moeflow.quant.fp8`). Refused by name: other scoring
functions, ``qk_norm_type`` other than "per_layer", shared experts (``shared_intermediate_size``), lightning
attention layers (``attn_type_list``, MiniMax-01's), sliding windows, expert groups or a routed scaling factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, ExpertLayout
from moeflow.families.layers import LinearFactory
from moeflow.families.mixtral import DecoderLayer, MixtralConfig, MixtralFamily
from moeflow.moe.routing import RouterSpec

BIAS = ".block_sparse_moe.e_score_correction_bias"  # the checkpoint's name (moeflow keeps it on the router)


@dataclass
class MiniMaxM2Config(MixtralConfig):
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e6
    rotary_dim: int = 0  # filled in by from_dict (0: the whole head)
    use_qk_norm: bool = True
    use_routing_bias: bool = True
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> MiniMaxM2Config:
        refuse_unsupported(d, source)
        cfg = super().from_dict(d, source)
        assert isinstance(cfg, MiniMaxM2Config)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        factor = next((f for f in (rope.get("partial_rotary_factor"), d.get("partial_rotary_factor")) if f is not None),
                      None)  # rope_parameters' first, as transformers 5.x reads it
        given = d.get("rotary_dim")
        cfg.rotary_dim = int(cfg.head_dim * float(factor)) if factor is not None else int(given or cfg.head_dim)
        if given is not None and int(given) != cfg.rotary_dim:
            raise CheckpointError(f"{source}: rotary_dim={given} disagrees with partial_rotary_factor={factor} x "
                                  f"head_dim={cfg.head_dim}")
        if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
            raise CheckpointError(f"{source}: rotary_dim={cfg.rotary_dim} must be even and in [2, head_dim="
                                  f"{cfg.head_dim}]")
        if cfg.hidden_act != "silu":
            raise CheckpointError(f"{source}: hidden_act={cfg.hidden_act!r} is not supported (silu)")
        return cfg


def refuse_unsupported(d: dict[str, Any], source: str) -> None:
    """CheckpointError naming the first config.json field asking for what MiniMax-M2's releases do not use."""
    checks = (
        ("scoring_func", lambda v: v in (None, "sigmoid"), "only sigmoid router scores"),
        ("qk_norm_type", lambda v: v in (None, "per_layer"), "only 'per_layer' (one norm over the projection)"),
        ("shared_intermediate_size", lambda v: not v, "shared experts"),
        ("attn_type_list", lambda v: all(kind == 1 for kind in v or ()), "lightning attention layers (type 0)"),
        ("sliding_window", lambda v: v is None, "sliding-window attention"),
        ("attn_window_size", lambda v: v is None or (not isinstance(v, list) and v <= 0), "sliding-window attention"),
        ("use_grouped_topk", lambda v: not v, "expert groups"),
        ("n_group", lambda v: v in (None, 1), "expert groups"),
        ("num_expert_group", lambda v: v in (None, 1), "expert groups"),
        ("routed_scaling_factor", lambda v: v in (None, 1, 1.0), "a routed scaling factor"),
    )
    for key, ok, what in checks:
        if not ok(d.get(key)):
            raise CheckpointError(f"{source}: {key}={d[key]!r} is not supported for minimax_m2 ({what}; the released "
                                  f"MiniMax-M2 checkpoints use none)")


class MiniMaxM2Family(MixtralFamily):
    name = "minimax_m2"
    model_types = ("minimax_m2",)
    config: MiniMaxM2Config

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MiniMaxM2Config:
        return MiniMaxM2Config.from_dict(raw, source)

    def router_spec(self) -> RouterSpec:
        return RouterSpec(top_k=self.config.num_experts_per_tok, scoring="sigmoid", renormalize=True,
                          selection_bias=self.config.use_routing_bias)

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg, router = self.config, self.router_spec()
        layers = [DecoderLayer(cfg, i, dtype, linear_factory, router, rotary_dim=cfg.rotary_dim,
                               qk_norm="projection" if cfg.use_qk_norm else None, norm_eps=cfg.rms_norm_eps)
                  for i in range(cfg.num_hidden_layers)]
        return CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.rotary_dim,
                             cfg.rope_theta, dtype)

    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        return super().checkpoint_name(param_path.replace(".block_sparse_moe.gate.e_score_correction_bias", BIAS),
                                       layout)

    def quantized_name(self, name: str) -> str:
        return super().quantized_name(name.replace(".mlp.e_score_correction_bias", BIAS))
