"""The MoE side that DeepSeek-V2 / V3, Kimi-K2 and GLM-4.5 share (families/deepseek.py, families/glm4_moe.py).

* The first ``first_k_dense_replace`` decoder layers hold a dense gated MLP (``mlp.{gate,up,down}_proj``);
  every later layer an MoE block: routed experts, a router ``mlp.gate`` (with ``e_score_correction_bias``
  when the scores are sigmoids), and ``n_shared_experts`` shared experts fused into one gated MLP
  ``mlp.shared_experts`` of ``n_shared_experts x moe_intermediate_size`` added unweighted to every token.
  The shared experts are ordinary resident modules; only routed experts go through the expert backend,
  whose layer index is the MoE index (decoder layer - ``first_k_dense_replace``).
* Routed experts as published: ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` (``.qweight``,
  ``.qzeros``, ``.scales`` for AWQ); as transformers 5.x holds them in memory: ``mlp.experts.gate_up_proj``
  ``[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj`` ``[E, H, I]``.
* Layers past ``num_hidden_layers`` are the multi-token-prediction layers (``num_nextn_predict_layers``,
  :mod:`moeflow.families.mtp`): read only when the engine is asked to (``from_pretrained(mtp=True)``); their
  routed experts are MoE layers ``len(moe_layers) + j`` of the expert backend.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.base import ExpertLayout, ExpertSpec, Family
from moeflow.families.gated_experts import ProjectionNames, concat, split_fused_experts
from moeflow.families.layers import LinearFactory, RMSNorm
from moeflow.families.mtp import MTPLayer, MultiTokenPredictor, mtp_checkpoint_name
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec, get_slice
from moeflow.moe.block import MoEBlock
from moeflow.moe.routing import RouterSpec

PER_EXPERT = re.compile(r"^(model\.layers\.(\d+))\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
FUSED = re.compile(r"^(model\.layers\.(\d+))\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass
class SharedExpertMoEConfig:
    """The config.json fields both families require (each family's config adds its attention's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense first layers' MLP
    moe_intermediate_size: int  # one routed (and one shared) expert
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int

    @classmethod
    def known_entries(cls, d: dict[str, Any], source: str, required: tuple[str, ...] = (),
                      derived: tuple[str, ...] = ()) -> dict[str, Any]:
        """config.json's entries that are fields of ``cls`` (nulls dropped, ``derived`` fields left to
        ``__post_init__``); CheckpointError naming every missing required field."""
        d = dict(d)
        if d.get("n_routed_experts") is None:  # transformers' attribute names
            d["n_routed_experts"] = d.get("num_local_experts", d.get("num_experts"))
        base = tuple(f.name for f in fields(SharedExpertMoEConfig))
        missing = [n for n in (*base, *required) if d.get(n) is None]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
        names = {f.name for f in fields(cls)} - set(derived)
        return {k: v for k, v in d.items() if k in names and v is not None}


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the dense layers' MLP and the (fused) shared experts. x [..., H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEDecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` where ``mlp`` is a
    :class:`GatedMLP` (dense layer) or an :class:`MoEBlock` with its shared experts."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.mlp = mlp

    def forward(self, x, cos, sin, cache, cache_position, mask, experts, routing=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, cache_position, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, experts, routing) if isinstance(self.mlp, MoEBlock) else self.mlp(h))


def sigmoid_router_spec(cfg: Any, source: str) -> RouterSpec:
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 routing from config.json (``n_group`` must divide the experts)."""
    check_groups(cfg, source)
    return RouterSpec(top_k=cfg.num_experts_per_tok, scoring="sigmoid", renormalize=bool(cfg.norm_topk_prob),
                      selection_bias=True, n_groups=cfg.n_group, topk_groups=cfg.topk_group,
                      scaling_factor=float(cfg.routed_scaling_factor), group_score="top2_sum")


def check_groups(cfg: Any, source: str) -> None:
    """CheckpointError naming the field when the expert groups cannot hold ``num_experts_per_tok`` experts."""
    e, g, tg, k = cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    if g < 1 or e % g:
        raise CheckpointError(f"{source}: n_group={g} does not divide n_routed_experts={e}")
    if not 1 <= tg <= g:
        raise CheckpointError(f"{source}: topk_group={tg} must lie in [1, n_group={g}]")
    if not 1 <= k <= tg * (e // g):
        raise CheckpointError(f"{source}: num_experts_per_tok={k} must lie in [1, topk_group x experts per group = "
                              f"{tg * (e // g)}]")


class SharedExpertMoEFamily(Family):
    """Family methods for the MoE side described above; subclasses build the attention and the config.

    The config needs: hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers, n_routed_experts,
    n_shared_experts, first_k_dense_replace, rms_norm_eps."""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.config.first_k_dense_replace, self.config.num_hidden_layers))

    @property
    def num_experts(self) -> int:
        return self.config.n_routed_experts

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(self.config.hidden_size, self.config.moe_intermediate_size, activation="silu")

    def build_mlp(self, layer: int, dtype: torch.dtype) -> nn.Module:
        """Decoder layer ``layer``'s MLP: dense, or an MoE block (MoE index = layer - first_k_dense_replace)."""
        cfg = self.config
        if layer < cfg.first_k_dense_replace:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        shared = None
        if cfg.n_shared_experts:
            shared = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
        return MoEBlock(cfg.hidden_size, cfg.n_routed_experts, self.router_spec(), layer - cfg.first_k_dense_replace,
                        dtype, shared_expert=shared)

    # ------------------------------------------------------------------ multi-token prediction
    mtp_config_field = "num_nextn_predict_layers"

    def num_mtp_layers(self) -> int:
        return int(getattr(self.config, "num_nextn_predict_layers", 0) or 0)

    def mtp_attention(self, cache_layer: int, dtype: torch.dtype, linear_factory: LinearFactory) -> nn.Module:
        """An MTP layer's attention, reading layer ``cache_layer`` of the MTP layers' own cache."""
        raise NotImplementedError(f"{self.name}: moeflow does not read this family's multi-token-prediction layers")

    def build_mtp(self, dtype: torch.dtype, linear_factory: LinearFactory) -> MultiTokenPredictor:
        """Each MTP layer's block is a decoder layer of the family (MoE block: MoE index ``len(moe_layers) + j``)."""
        cfg = self.config
        h, eps, n = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_hidden_layers
        layers = [MTPLayer(MoEDecoderLayer(self.mtp_attention(j, dtype, linear_factory), self.build_mlp(n + j, dtype),
                                           h, eps, dtype), h, eps, dtype) for j in range(self.num_mtp_layers())]
        return MultiTokenPredictor(layers, n, self.mtp_config_field)

    def mtp_checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        return mtp_checkpoint_name(param_path, self.config.num_hidden_layers,
                                   lambda path: self.checkpoint_name(path, layout))

    # ------------------------------------------------------------------ checkpoint names
    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        if param_path.startswith("lm_head."):
            return param_path
        return "model." + param_path.replace(".mlp.shared_expert.", ".mlp.shared_experts.")

    def detect_expert_layout(self, reader: CheckpointReader) -> ExpertLayout:
        base = f"model.layers.{self.moe_layers[0]}.mlp.experts"
        if f"{base}.gate_up_proj" in reader:
            return ExpertLayout("mlp", fused=True, awq=False)
        if f"{base}.0.gate_proj.qweight" in reader:
            scales = reader.get(f"{base}.0.gate_proj.scales")
            return ExpertLayout("mlp", fused=False, awq=True, scales_dtype=scales.dtype)
        if f"{base}.0.gate_proj.weight" in reader:
            return ExpertLayout("mlp", fused=False, awq=False)
        layers = {int(m.group(1)) for n in reader.names() if (m := LAYER.match(n))}
        if layers and min(layers) >= self.config.num_hidden_layers:
            raise CheckpointError(
                f"{reader.directory} holds only multi-token-prediction layer tensors (model.layers.{min(layers)}.*, "
                f"past num_hidden_layers={self.config.num_hidden_layers}, read only with mtp=True): the decoder "
                "layers' shards are missing")
        raise CheckpointError(f"no expert tensors for the first MoE layer in {reader.directory}: expected "
                              f"'{base}.0.gate_proj.weight' (or .qweight for AWQ) or '{base}.gate_up_proj'")

    def expert_base(self, moe_layer: int) -> str:
        """MoE layers past the decoder's are the MTP layers' (checkpoint layers ``num_hidden_layers + j``)."""
        n = len(self.moe_layers)
        layer = self.moe_layers[moe_layer] if moe_layer < n else self.config.num_hidden_layers + moe_layer - n
        return f"model.layers.{layer}.mlp.experts"

    def read_expert(self, reader: CheckpointReader, layout: ExpertLayout, quant: QuantizationSpec | None,
                    moe_layer: int, expert: int) -> dict[str, torch.Tensor]:
        H, I, E = self.config.hidden_size, self.config.moe_intermediate_size, self.num_experts  # noqa: E741
        base = self.expert_base(moe_layer)
        if layout.fused:
            return {"w13": get_slice(reader, f"{base}.gate_up_proj", expert, (E, 2 * I, H)),
                    "w2": get_slice(reader, f"{base}.down_proj", expert, (E, H, I))}
        name = f"{base}.{expert}"
        if not layout.awq:
            w1 = self.read_linear(reader, f"{name}.gate_proj", (I, H))
            w3 = self.read_linear(reader, f"{name}.up_proj", (I, H))
            return {"w13": concat([w1, w3], dim=0), "w2": self.read_linear(reader, f"{name}.down_proj", (H, I))}
        g = quant.group_size
        parts = {}
        for part, (fan_in, fan_out) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
            for kind, shape in (("qweight", (fan_in, fan_out // 8)), ("qzeros", (fan_in // g, fan_out // 8)),
                                ("scales", (fan_in // g, fan_out))):
                parts[f"{part}.{kind}"] = reader.get(f"{name}.{part}.{kind}", shape)
        out = {f"w13_{kind}": concat([parts[f"gate_proj.{kind}"], parts[f"up_proj.{kind}"]], dim=1)
               for kind in ("qweight", "qzeros", "scales")}
        out.update({f"w2_{kind}": parts[f"down_proj.{kind}"] for kind in ("qweight", "qzeros", "scales")})
        return out

    def read_linear(self, reader: CheckpointReader, module: str, shape: tuple[int, int]) -> torch.Tensor:
        """A dense linear weight ``[out, in]`` (the FP8 family reads and dequantizes block-scaled ones here)."""
        return reader.get(f"{module}.weight", shape)

    # ------------------------------------------------------------------ quantization (moeflow quantize)
    def expert_linears(self, name: str, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]] | None:
        last = self.config.num_hidden_layers + self.num_mtp_layers()  # (the MTP layers' experts too)
        m = PER_EXPERT.match(name)
        if m and int(m.group(2)) < last:
            return iter([(name.removesuffix(".weight"), self.read_linear(reader, name.removesuffix(".weight"),
                                                                         None))])
        m = FUSED.match(name)
        if m and int(m.group(2)) < last:
            return split_fused_experts(reader.get(name), m.group(1), m.group(3), "mlp", ProjectionNames())
        return None
