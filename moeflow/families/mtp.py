"""Multi-token-prediction (MTP) layers as DeepSeek-V3 publishes them (paper §2.2; ``num_nextn_predict_layers``).

One MTP layer k joins the representation of position i from the depth before it (the main model's final-normed
hidden state for k = 1) with the embedding of the token at i + k, and predicts the token at i + k + 1:

    h' = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h_i)])          (embedding first, as the published eh_proj reads it)
    x  = decoder block(h')                                     (its own attention and MoE, a full decoder layer)
    logits = lm_head(shared_head.norm(x))                      (the main model's embedding and head are shared)

A chained draft feeds ``shared_head.norm(x)`` back as the next depth's h. As the serving engines that run these
checkpoints do, the embedding of the token at position 0 is zeroed (nothing precedes it).

Checkpoint names: MTP layer j is ``model.layers.{num_hidden_layers + j}``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` (``embed_tokens`` and ``shared_head.head`` are copies of the main model's, never read), and
the block's own tensors under the decoder layers' names (``self_attn.*``, ``input_layernorm``,
``post_attention_layernorm``, ``mlp.*``). The block's MoE experts join the expert backend as MoE layer
``num_moe_layers + j``; its attention keeps its own cache (layer j of a cache of ``num_mtp_layers`` layers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moeflow.families.layers import RMSNorm
from moeflow.moe.block import MoEBlock

MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


NormFactory = Callable[[int, float, torch.dtype], nn.Module]  # (hidden size, eps, dtype) -> an RMS norm


class SharedHeadNorm(nn.Module):
    """``shared_head``: the MTP layer's own final norm (its head is the main model's lm_head)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, norm: NormFactory = RMSNorm) -> None:
        super().__init__()
        self.norm = norm(hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class MTPLayer(nn.Module):
    """One MTP layer: the fusion of (h, next embedding) then ``block``, a decoder layer called as the decoder's
    layers are (``block(x, cos, sin, cache, cache_position, mask, experts, routing)``). ``norm``: the family's RMS
    norm (Qwen3-Next's are zero-centred); ``zero_first_embedding``: zero the embedding at position 0 (DeepSeek-V3's
    and GLM's serving engines do; Qwen3-Next's MTP module does not)."""

    def __init__(self, block: nn.Module, hidden_size: int, eps: float, dtype: torch.dtype,
                 norm: NormFactory = RMSNorm, zero_first_embedding: bool = True) -> None:
        super().__init__()
        self.enorm = norm(hidden_size, eps, dtype)
        self.hnorm = norm(hidden_size, eps, dtype)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.block = block
        self.shared_head = SharedHeadNorm(hidden_size, eps, dtype, norm)
        self.zero_first_embedding = zero_first_embedding

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] (the previous depth's, final-normed), embeds [B, T, H] of the next tokens, positions
        [B, T] -> the block's input [B, T, H] (the embedding at position 0 zeroed where the family does)."""
        if self.zero_first_embedding:
            embeds = torch.where((positions == 0)[..., None], torch.zeros_like(embeds), embeds)
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: Any, cache_position: torch.Tensor, mask: torch.Tensor, experts: Any,
                routing: Any = None) -> torch.Tensor:
        """-> the block's output x [B, T, H] before ``shared_head.norm`` (see :meth:`fuse` for the inputs)."""
        return self.block(self.fuse(hidden, embeds, positions), cos, sin, cache, cache_position, mask, experts,
                          routing)


class MultiTokenPredictor(nn.Module):
    """A family's MTP layers (``layers[j]`` = checkpoint layer ``num_hidden_layers + j``), beside the decoder:
    their MoE blocks are not the decoder's (``decoder.moe_blocks`` stays the main model's)."""

    def __init__(self, layers: list[MTPLayer], first_checkpoint_layer: int, config_field: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first_checkpoint_layer = first_checkpoint_layer
        self.config_field = config_field  # the config.json field that counts them (errors name it)

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        """The MTP layers' MoE blocks in layer order (their ``layer_idx`` follows the decoder's MoE layers)."""
        return [m for m in self.modules() if isinstance(m, MoEBlock)]


def mtp_checkpoint_name(param_path: str, first_layer: int, block_name: Callable[[str], str]) -> str:
    """The MTP module's ``layers.{j}.<rest>`` -> ``model.layers.{first_layer + j}.<rest>`` for the MTP layer's own
    tensors; the block's through ``block_name``, the family's decoder-layer naming (given ``layers.{N}.<rest>``)."""
    _, j, rest = param_path.split(".", 2)
    n = first_layer + int(j)
    if rest.startswith(MTP_OWN):
        return f"model.layers.{n}.{rest}"
    return block_name(f"layers.{n}.{rest.removeprefix('block.')}")
