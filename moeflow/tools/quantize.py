"""``moeflow quantize``: convert an fp32/fp16/bf16 HF checkpoint into an AWQ 4-bit checkpoint.

Which tensors are experts, and the per-expert names they are written under, is the model family's
(:meth:`~moeflow.families.base.Family.expert_linears`). Experts are quantized with round-to-nearest (zero
point, per group of input features); the router, norms, embeddings, lm_head (and attention, unless asked)
stay in 16 bits. Output goes to a temporary directory renamed at the end, so an interrupted run leaves
nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from moeflow.errors import CheckpointError
from moeflow.families import Family, family_for_config
from moeflow.io.checkpoint import CheckpointReader, read_json, resolve_checkpoint
from moeflow.quant.awq import check_group_size, quantize_rtn
from moeflow.quant.fp8 import Fp8BlockReader, fp8_block_spec

COPY_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model")
SHARD_BYTES = 4 * 2**30


def _awq(prefix: str, weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    t = quantize_rtn(weight, group_size)
    return {f"{prefix}.qweight": t.qweight, f"{prefix}.qzeros": t.qzeros, f"{prefix}.scales": t.scales}


def converted_tensors(
    reader: CheckpointReader, family: Family, group_size: int, dtype: torch.dtype, quantize_attention: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the output tensors, a few at a time (one source tensor's worth)."""
    num_layers = family.config.num_hidden_layers
    last = num_layers + family.num_mtp_layers()  # the MTP layers are kept, their experts quantized too
    for name in sorted(reader.names()):
        if past_last_layer(name, last) or (past_last_layer(name, num_layers) and name.endswith(MTP_COPIES)):
            continue  # (layers past those config.json declares; the MTP layers' copies of the embedding and head)
        experts = family.expert_linears(name, reader)
        if experts is not None:
            out: dict[str, torch.Tensor] = {}
            for prefix, weight in experts:
                out.update(_awq(prefix, weight, group_size))
            yield out
            continue
        attention = family.attention_linear(name)
        if attention is not None and quantize_attention:
            yield _awq(attention, reader.get(name), group_size)
            continue
        tensor = reader.get(name)
        yield {family.quantized_name(name): tensor.to(dtype) if tensor.is_floating_point() else tensor}


MTP_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")  # never read: the main model's are shared


def past_last_layer(name: str, num_layers: int) -> bool:
    """``model.layers.N.*`` with N >= num_hidden_layers (DeepSeek-V3's and GLM-4.5's MTP layers)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    group_size: int = 128,
    dtype: torch.dtype = torch.float16,
    quantize_attention: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write an AWQ 4-bit copy of the checkpoint ``src`` into ``dst``; returns ``dst``."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype}: the unquantized tensors are kept in float16 or bfloat16")
    src_dir = resolve_checkpoint(src)
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True / --overwrite to replace it)")
    config = read_json(src_dir / "config.json")
    family = family_for_config(config, str(src_dir / "config.json"))
    fp8 = fp8_block_spec(config, src_dir / "config.json")  # FP8 block-scaled weights are dequantized as read
    if (config.get("quantization_config") and fp8 is None) or (src_dir / "quant_config.json").exists():
        raise CheckpointError(f"{src_dir} is already quantized; moeflow quantize needs an unquantized checkpoint "
                              "(or FP8 with block scales)")
    spec = family.expert_spec()  # the experts' sizes (Qwen's moe_intermediate_size, not the dense MLPs')
    check_group_size(group_size, spec.hidden_size, "hidden_size")
    check_group_size(group_size, spec.intermediate_size, "the experts' intermediate size")
    reader = CheckpointReader(src_dir)
    if fp8 is not None:
        reader = Fp8BlockReader(reader, fp8)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should be an ordinary directory
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        names = reader.names()
        for chunk in tqdm(converted_tensors(reader, family, group_size, dtype, quantize_attention), total=len(names),
                          desc="quantizing", unit="tensor", disable=not progress):
            for name, t in chunk.items():
                nbytes = t.numel() * t.element_size()
                if size and size + nbytes > SHARD_BYTES:
                    shards.append({})
                    size = 0
                shards[-1][name] = t.contiguous()
                size += nbytes
        _write_shards(tmp, shards, 0o666 & ~umask)
        config["quantization_config"] = {
            "bits": 4,
            "group_size": group_size,
            "modules_to_not_convert": ["gate"],
            "quant_method": "awq",
            "version": "gemm",
            "zero_point": True,
        }
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in COPY_FILES:
            if (src_dir / f).is_file():
                shutil.copyfile(src_dir / f, tmp / f)  # the umask's mode, as every file written here
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    return dst


def _save(tensors: dict[str, torch.Tensor], path: Path, mode: int) -> None:
    """safetensors' ``save_file``, whose files are private (0600), with ``mode``: the umask's, as other files."""
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, mode)


def _write_shards(directory: Path, shards: list[dict[str, torch.Tensor]], mode: int) -> None:
    if len(shards) == 1:
        _save(shards[0], directory / "model.safetensors", mode)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, directory / fname, mode)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
