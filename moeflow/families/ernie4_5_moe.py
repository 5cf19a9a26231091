"""ERNIE-4.5 MoE (``ernie4_5_moe``): Baidu's ERNIE-4.5-21B-A3B and ERNIE-4.5-300B-A47B (text), base and PT.

Grouped-query attention whose rotary turns interleaved pairs ``(2i, 2i + 1)`` (computed in fp32), dense MLP
layers before ``moe_layer_start_index``, then MoE layers: a softmax router whose top-k is chosen on the
probabilities plus a learnt per-expert bias (``mlp.moe_statics.e_score_correction_bias``, ``[1, E]``) and
weighted by the probabilities alone, renormalised; ``moe_num_shared_experts`` shared experts fused into one
ungated MLP added to every token (:mod:`.deepseek_moe`'s MoE side). config.json names: ``moe_num_experts``,
``moe_k``, ``moe_num_shared_experts``, ``moe_layer_start_index`` / ``_end_index`` / ``_interval``.
What the released text checkpoints do not use is refused by name: MoE layers with gaps (``moe_layer_interval``
> 1, an end before the last layer), per-layer lists of expert counts (the VL models), ``use_bias``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, ExpertLayout
from moeflow.families.deepseek_moe import MoEDecoderLayer, SharedExpertMoEFamily
from moeflow.families.glm4_moe import Glm4MoeConfig, PartialRotaryAttention
from moeflow.families.layers import LinearFactory, attend_in_place, project_qkv
from moeflow.moe.block import MoEBlock
from moeflow.moe.routing import RouterSpec

RENAMES = {"moe_num_experts": "n_routed_experts", "moe_k": "num_experts_per_tok",
           "moe_num_shared_experts": "n_shared_experts", "moe_layer_start_index": "first_k_dense_replace"}


@dataclass
class Ernie45MoeConfig(Glm4MoeConfig):
    """GLM-4.5's config fields (its attention module and checks) with ERNIE's defaults; read from ERNIE's names."""

    n_shared_experts: int = 0
    first_k_dense_replace: int = 1
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = True
    model_type: ClassVar[str] = "ernie4_5_moe"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> Ernie45MoeConfig:
        d = dict(d)
        for name in ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_layer_start_index",
                     "moe_layer_end_index", "moe_num_shared_experts"):
            if isinstance(d.get(name), list):
                raise CheckpointError(f"{source}: {name}={d[name]!r} is a per-modality list (ERNIE-4.5-VL); moeflow "
                                      f"runs the text models, whose config.json gives one number")
        for old, new in RENAMES.items():
            if d.get(new) is None and d.get(old) is not None:
                d[new] = d[old]
        if d.get("use_bias"):
            raise CheckpointError(f"{source}: use_bias=true (biased projections and MLPs) is not supported for "
                                  f"ernie4_5_moe; the released checkpoints have none")
        layers = int(d.get("num_hidden_layers") or 0)
        interval, end = int(d.get("moe_layer_interval") or 1), d.get("moe_layer_end_index")
        if interval != 1 or (end is not None and 0 <= int(end) < layers - 1):
            raise CheckpointError(f"{source}: MoE layers every {interval} from moe_layer_start_index to "
                                  f"moe_layer_end_index={end} leave dense layers between them; moeflow supports MoE "
                                  f"layers from moe_layer_start_index to the last layer (as the released checkpoints)")
        start = d.get("first_k_dense_replace")
        if start is not None and not 0 <= int(start) < layers:
            raise CheckpointError(f"{source}: moe_layer_start_index={start} leaves no MoE layer")
        # ERNIE's attention: whole-head rotary (on interleaved pairs), no QK-norm, no biases (use_bias refused)
        d.update(partial_rotary_factor=1.0, use_qk_norm=False, attention_bias=False, o_bias=False)
        cfg = super().from_dict(d, source)
        if not 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise CheckpointError(f"{source}: moe_k={cfg.num_experts_per_tok} must lie in [1, moe_num_experts="
                                  f"{cfg.n_routed_experts}]")
        return cfg  # type: ignore[return-value]


class InterleavedRotaryAttention(PartialRotaryAttention):
    """GQA with ERNIE's rotary: the pair ``(2i, 2i + 1)`` turned by frequency ``i``, in fp32."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                cache_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; cos/sin [B, T, head_dim] (frequencies twice over, the decoder's); mask bool [B, 1, T, L]."""
        b, t, _ = x.shape
        q, k, v = project_qkv(self, x)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        out = attend_in_place(cache, self.layer_idx, q, k, v, cache_position, None)
        if out is None:
            k_all, v_all = cache.update(self.layer_idx, k, v, cache_position)
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                                 enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on interleaved pairs, in fp32: x [B, heads, T, D]; cos/sin [B, T, D] as ``cat(freqs, freqs)``."""
    half = cos.shape[-1] // 2
    c = cos[..., :half].float().repeat_interleave(2, dim=-1)[:, None]
    s = sin[..., :half].float().repeat_interleave(2, dim=-1)[:, None]
    xf = x.float()
    turned = torch.stack((-xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)
    return (xf * c + turned * s).to(x.dtype)


class Ernie45MoeFamily(SharedExpertMoEFamily):
    name = "ernie4_5_moe"
    model_types = ("ernie4_5_moe",)
    config: Ernie45MoeConfig

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Ernie45MoeConfig:
        return Ernie45MoeConfig.from_dict(raw, source)

    def router_spec(self) -> RouterSpec:
        return RouterSpec(top_k=self.config.num_experts_per_tok, scoring="softmax", renormalize=True,
                          selection_bias=True)

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg = self.config
        layers = [MoEDecoderLayer(InterleavedRotaryAttention(cfg, i, linear_factory, dtype), self.build_mlp(i, dtype),
                                  cfg.hidden_size, cfg.rms_norm_eps, dtype) for i in range(cfg.num_hidden_layers)]
        for layer in layers:
            if isinstance(layer.mlp, MoEBlock):  # the checkpoint's bias is [1, E]: it broadcasts over the tokens
                layer.mlp.gate.e_score_correction_bias = torch.zeros(1, cfg.n_routed_experts, dtype=torch.float32)
        return CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.head_dim, cfg.rope_theta,
                             dtype)

    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        return super().checkpoint_name(param_path.replace(".mlp.gate.e_score_correction_bias",
                                                          ".mlp.moe_statics.e_score_correction_bias"), layout)
