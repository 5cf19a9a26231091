"""gpt-oss (openai/gpt-oss-20b, -120b): sink attention, alternating sliding/full layers, biased experts.

Every decoder layer is sink attention (:mod:`moeflow.families.gpt_oss_layers`; sliding window or full by
``layer_types``) + an MoE block whose router has a bias and picks the top-k logits before a softmax over
those k. Experts carry biases on both projections and the clamped SwiGLU. Expert tensor layouts understood:

* bf16/fp32 as transformers' ``save_pretrained`` writes them: ``model.layers.L.mlp.experts.gate_up_proj``
  ``[E, H, 2I]`` (``y = x @ W``; even columns gate, odd columns up), ``gate_up_proj_bias`` ``[E, 2I]``,
  ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``;
* MXFP4 as published (``quant_method == "mxfp4"``): ``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``,
  ``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]`` (rows interleaved gate/up), ``down_proj_blocks``
  ``[E, H, I/32, 16]``, ``down_proj_scales`` ``[E, H, I/32]``, the biases as above;
* AWQ (``moeflow quantize``): ``mlp.experts.E.{gate_proj,up_proj,down_proj}.{qweight,qzeros,scales}``, the
  fused biases kept;
* per expert, gate and up apart (``mlp.experts.E.{gate_proj,up_proj,down_proj}.{weight,bias}``): how the GGUF
  reader (:mod:`moeflow.io.gguf.reader`) answers llama.cpp's stacked ``ffn_{gate,up,down}_exps``.

Gate and up are de-interleaved when read (gate rows/columns first, then up: the expert format's w13 order).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, ExpertLayout, ExpertSpec, Family
from moeflow.families.gated_experts import concat
from moeflow.families.gpt_oss_layers import GptOssRMSNorm, ScaledRotaryEmbedding, SinkAttention, yarn_inv_freq
from moeflow.families.layers import LinearFactory
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec, get_slice
from moeflow.moe.block import MoEBlock
from moeflow.moe.routing import RouterSpec

LAYER_TYPES = ("sliding_attention", "full_attention")
FUSED_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    head_dim: int = 64
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope: dict[str, Any] = field(default_factory=dict)
    sliding_window: int = 128
    layer_types: list[str] | None = None
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    source: str = "config.json"

    def __post_init__(self) -> None:
        src = self.source
        if self.layer_types is None:  # transformers' default: sliding, full, sliding, ...
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(f"{src}: layer_types has {len(self.layer_types)} entries but num_hidden_layers "
                                  f"is {self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise CheckpointError(f"{src}: layer_types holds {bad}; gpt-oss layers are one of {LAYER_TYPES}")
        if not self.attention_bias:
            raise CheckpointError(f"{src}: attention_bias=false is not a gpt-oss checkpoint moeflow reads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"{src}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_key_value_heads}")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise CheckpointError(f"{src}: num_experts_per_tok={self.num_experts_per_tok} must lie in "
                                  f"[1, num_local_experts={self.num_local_experts}]")
        rope_type = self.rope.get("rope_type", self.rope.get("type", "default"))
        if rope_type not in ("yarn", "default"):
            raise CheckpointError(f"{src}: rope_scaling.rope_type {rope_type!r} is not supported for gpt-oss "
                                  "(yarn or default)")

    @property
    def layer_windows(self) -> list[int | None]:
        """The sliding window of each decoder layer (None: full attention)."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> GptOssConfig:
        d = dict(d)
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        d["rope"] = rope
        d.setdefault("num_experts_per_tok", d.get("experts_per_token"))  # the published config's name
        d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        required = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_local_experts", "num_experts_per_tok")
                    if d.get(n) is None]
        if required:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(required)}")
        for name in ("rope_theta", "sliding_window", "head_dim"):
            if d.get(name) is None:
                d.pop(name, None)
        names = {f.name for f in fields(cls)} - {"source"}
        return cls(**{k: v for k, v in d.items() if k in names}, source=source)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_idx: int, dtype: torch.dtype, linear_factory: LinearFactory,
                 router: RouterSpec):
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = SinkAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, layer_idx, linear_factory, dtype, cfg.layer_windows[layer_idx])
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MoEBlock(cfg.hidden_size, cfg.num_local_experts, router, layer_idx, dtype)

    def forward(self, x, cos, sin, cache, cache_position, mask, experts, routing=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, cache_position, mask)
        return x + self.mlp(self.post_attention_layernorm(x), experts, routing)


class GptOssFamily(Family):
    name = "gpt_oss"
    model_types = ("gpt_oss",)
    config: GptOssConfig

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GptOssConfig:
        return GptOssConfig.from_dict(raw, source)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.config.num_hidden_layers))

    @property
    def num_experts(self) -> int:
        return self.config.num_local_experts

    def router_spec(self) -> RouterSpec:
        return RouterSpec(top_k=self.config.num_experts_per_tok, scoring="softmax", renormalize=False,
                          topk_before_scoring=True, router_bias=True)

    def expert_spec(self) -> ExpertSpec:
        cfg = self.config
        return ExpertSpec(cfg.hidden_size, cfg.intermediate_size, activation="clamped_swiglu", bias=True,
                          swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg, router = self.config, self.router_spec()
        layers = [DecoderLayer(cfg, i, dtype, linear_factory, router) for i in range(cfg.num_hidden_layers)]
        decoder = CausalDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.head_dim,
                                cfg.rope_theta, dtype, layer_windows=cfg.layer_windows)
        decoder.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        rope_type = cfg.rope.get("rope_type", cfg.rope.get("type", "default"))
        if rope_type == "yarn":
            inv_freq, factor = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope, cfg.max_position_embeddings,
                                             cfg.source)
            decoder.rotary = ScaledRotaryEmbedding(inv_freq, factor)
        return decoder

    # ------------------------------------------------------------------ checkpoint names
    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        if param_path.startswith("lm_head."):
            return param_path
        return "model." + param_path.replace(".mlp.gate.", ".mlp.router.")

    def detect_expert_layout(self, reader: CheckpointReader) -> ExpertLayout:
        base = "model.layers.0.mlp.experts"
        if f"{base}.gate_up_proj" in reader:
            return ExpertLayout("mlp", fused=True, awq=False)
        if f"{base}.gate_up_proj_blocks" in reader:
            return ExpertLayout("mlp", fused=True, awq=False, mxfp4=True)
        if f"{base}.0.gate_proj.weight" in reader:  # one matrix per expert and projection: a GGUF file's reader
            return ExpertLayout("mlp", fused=False, awq=False)
        if f"{base}.0.gate_proj.qweight" in reader:
            scales = reader.get(f"{base}.0.gate_proj.scales")
            return ExpertLayout("mlp", fused=False, awq=True, scales_dtype=scales.dtype)
        raise CheckpointError(
            f"no expert tensors for layer 0 in {reader.directory}: expected '{base}.gate_up_proj' (bf16), "
            f"'{base}.gate_up_proj_blocks' (MXFP4) or '{base}.0.gate_proj.qweight' (AWQ)"
        )

    def read_expert(self, reader: CheckpointReader, layout: ExpertLayout, quant: QuantizationSpec | None,
                    moe_layer: int, expert: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        H, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts  # noqa: E741
        base = f"model.layers.{moe_layer}.mlp.experts"
        if not layout.fused and not layout.awq:  # per expert, gate and up apart (GGUF: moeflow.io.gguf.reader)
            g, u, d = (f"{base}.{expert}.{p}_proj" for p in ("gate", "up", "down"))
            return {"w13": concat([reader.get(f"{g}.weight", (I, H)), reader.get(f"{u}.weight", (I, H))], dim=0),
                    "w2": reader.get(f"{d}.weight", (H, I)),
                    "w13_bias": concat([reader.get(f"{g}.bias", (I,)), reader.get(f"{u}.bias", (I,))], dim=0),
                    "w2_bias": reader.get(f"{d}.bias", (H,))}
        out = {"w13_bias": deinterleave(get_slice(reader, f"{base}.gate_up_proj_bias", expert, (E, 2 * I))),
               "w2_bias": get_slice(reader, f"{base}.down_proj_bias", expert, (E, H))}
        if layout.mxfp4:
            if H % 32 or I % 32:
                raise CheckpointError(f"MXFP4 experts need hidden_size ({H}) and intermediate_size ({I}) "
                                      "divisible by 32")
            for part, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
                blocks = get_slice(reader, f"{base}.{part}_blocks", expert, (E, rows, k // 32, 16))
                scales = get_slice(reader, f"{base}.{part}_scales", expert, (E, rows, k // 32))
                if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
                    raise CheckpointError(f"{base}.{part}_blocks/_scales must be uint8 (MXFP4), got "
                                          f"{blocks.dtype} and {scales.dtype}")
                name = "w13" if part == "gate_up_proj" else "w2"
                interleaved = part == "gate_up_proj"
                out[f"{name}_blocks"] = deinterleave(blocks) if interleaved else blocks
                out[f"{name}_scales"] = deinterleave(scales) if interleaved else scales
            return out
        if layout.awq:
            g = quant.group_size
            parts: dict[str, torch.Tensor] = {}
            for part, (fan_in, fan_out) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
                for kind, shape in (("qweight", (fan_in, fan_out // 8)), ("qzeros", (fan_in // g, fan_out // 8)),
                                    ("scales", (fan_in // g, fan_out))):
                    parts[f"{part}.{kind}"] = reader.get(f"{base}.{expert}.{part}.{kind}", shape)
            for kind in ("qweight", "qzeros", "scales"):
                out[f"w13_{kind}"] = concat([parts[f"gate_proj.{kind}"], parts[f"up_proj.{kind}"]], dim=1)
                out[f"w2_{kind}"] = parts[f"down_proj.{kind}"]
            return out
        gate_up = get_slice(reader, f"{base}.gate_up_proj", expert, (E, H, 2 * I))
        out["w13"] = deinterleave(gate_up.T)
        out["w2"] = get_slice(reader, f"{base}.down_proj", expert, (E, I, H)).T
        return out

    # ------------------------------------------------------------------ quantization (moeflow quantize)
    def expert_linears(self, name: str, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]] | None:
        m = FUSED_EXPERT.match(name)
        if m is None:
            return None
        return self._split_fused(reader.get(name), *m.groups())

    @staticmethod
    def _split_fused(stacked: torch.Tensor, layer: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert ``[out, in]`` weights: gate_up_proj [E, H, 2I] -> gate_proj, up_proj; down_proj [E, I, H]."""
        for e in range(stacked.shape[0]):
            base = f"{layer}.mlp.experts.{e}"
            if kind == "gate_up_proj":
                w = stacked[e].T  # [2I, H], rows interleaved
                yield f"{base}.gate_proj", w[0::2]
                yield f"{base}.up_proj", w[1::2]
            else:
                yield f"{base}.down_proj", stacked[e].T


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 0) interleaved gate/up (even gate, odd up) -> gate rows first, then up rows."""
    return torch.cat([t[0::2], t[1::2]], dim=0).contiguous()
