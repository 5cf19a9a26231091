"""Tiny DeepSeek-V3 and GLM-4.5 checkpoints with a multi-token-prediction layer (random init), and an fp32
reference of the MTP module built from transformers' own decoder layer.

The writer asks transformers for a model of ``num_hidden_layers + 1`` layers and saves it (so layer N, the MTP
layer's block, is a DeepSeek-V3 decoder layer in the published names), then adds the MTP layer's own tensors under
``model.layers.N`` as DeepSeek-V3's checkpoint names them (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
and the copies ``embed_tokens`` / ``shared_head.head``) and writes config.json with ``num_hidden_layers = N`` and
``num_nextn_predict_layers = 1``. Without MTP weights the layer-N tensors are dropped (what transformers saves)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_families import make_model

from moeflow.engine.generate import positions_from_mask
from moeflow.engine.mtp import MTPDrafter, eager_pass


def make_mtp_checkpoint(directory: str | Path, seed: int = 0, with_mtp: bool = True, kind: str = "deepseek_v3",
                        **shape):
    """(directory, the transformers model of N + 1 layers whose layer N is the MTP block, the MTP layer's own
    tensors {name: fp32}) for a tiny ``kind`` (DeepSeek-V3 or GLM-4.5) of ``shape`` (``num_hidden_layers`` = N,
    the main model's)."""
    directory = Path(directory)
    n = shape.pop("num_hidden_layers", 3)
    model = make_model(kind, seed, num_hidden_layers=n + 1, **shape)
    model.save_pretrained(directory)
    files = sorted(directory.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
        f.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    prefix = f"model.layers.{n}."
    g = torch.Generator().manual_seed(seed + 100)
    h = model.config.hidden_size
    own = {"enorm.weight": 0.8 + 0.4 * torch.rand(h, generator=g),
           "hnorm.weight": 0.8 + 0.4 * torch.rand(h, generator=g),
           "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
           "shared_head.norm.weight": 0.8 + 0.4 * torch.rand(h, generator=g)}
    if with_mtp:
        tensors.update({prefix + k: v for k, v in own.items()})
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    else:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(config))
    return directory, model, own


def make_mtp_checkpoint_with_tokenizer(directory: str | Path, seed: int = 5, **shape) -> Path:
    """A tiny DeepSeek-V3 with one MTP layer over the embedded model's 256-token vocabulary, with its tokenizer and
    chat template (what the command line and the server need), and a generation_config without an EOS (greedy)."""
    import shutil

    from moeflow.cli import embedded_model_path

    path, _, _ = make_mtp_checkpoint(directory, seed=seed, vocab_size=256, **shape)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_path() / name, Path(path) / name)
    (Path(path) / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return Path(path)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def reference_mtp_logits(model, own: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """fp32 reference of DeepSeek-V3's MTP module over a prompt: ids [1, T] -> the MTP layer's logits [T - 1, V]
    at positions 0..T-2 (hidden state of position i from the main model's first N layers and final norm, the
    embedding of token i + 1; position 0's embedding zeroed), its block transformers' decoder layer N."""
    cfg, inner = model.config, model.model
    n, eps = cfg.num_hidden_layers - 1, cfg.rms_norm_eps
    t = ids.shape[1]
    pos = torch.arange(t)[None]
    x = inner.embed_tokens(ids)
    cos_sin = inner.rotary_emb(x, pos)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    for layer in inner.layers[:n]:
        x = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=cos_sin)
        x = x[0] if isinstance(x, tuple) else x
    hidden = inner.norm(x)[:, :-1]  # positions 0..T-2
    emb = inner.embed_tokens(ids[:, 1:]).clone()
    emb[:, 0] = 0.0  # position 0
    fused = torch.cat((rms(emb, own["enorm.weight"], eps), rms(hidden, own["hnorm.weight"], eps)), -1) \
        @ own["eh_proj.weight"].T
    cos, sin = inner.rotary_emb(fused, pos[:, :-1])
    y = inner.layers[n](fused, attention_mask=causal[..., :-1, :-1], position_ids=pos[:, :-1],
                        position_embeddings=(cos, sin))
    y = y[0] if isinstance(y, tuple) else y
    return model.lm_head(rms(y, own["shared_head.norm.weight"], eps))[0]


def mtp_layer_logits(model, ids: torch.Tensor, cache_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """moeflow's logits of a loaded model's main pass and of its first MTP layer over ``ids [1, T]``: the main
    pass's ``[1, T, V]`` and the MTP layer's ``[1, T - 1, V]`` (position i predicts token i + 2 from the main
    model's hidden state at i and the embedding of token i + 1), computed layer by layer as the fp32 references are."""
    runner, t = model.runner, ids.shape[1]
    mask = torch.ones_like(ids, dtype=torch.bool)
    pos = positions_from_mask(mask)
    with torch.inference_mode():
        logits, hidden = eager_pass(runner, ids, pos, runner.new_cache(1, cache_len, reuse=False), torch.arange(t),
                                    mask, "prefill", (ids, mask), True)
        drafter = MTPDrafter(runner, model.mtp, cache_len)
        layer = model.mtp.layers[0]
        cos, sin = runner.decoder.rotary(pos[:, :-1], hidden.dtype)
        drafter.cache.mark_valid(torch.arange(t - 1), mask[:, :-1])
        x = layer(hidden[:, :-1], runner.decoder.embed_tokens(ids[:, 1:]), pos[:, :-1], cos, sin, drafter.cache,
                  torch.arange(t - 1), drafter.cache.attention_mask(torch.arange(t - 1), None), runner.backend)
        return logits, runner.decoder.lm_head(layer.shared_head(x)).float()


@contextmanager
def routed_layers(model) -> Iterator[list[int]]:
    """The MoE layer index of every ``forward_logits`` call the model's expert backend takes inside the block, in
    order; the backend is closed on the way out."""
    seen: list[int] = []
    forward = model.experts.forward_logits

    def spy(layer, *args, **kwargs):
        seen.append(layer)
        return forward(layer, *args, **kwargs)

    model.experts.forward_logits = spy
    try:
        yield seen
    finally:
        model.experts.close()
