"""Tiny Qwen3-Next / Qwen3.5-MoE checkpoints with a multi-token-prediction layer in the published names (random
init), and an fp32 reference of the MTP module built from transformers' own decoder layer.

transformers drops the MTP weights, so the writer asks it for a model of ``num_hidden_layers + 1`` layers whose last
layer is a full-attention MoE layer, saves it, and renames that layer's tensors ``model.layers.N.*`` ->
``mtp.layers.0.*`` (so the MTP block is a Qwen3-Next decoder layer in the published names), then adds the MTP
module's own tensors as the checkpoints name them (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.norm``) and writes config.json with ``num_hidden_layers = N`` and
``mtp_num_hidden_layers = 1``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_hybrid import QWEN3_NEXT, make_model

# the tests' shape: a linear, a full and a linear layer (GQA, a shared expert), then the MTP layer
SHAPE = {**QWEN3_NEXT["interval2-gqa-dense-first"], "num_hidden_layers": 3, "mlp_only_layers": []}
SHAPE.pop("full_attention_interval")
TYPES = ["linear_attention", "full_attention", "linear_attention"]


def make_qwen_mtp_checkpoint(directory: str | Path, seed: int = 0, with_mtp: bool = True, kind: str = "qwen3_next",
                             **overrides) -> tuple[Path, object, dict[str, torch.Tensor]]:
    """(directory, the transformers model of N + 1 layers whose layer N is the MTP block, the MTP module's own
    tensors {checkpoint name: fp32}) for a tiny ``kind`` ("qwen3_next", "qwen3_5_moe_text", or "qwen3_5_moe": the
    published conditional-generation checkpoint, text weights under ``model.language_model``, the MTP layer's still
    under ``mtp.``)."""
    directory = Path(directory)
    fields = {**SHAPE, **overrides}
    n = fields.pop("num_hidden_layers")
    types = list(fields.pop("layer_types", TYPES))[:n]
    model = make_model(kind, seed, num_hidden_layers=n + 1, layer_types=types + ["full_attention"], **fields)
    model.save_pretrained(directory)
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    nested = kind == "qwen3_5_moe"  # the conditional-generation checkpoint: text weights under model.language_model
    prefix = f"model.language_model.layers.{n}." if nested else f"model.layers.{n}."
    block = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    tensors = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    g = torch.Generator().manual_seed(seed + 100)
    h = model.config.get_text_config().hidden_size
    own = {"mtp.pre_fc_norm_embedding.weight": 0.4 * torch.rand(h, generator=g) - 0.2,
           "mtp.pre_fc_norm_hidden.weight": 0.4 * torch.rand(h, generator=g) - 0.2,
           "mtp.fc.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
           "mtp.norm.weight": 0.4 * torch.rand(h, generator=g) - 0.2}
    if with_mtp:
        tensors.update(own)
        tensors.update({"mtp.layers.0." + k[len(prefix):]: v for k, v in block.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (config["text_config"] if nested else config).update(num_hidden_layers=n, layer_types=types,
                                                         mtp_num_hidden_layers=1)
    (directory / "config.json").write_text(json.dumps(config))
    return directory, model, own


def zc_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMS norm in fp32: x / rms(x) * (1 + w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@torch.no_grad()
def reference_qwen_mtp_logits(model, own: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """fp32 reference of the Qwen3-Next MTP module over a prompt: ids [1, T] -> its logits [T - 1, V] at positions
    0..T-2 (the main model's final-normed hidden state of position i from its first N layers, the embedding of
    token i + 1, not zeroed at position 0), its block transformers' decoder layer N."""
    cfg, inner = model.config, model.model
    n, eps = cfg.num_hidden_layers - 1, cfg.rms_norm_eps
    t = ids.shape[1]
    pos = torch.arange(t)[None]
    x = inner.embed_tokens(ids)
    cos_sin = inner.rotary_emb(x, pos)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    for i, layer in enumerate(inner.layers[:n]):
        full = cfg.layer_types[i] == "full_attention"
        x = layer(x, position_embeddings=cos_sin, attention_mask=causal if full else None, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
    hidden = inner.norm(x)[:, :-1]
    emb = inner.embed_tokens(ids[:, 1:])
    fused = torch.cat((zc_rms(emb, own["mtp.pre_fc_norm_embedding.weight"], eps),
                       zc_rms(hidden, own["mtp.pre_fc_norm_hidden.weight"], eps)), -1) @ own["mtp.fc.weight"].T
    cos, sin = inner.rotary_emb(fused, pos[:, :-1])
    y = inner.layers[n](fused, position_embeddings=(cos, sin), attention_mask=causal[..., :-1, :-1],
                        position_ids=pos[:, :-1])
    y = y[0] if isinstance(y, tuple) else y
    return model.lm_head(zc_rms(y, own["mtp.norm.weight"], eps))[0]
