"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): DeepSeek-V3's MoE decoder with DeepSeek Sparse
Attention (DSA), multi-head latent attention restricted per query to the ``index_topk`` keys a lightning indexer
picks.

The indexer of a layer (parameters ``self_attn.indexer.*``, as published and as transformers names them):

* its query: ``wq_b`` on the q-LoRA latent (``q_a_layernorm(q_a_proj(x))``, shared with the attention),
  ``index_n_heads`` heads of ``index_head_dim``;
* its key: one head per token, ``k_norm(wk(x))`` (a LayerNorm with bias, eps 1e-6), kept in the cache;
* rotary on the first ``qk_rope_head_dim`` values of both (the attention's cos/sin): halves for DeepSeek-V3.2,
  interleaved pairs for GLM-5 (``indexer_rope_interleave`` when config.json says);
* score of query t for key s, in fp32: ``sum_h w_h(t) relu(q_h(t) . k(s) / sqrt(index_head_dim))`` with
  ``w(t) = weights_proj(x) / sqrt(index_n_heads)`` (``weights_proj`` kept in fp32, as transformers keeps it);
  the causal / padding mask sets disallowed keys to -inf, then the ``index_topk`` best keys are kept.

The attention is then DeepSeek-V3's MLA with the selection ANDed into its mask: exact, and capturable (static
shapes, no host read). It still reads every cached key; a GPU kernel (FlashMLA's sparse decode) would gather only
the ``index_topk`` selected latents, which is where DSA's long-context saving comes from.
GLM-5 layers marked ``"shared"`` in ``indexer_types`` run no indexer and reuse the selection of the layer
before them (the decoder hands it along).

Cache: the indexer key rides in the latent cache, after MLA's ``kv_lora_rank + qk_rope_head_dim`` values
(``latent_dim`` grows by ``index_head_dim``; shared layers leave theirs zero), so generate's cache, its
micro-batch row views and the captured decode step hold it with no new cache type. The full-head cache
(``latent_kv_cache = False``) has no room for it: refused by name. The serving engine's slotted cache keeps
latents too (:class:`moeflow.engine.kv_slots.LatentSlotKVCache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.errors import CheckpointError, InputError
from moeflow.families.base import CausalDecoder, KVCacheSpec
from moeflow.families.deepseek import DeepSeekConfig, DeepSeekV3Family
from moeflow.families.deepseek_moe import MoEDecoderLayer
from moeflow.families.layers import Fp32Linear, LinearFactory
from moeflow.families.mla import LatentAttention, MLAShape, apply_rotary_halves, apply_rotary_pairs, rotary_from_config
from moeflow.moe.block import MoEBlock

# every layer's kind: transformers 5.24 writes "indexed_attention", 5.17 "deepseek_sparse_attention" (the same layer)
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")
INDEX_SCORE_BYTES = 1 << 28  # a prefill's fp32 [queries, heads, keys] index scores are computed in chunks of this


@dataclass
class DsaConfig(DeepSeekConfig):
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    indexer_types: list[str] = field(default_factory=list)  # "full" / "shared" per layer (filled in)
    indexer_rope_interleave: bool | None = None  # None: the model type's (halves for V3.2, pairs for GLM-5)
    model_type: str = "deepseek_v32"


def indexer_types(raw: dict[str, Any], shared_allowed: bool, source: str) -> list[str]:
    """Per-layer indexer kinds as transformers derives them: ``indexer_types``, else ``index_topk_pattern``
    ("F"/"S" per layer), else ``index_topk_freq`` / ``index_skip_topk_offset`` (GLM-5); all "full" for V3.2."""
    n = raw.get("num_hidden_layers")
    if n is None:
        return []  # (the config's own check names the missing field)
    if not shared_allowed:
        return ["full"] * n
    kinds = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if kinds is None:
        freq, offset = max(int(raw.get("index_topk_freq") or 1), 1), raw.get("index_skip_topk_offset")
        offset = 2 if offset is None else int(offset)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    kinds = list(kinds)
    if len(kinds) != n or any(k not in ("full", "shared") for k in kinds) or (kinds and kinds[0] != "full"):
        raise CheckpointError(f"{source}: indexer_types={kinds} must give 'full' or 'shared' for each of "
                              f"num_hidden_layers={n} layers, the first 'full' (a shared layer reuses the "
                              "selection of the layer before it)")
    return kinds


class LightningIndexer(nn.Module):
    """One layer's indexer (see the module docstring): ``key`` for the cache, ``select`` for the attention mask."""

    def __init__(self, cfg: DsaConfig, interleaved: bool, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Fp32Linear(cfg.hidden_size, self.n_heads)  # fp32 whatever the model's dtype
        self.rotate = apply_rotary_pairs if interleaved else apply_rotary_halves

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on the first ``rope_dim`` values of each head: x [B, heads, T, D]; cos/sin [B, T, rope_dim]."""
        return torch.cat((self.rotate(x[..., :self.rope_dim], cos, sin), x[..., self.rope_dim:]), dim=-1)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> the tokens' indexer keys [B, T, index_head_dim] (model dtype, as cached)."""
        return self.rope(self.k_norm(self.wk(x))[:, None], cos, sin)[:, 0]

    def select(self, x: torch.Tensor, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H], q_in [B, T, q_lora_rank], keys [B, S, index_head_dim] (the layer's cached ones), mask bool
        [B, 1, T, S] -> bool [B, 1, T, S]: the ``index_topk`` allowed keys of best score per query (every allowed
        one when fewer)."""
        b, t, _ = x.shape
        s = keys.shape[1]
        q = self.rope(self.wq_b(q_in).view(b, t, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        q = q.transpose(1, 2).float()  # [B, T, heads, D]
        weights = self.weights_proj(x.float()) * self.n_heads ** -0.5  # [B, T, heads]
        k = keys.float().transpose(-1, -2)[:, None]  # [B, 1, D, S]
        topk = min(self.topk, s)
        chunk = max(1, INDEX_SCORE_BYTES // (4 * b * self.n_heads * s))
        picked = []
        for lo in range(0, t, chunk):
            scores = F.relu(torch.matmul(q[:, lo:lo + chunk], k) * self.head_dim ** -0.5)  # [B, c, heads, S]
            index = torch.matmul(weights[:, lo:lo + chunk, None], scores)[:, :, 0]  # [B, c, S]
            index = index.masked_fill(~mask[:, 0, lo:lo + chunk], float("-inf"))
            picked.append(index.topk(topk, dim=-1).indices)
        ids = torch.cat(picked, dim=1) if len(picked) > 1 else picked[0]
        return torch.zeros_like(mask[:, 0]).scatter_(-1, ids, True)[:, None]


class SparseLatentAttention(LatentAttention):
    """MLA whose mask is narrowed to the indexer's selection (``indexer`` None: a shared layer, given one)."""

    def __init__(self, shape: MLAShape, layer_idx: int, linear_factory: LinearFactory, dtype: torch.dtype,
                 indexer: LightningIndexer | None, index_dim: int, model_type: str):
        super().__init__(shape, layer_idx, linear_factory, dtype)
        self.indexer, self.index_dim, self.model_type = indexer, index_dim, model_type

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                cache_position: torch.Tensor, mask: torch.Tensor, selected: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H]; cos/sin [B, T, rope]; mask bool [B, 1, T, S]; selected: the previous layer's selection
        (shared layers) -> (output [B, T, H], this layer's selection bool [B, 1, T, S])."""
        if not hasattr(cache, "update_latent"):
            raise InputError(f"{self.model_type}: DeepSeek Sparse Attention keeps its indexer keys in the latent KV "
                             f"cache; {type(cache).__name__} (a full-head cache: the serving engine's continuous "
                             "batching, or latent_kv_cache=False) has none, which moeflow does not support")
        q_in = self.q_input(x)
        q_nope, q_rope, latent = self.project(x, q_in, cos, sin)
        s = self.shape
        if self.indexer is None:
            if selected is None:
                raise ValueError(f"layer {self.layer_idx} shares the indexer selection of a previous layer: none given")
            entry = F.pad(latent, (0, self.index_dim))
        else:
            entry = torch.cat((latent, self.indexer.key(x, cos, sin)), dim=-1)
        if self.in_place(cache, q_nope):  # the server's decode view: only the indexer keys are gathered
            cache.write_latent(self.layer_idx, entry, cache_position)
            if self.indexer is not None:
                keys = cache.latent_columns(self.layer_idx, s.latent_dim)
                selected = self.indexer.select(x, q_in, cos, sin, keys, mask)
            return self.output(self.absorbed_in_place(cache, q_nope, q_rope, cache_position, selected)), selected
        latents = cache.update_latent(self.layer_idx, entry, cache_position)
        if self.indexer is not None:
            selected = self.indexer.select(x, q_in, cos, sin, latents[..., s.latent_dim:], mask)
        out = self.attend_latents(q_nope, q_rope, latents, mask & selected)
        return self.output(out), selected


class SparseDecoderLayer(MoEDecoderLayer):
    """:class:`MoEDecoderLayer` that hands the indexer selection on to the next layer."""

    def forward(self, x, cos, sin, cache, cache_position, mask, experts, routing=None, selected=None):
        h, selected = self.self_attn(self.input_layernorm(x), cos, sin, cache, cache_position, mask, selected)
        x = x + h
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, experts, routing) if isinstance(self.mlp, MoEBlock) else self.mlp(h)), selected


class SparseDecoder(CausalDecoder):
    """:class:`CausalDecoder` whose layers pass the indexer selection along (GLM-5's shared layers read it)."""

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any, cache_position: torch.Tensor,
                token_mask: torch.Tensor, experts: Any, routing: Any = None, last_only: bool = False) -> torch.Tensor:
        """As :meth:`CausalDecoder.forward`: embeds [B, T, H] ... -> logits fp32 [B, T or 1, V]."""
        x = embeds
        cos, sin = self.rotary(position_ids, x.dtype)
        cache.mark_valid(cache_position, token_mask)
        mask = cache.attention_mask(cache_position, None)
        selected = None
        for layer in self.layers:
            x, selected = layer(x, cos, sin, cache, cache_position, mask, experts, routing, selected)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()


class DeepSeekV32Family(DeepSeekV3Family):
    """DeepSeek-V3.2 / V3.2-Exp: DeepSeek-V3 with the lightning indexer in every layer (rotary on halves)."""

    name = "deepseek_v32"
    model_types = ("deepseek_v32",)
    config: DsaConfig
    config_class = DsaConfig
    shared_indexers: ClassVar[bool] = False  # GLM-5's indexer_types
    interleaved_indexer: ClassVar[bool] = False

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> DsaConfig:
        if raw.get("q_lora_rank") is None:
            raise CheckpointError(f"{source}: {cls.name} needs q_lora_rank (its indexer reads the q-LoRA latent)")
        kinds = [k for k in raw.get("layer_types") or [] if k not in DSA_LAYER_TYPES]
        if kinds:
            raise CheckpointError(f"{source}: layer_types {sorted(set(kinds))} are not supported for {cls.name} "
                                  "(every layer is 'indexed_attention')")
        # as transformers reads them: MLA's rotary always on interleaved pairs, the indexer kinds derived
        raw = {**raw, "rope_interleave": True, "indexer_types": indexer_types(raw, cls.shared_indexers, source)}
        cfg = super().parse_config(raw, source)
        if cfg.index_topk < 1 or cfg.index_n_heads < 1:
            raise CheckpointError(f"{source}: index_topk={cfg.index_topk} and index_n_heads={cfg.index_n_heads} "
                                  "must be >= 1")
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise CheckpointError(f"{source}: index_head_dim={cfg.index_head_dim} is smaller than the rotary part "
                                  f"qk_rope_head_dim={cfg.qk_rope_head_dim}")
        return cfg

    @property
    def indexer_interleaved(self) -> bool:
        given = self.config.indexer_rope_interleave
        return self.interleaved_indexer if given is None else bool(given)

    def mtp_attention(self, cache_layer: int, dtype: torch.dtype, linear_factory: LinearFactory) -> nn.Module:
        raise NotImplementedError(f"{self.name}: the multi-token-prediction layer's sparse attention (its lightning "
                                  "indexer) is not read yet")

    def build_decoder(self, dtype: torch.dtype, linear_factory: LinearFactory) -> CausalDecoder:
        cfg = self.config
        rotary, softmax_mult = rotary_from_config(cfg.rope_scaling or {}, cfg.qk_rope_head_dim, cfg.rope_theta,
                                                  cfg.max_position_embeddings, "config.json")
        shape = self.mla_shape(softmax_mult)
        layers = []
        for i in range(cfg.num_hidden_layers):
            indexer = LightningIndexer(cfg, self.indexer_interleaved, dtype) if cfg.indexer_types[i] == "full" \
                else None
            attention = SparseLatentAttention(shape, i, linear_factory, dtype, indexer, cfg.index_head_dim, self.name)
            layers.append(SparseDecoderLayer(attention, self.build_mlp(i, dtype), cfg.hidden_size, cfg.rms_norm_eps,
                                             dtype))
        decoder = SparseDecoder(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps, cfg.qk_rope_head_dim,
                                cfg.rope_theta, dtype)
        decoder.rotary = rotary
        return decoder

    def kv_cache_spec(self) -> KVCacheSpec:
        if not self.latent_kv_cache:
            raise InputError(f"{self.name}: latent_kv_cache=False is not supported (DeepSeek Sparse Attention keeps "
                             "its indexer keys in the latent cache)")
        cfg = self.config
        return KVCacheSpec(cfg.num_hidden_layers, latent_dim=self.mla_shape().latent_dim + cfg.index_head_dim)


class GlmMoeDsaFamily(DeepSeekV32Family):
    """GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's layers, the indexer's rotary on interleaved pairs, and layers that
    may share the previous layer's selection (``indexer_types`` / ``index_topk_freq``)."""

    name = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    shared_indexers = True
    interleaved_indexer = True
