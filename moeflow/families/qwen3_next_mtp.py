"""Qwen3-Next's and Qwen3.5-MoE's multi-token-prediction layer (``mtp_num_hidden_layers`` in config.json; Qwen3.5
keeps it in ``text_config``), as their checkpoints publish it under ``mtp.``:

    h' = mtp.fc([pre_fc_norm_embedding(Emb(t_{i+1})) ; pre_fc_norm_hidden(h_i)])   (embedding first)
    x  = mtp.layers.0(h')         (a full-attention decoder layer: gated attention + the main model's MoE block)
    logits = lm_head(mtp.norm(x)) (the main model's embedding and head are shared; no copies are stored)

``h_i`` is the main model's final-normed hidden state; the norms are zero-centred (``1 + w``) like the decoder's;
the embedding at position 0 is not zeroed (the module has no such step). Built on :class:`MTPLayer`
(:mod:`moeflow.families.mtp`), whose own parameters map to these names: ``enorm`` -> ``pre_fc_norm_embedding``,
``hnorm`` -> ``pre_fc_norm_hidden``, ``eh_proj`` -> ``fc``, ``shared_head.norm`` -> ``norm``. The block's MoE
experts are the expert backend's MoE layer ``len(moe_layer_ids) + j`` (``mtp.layers.{j}.mlp.experts``); its
attention is layer j of the MTP cache. One MTP layer is read (every published checkpoint has one: the fusion and
final norm are shared by the layers, so a chain over several is not the DeepSeek-V3 module's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from moeflow.errors import CheckpointError
from moeflow.families.gated_deltanet import ZeroCenteredRMSNorm
from moeflow.families.mtp import MTPLayer, MultiTokenPredictor


class HybridLayersConfig(Protocol):
    """What the MTP layer reads of :class:`moeflow.families.qwen3_next.HybridMoEConfig` (a dataclass: ``replace``d
    into the decoder extended by the MTP layer). Declared here so this module does not import the family's."""

    hidden_size: int
    num_hidden_layers: int
    mtp_num_hidden_layers: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    moe_layer_ids: tuple[int, ...]


MTP_FIELD = "mtp_num_hidden_layers"
OWN_NAMES = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
             "eh_proj.weight": "mtp.fc.weight", "shared_head.norm.weight": "mtp.norm.weight"}


def build_qwen_mtp(cfg: HybridLayersConfig, make_block: Callable[[HybridLayersConfig, int], nn.Module],
                   dtype: torch.dtype) -> MultiTokenPredictor:
    """The MTP layer with empty weights: its block ``make_block(extended config, layer index)``, the family's
    full-attention ``HybridDecoderLayer`` with an MoE block."""
    n, m = cfg.num_hidden_layers, cfg.mtp_num_hidden_layers
    if m != 1:
        raise CheckpointError(f"config.json {MTP_FIELD}={m}: moeflow reads Qwen3-Next / Qwen3.5 checkpoints with one "
                              "multi-token-prediction layer (as published)")
    # the decoder extended by the MTP layer: full attention, an MoE block after the decoder's MoE layers
    ext = replace(cfg, num_hidden_layers=n + m, layer_types=cfg.layer_types + ("full_attention",) * m,
                  moe_layer_ids=cfg.moe_layer_ids + tuple(range(n, n + m)))
    layers = []
    for j in range(m):
        block = make_block(ext, n + j)
        assert block.self_attn is not None
        block.self_attn.kv_idx = j  # its place in the MTP layers' own cache
        layers.append(MTPLayer(block, cfg.hidden_size, cfg.rms_norm_eps, dtype, norm=ZeroCenteredRMSNorm,
                               zero_first_embedding=False))
    return MultiTokenPredictor(layers, n, MTP_FIELD)


def qwen_mtp_checkpoint_name(param_path: str) -> str:
    """The MTP module's ``layers.{j}.<rest>`` -> its ``mtp.*`` checkpoint name."""
    _, j, rest = param_path.split(".", 2)
    if rest in OWN_NAMES:
        return OWN_NAMES[rest]
    rest = rest.removeprefix("block.").replace("mlp.shared_expert.output_gate.", "mlp.shared_expert_gate.")
    return f"mtp.layers.{j}.{rest}"


def mtp_expert_base(cfg: HybridLayersConfig, text_prefix: str, moe_layer: int) -> str:
    """The checkpoint prefix of MoE layer ``moe_layer``'s experts (past the decoder's: the MTP layer's)."""
    n_moe = len(cfg.moe_layer_ids)
    if moe_layer < n_moe:
        return f"{text_prefix}.layers.{cfg.moe_layer_ids[moe_layer]}.mlp.experts"
    return f"mtp.layers.{moe_layer - n_moe}.mlp.experts"
