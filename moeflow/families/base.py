"""What a model family is to moeflow: :class:`Family` (config, weight names, decoder, router, experts).

Adding a family is adding one module under ``moeflow/families/`` with a :class:`Family` subclass (and,
when its router is new, a routing function in :mod:`moeflow.moe.routing`) and listing it in
``moeflow.families.FAMILIES``. The engine only talks to this interface:

* ``parse_config(raw)``: config.json (as published and as transformers 5.x writes it) -> the family's config;
* ``router_spec()`` / ``expert_spec()``: how tokens are routed, what one expert computes;
* ``moe_layers``: the decoder layers that hold an MoE block (dense-MLP layers may sit between them);
* ``build_decoder(dtype, linear_factory)``: the :class:`CausalDecoder` (its MoE blocks hold routers only);
* ``checkpoint_name(path, layout)``: the weight-name map for non-expert parameters;
* ``detect_expert_layout(reader)`` / ``read_expert(reader, layout, quant, moe_layer, expert)``: one expert's
  tensors, whether stored per expert or fused, in the names of the kernels' :class:`ExpertFormat`;
* ``expert_linears(name, tensor)`` / ``quantized_name(name)``: what ``moeflow quantize`` converts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from moeflow.families.layers import LinearFactory, RMSNorm, RotaryEmbedding
from moeflow.families.mtp import MultiTokenPredictor
from moeflow.io.checkpoint import CheckpointReader, QuantizationSpec
from moeflow.moe.backend import ExpertBackend
from moeflow.moe.block import MoEBlock, RoutingRecorder
from moeflow.moe.routing import RouterSpec

__all__ = ["Family", "ExpertSpec", "ExpertLayout", "RouterSpec", "CausalDecoder", "ModelConfig", "KVCacheSpec",
           "LinearStateSpec"]


@dataclass(frozen=True)
class ExpertSpec:
    """One routed expert: a gated MLP ``down(act(gate(x)) * up(x))`` of these sizes."""

    hidden_size: int
    intermediate_size: int
    activation: str = "silu"  # the gate's activation ("silu"; gpt-oss's clamped SwiGLU would be a new name)
    bias: bool = False  # the expert projections carry biases (gpt-oss)
    swiglu_alpha: float = 1.702  # "clamped_swiglu" only: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)
    swiglu_limit: float = 7.0  # "clamped_swiglu" only: g = clamp(gate, max=limit)


@dataclass(frozen=True)
class ExpertLayout:
    """How a checkpoint stores its experts (found by :meth:`Family.detect_expert_layout`)."""

    prefix: str  # the module name of the MoE block in the checkpoint ("block_sparse_moe", "mlp", ...)
    fused: bool  # all experts of a layer stacked in one tensor per projection
    awq: bool  # AWQ 4-bit (qweight / qzeros / scales)
    scales_dtype: torch.dtype | None = None
    mxfp4: bool = False  # MXFP4 (``*_blocks`` / ``*_scales``, gpt-oss as published)


@dataclass(frozen=True)
class LinearStateSpec:
    """What the linear-attention layers keep per sequence (``KVCacheSpec.linear``)."""

    num_layers: int
    conv_dim: int
    conv_kernel: int
    v_heads: int
    k_dim: int
    v_dim: int

    def bytes_per_sequence(self, element_size: int) -> int:
        """State bytes one sequence costs over all linear layers (conv in the model dtype, recurrent in fp32)."""
        conv = (self.conv_kernel - 1) * self.conv_dim * element_size
        return self.num_layers * (conv + self.v_heads * self.k_dim * self.v_dim * 4)


@dataclass(frozen=True)
class KVCacheSpec:
    """What the engine's KV cache keeps per layer and token (:meth:`Family.kv_cache_spec`).

    Full key/value heads (``kv_heads`` x ``head_dim`` each: the engine's ``StaticKVCache``), or, when
    ``latent_dim`` is set, one compressed vector of that many values (multi-head latent attention, whose
    layers read it with ``cache.update_latent``). ``linear``: the model also has linear-attention layers, whose
    fixed-size per-sequence state the cache keeps beside ``num_layers`` full-attention layers (Qwen3-Next)."""

    num_layers: int
    kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    linear: LinearStateSpec | None = None

    def bytes_per_token(self, element_size: int) -> int:
        """Cache bytes one token costs over all layers."""
        per_layer = self.latent_dim if self.latent_dim else 2 * self.kv_heads * self.head_dim
        return self.num_layers * per_layer * element_size

    def bytes_per_sequence(self, element_size: int) -> int:
        """Cache bytes one sequence costs whatever its length (the linear layers' states)."""
        return self.linear.bytes_per_sequence(element_size) if self.linear is not None else 0


class ModelConfig:
    """Fields every family's config has (the engine reads only these; families add their own).

    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    max_position_embeddings, tie_word_embeddings, bos_token_id, eos_token_id, pad_token_id.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: int | list[int] | None
    pad_token_id: int | None


class LayersStep(Protocol):
    """Every decoder layer of a pass in one call: the layers' arguments (``masks``: each layer's) -> x [B, T, H] after
    the last layer, or None when it cannot take this pass. ``enabled`` switches it off for A/B comparisons."""

    enabled: bool

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                 cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
                 routing: RoutingRecorder | None) -> torch.Tensor | None: ...

    def logits(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
               cache_position: torch.Tensor, masks: list[torch.Tensor], experts: ExpertBackend,
               routing: RoutingRecorder | None, norm: nn.Module, lm_head: nn.Module) -> torch.Tensor | None:
        """The pass's logits fp32 [B, T, V] = ``lm_head(norm(x after the last layer))`` in the same call, or None
        when it cannot take the pass or this head (then it has run nothing)."""


class CausalDecoder(nn.Module):
    """Embeddings -> decoder layers -> final norm -> LM head; the families' layers plug in.

    Each layer is called ``layer(x, cos, sin, cache, cache_position, mask, experts, routing)``. Expert
    weights are not parameters here: the engine passes the :class:`ExpertBackend` into every call.
    """

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], rms_norm_eps: float,
                 head_dim: int, rope_theta: float, dtype: torch.dtype, sliding_window: int | None = None,
                 layer_windows: list[int | None] | None = None):
        """``sliding_window``: one window for every layer; ``layer_windows``: one per layer instead (Qwen2-MoE
        alternates sliding and full attention layers)."""
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype)
        self.sliding_window = sliding_window
        if layer_windows is not None and len(layer_windows) != len(layers):
            raise ValueError(f"layer_windows has {len(layer_windows)} entries for {len(layers)} layers")
        self.layer_windows = layer_windows
        self.layers_step: LayersStep | None = None  # set_layers_step

    def set_layers_step(self, step: LayersStep | None) -> None:
        """Run every layer of a pass through ``step`` where it takes the pass (the CPU engine's one native call for
        one-token steps, engine.cpu_layers); None: the layers one by one."""
        self.layers_step = step

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks in layer order (block i has ``layer_idx`` i)."""
        return [m for m in self.modules() if isinstance(m, MoEBlock)]

    def forward(
        self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any, cache_position: torch.Tensor,
        token_mask: torch.Tensor, experts: ExpertBackend, routing: RoutingRecorder | None = None,
        last_only: bool = False, return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """embeds [B, T, H] (``embed_tokens``'s output), position_ids [B, T], cache_position [T], token_mask
        bool [B, T] -> logits fp32 [B, T, V] (``last_only``: [B, 1, V], the last position's: what generation
        reads after a prefill, without T - 1 lm_head rows it would drop). ``return_hidden``: (logits, the final
        norm's output [B, T, H] (every position), what multi-token-prediction layers read)."""
        x = embeds
        cos, sin = self.rotary(position_ids, x.dtype)
        cache.mark_valid(cache_position, token_mask)
        windows = self.layer_windows or [self.sliding_window] * len(self.layers)
        masks = {w: cache.attention_mask(cache_position, w) for w in dict.fromkeys(windows)}
        layer_masks = [masks[w] for w in windows]
        if self.layers_step is not None and not return_hidden:  # (one position: last_only changes nothing)
            logits = self.layers_step.logits(x, cos, sin, cache, cache_position, layer_masks, experts, routing,
                                             self.norm, self.lm_head)
            if logits is not None:
                return logits
        done = None if self.layers_step is None else self.layers_step(
            x, cos, sin, cache, cache_position, layer_masks, experts, routing)
        if done is not None:
            x = done
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, cache, cache_position, masks[windows[i]], experts, routing)
        if return_hidden:
            hidden = self.norm(x)
            return self.lm_head(hidden[:, -1:] if last_only else hidden).float(), hidden
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()


class Family(ABC):
    """A model family bound to one parsed config. Subclasses set ``name`` and ``model_types``."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.json ``model_type`` values this family reads

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    def from_config_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Family:
        return cls(cls.parse_config(raw, source))

    # ------------------------------------------------------------------ config and shape
    @classmethod
    @abstractmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Any:
        """config.json's dict -> the family's config (a :class:`ModelConfig`); errors name ``source``."""

    @property
    @abstractmethod
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder layer indices holding an MoE block, ascending (MoE index i = position i here)."""

    @property
    @abstractmethod
    def num_experts(self) -> int:
        """Routed experts per MoE layer."""

    @abstractmethod
    def router_spec(self) -> RouterSpec:
        """How tokens are routed (identical in every MoE layer)."""

    @abstractmethod
    def expert_spec(self) -> ExpertSpec:
        """What one routed expert computes."""

    # ------------------------------------------------------------------ the model
    @abstractmethod
    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        """The decoder with empty weights; ``linear_factory`` makes the attention projections (dense or AWQ)."""

    # ------------------------------------------------------------------ the checkpoint
    @abstractmethod
    def checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        """The checkpoint tensor name of the decoder parameter ``param_path`` (e.g. ``layers.0.norm.weight``)."""

    @abstractmethod
    def detect_expert_layout(self, reader: CheckpointReader) -> ExpertLayout:
        """Which of the family's expert layouts the checkpoint uses (CheckpointError naming the expected names)."""

    @abstractmethod
    def read_expert(self, reader: CheckpointReader, layout: ExpertLayout, quant: QuantizationSpec | None,
                    moe_layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One expert's tensors on the CPU, named and shaped as its ``ExpertFormat`` wants (``w13``/``w2``...)."""

    @abstractmethod
    def expert_linears(self, name: str, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]] | None:
        """For ``moeflow quantize``: when checkpoint tensor ``name`` holds expert weights, the per-expert linear
        weights ``[out, in]`` it holds, each with the module name an AWQ checkpoint stores it under; else None."""

    # ------------------------------------------------------------------ multi-token prediction (families/mtp.py)
    mtp_config_field: ClassVar[str | None] = None  # the config.json field counting the MTP layers, if any

    def num_mtp_layers(self) -> int:
        """MTP layers config.json declares (0: none, or the family does not read them)."""
        return 0

    def build_mtp(self, dtype: torch.dtype, linear_factory: LinearFactory) -> MultiTokenPredictor:
        """The MTP layers with empty weights (their MoE blocks' indices follow the decoder's MoE layers)."""
        raise NotImplementedError(f"{self.name}: moeflow does not read this family's multi-token-prediction layers")

    def mtp_checkpoint_name(self, param_path: str, layout: ExpertLayout) -> str:
        """The checkpoint name of the MTP module's parameter ``param_path`` (``layers.{j}.<rest>``)."""
        raise NotImplementedError(f"{self.name}: moeflow does not read this family's multi-token-prediction layers")

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache the family's attention layers read (default: full heads of the config's sizes)."""
        cfg = self.config
        return KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)

    def quantized_name(self, name: str) -> str:
        """The name a non-expert tensor gets in a quantized checkpoint (default: unchanged)."""
        return name

    def attention_linear(self, name: str) -> str | None:
        """The module name when ``name`` is an attention projection's weight (quantized on request), else None."""
        parts = name.split(".")
        if len(parts) == 6 and parts[3] == "self_attn" and parts[4] in ("q_proj", "k_proj", "v_proj", "o_proj") \
                and parts[5] == "weight" and parts[0] == "model" and parts[1] == "layers":
            return ".".join(parts[:5])
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
