"""Tiny compressed-tensors W4A16 checkpoints written by compressed-tensors' own compressor, and the transformers
reference on the weights compressed-tensors' own dequantizer gives back.

Writing follows llm-compressor's path without its calibration: the checkpoint's linear weights become
``nn.Linear`` modules under their checkpoint names, ``apply_quantization_config`` attaches a W4A16 scheme (group
strategy, ``targets: ["Linear"]`` and an ``ignore`` list), min-max scales and zero points come from
``compute_dynamic_scales_and_zp`` (what llm-compressor's min-max observer computes for a weight), and
``ModelCompressor.compress_model`` packs them (``pack-quantized``); ``update_config`` writes config.json's
``quantization_config``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

ROUTERS = ["re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]


def write_ct_checkpoint(src: Path, dst: Path, group: int, symmetric: bool, ignore: list[str] | None = None,
                        actorder: str | None = None) -> Path:
    """``src`` (a 16/32-bit checkpoint, per-expert names) quantized by compressed-tensors into ``dst``. ``ignore``:
    the modules left 16-bit (default: lm_head and the routers, as llm-compressor's MoE examples)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    sd = load_file(src / "model.safetensors")
    tree, rest = nn.Module(), {}
    for name, t in sd.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name:
            linear = nn.Linear(t.shape[1], t.shape[0], bias=f"{module}.bias" in sd, dtype=t.dtype)
            linear.weight.data = t
            if linear.bias is not None:
                linear.bias.data = sd[f"{module}.bias"]
            parent, _, leaf = module.rpartition(".")
            _submodule(tree, parent).add_module(leaf, linear)
        elif not (name.endswith(".bias") and f"{name.removesuffix('.bias')}.weight" in sd):
            rest[name] = t
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group,
                            actorder=actorder)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=list(ignore if ignore is not None else ["lm_head", *ROUTERS]))
    apply_quantization_config(tree, config)
    for module in tree.modules():
        if hasattr(module, "quantization_scheme"):
            scale, zero = compute_dynamic_scales_and_zp(module.weight, module.quantization_scheme.weights, module)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(tree, "pack-quantized")
    compressor.compress_model(tree)
    dst.mkdir(parents=True)
    save_file({**{n: t.contiguous() for n, t in tree.state_dict().items()}, **rest}, dst / "model.safetensors")
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    compressor.update_config(str(dst))
    return dst


def _submodule(root: nn.Module, path: str) -> nn.Module:
    m = root
    for part in filter(None, path.split(".")):
        if not hasattr(m, part):
            m.add_module(part, nn.Module())
        m = getattr(m, part)
    return m


def decompressed_state(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as compressed-tensors' own dequantizer gives them (fp32)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    return CompressedTensorsDequantizer(path, dtype=torch.float32).process(load_file(path / "model.safetensors"))


def transformers_reference(path: Path, work: Path):
    """transformers' model (fp32, eval) on :func:`decompressed_state`: written as a 16-bit checkpoint, loaded
    with ``from_pretrained`` (which maps each family's checkpoint names itself)."""
    from transformers import AutoModelForCausalLM

    work.mkdir(parents=True)
    save_file(decompressed_state(path), work / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    (work / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).eval()
