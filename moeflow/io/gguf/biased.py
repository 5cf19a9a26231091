"""gpt-oss's experts from a GGUF file: weights with biases beside them.

llama.cpp's converter (``GptOssModel``) writes each layer's experts as ``blk.L.ffn_{gate,up,down}_exps.weight``
``[E, out, in]`` (the published interleaved ``gate_up_proj`` split into gate and up rows) in ggml's MXFP4 (17-byte
blocks: the e8m0 exponent byte, then 16 bytes of nibbles) or, from a bf16 checkpoint, a float type, and the biases
as ``blk.L.ffn_{gate,up,down}_exps.bias`` ``[E, out]`` (fp32).

* :class:`ExpertBiases`: the stacked biases, read once per layer (fp32, exact) and handed out per expert (and
  :meth:`ExpertBiases.exact_in`: whether a format's bias dtype holds them exactly);
* :class:`BiasedConvert`: an expert convert (``ExpertConvert``) adding the biases to another's tensors (the MXFP4
  weights' convert, ``moeflow.engine.loading.mxfp4_expert_tensors``, lives above the kernels it uses).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from moeflow.errors import CheckpointError
from moeflow.io.gguf.experts import ExpertBytes, ExpertConvert
from moeflow.io.gguf.files import GGUFFiles
from moeflow.quant.ggml import dequantize


class ExpertBiases:
    """The expert biases of a GGUF model (``blk.L.ffn_{gate,up,down}_exps.bias`` ``[E, out]``), dequantized in fp32
    (exact) when a layer is first asked for and kept (a few MB: ``E (2I + H)`` values a layer). Thread-safe."""

    def __init__(self, files: GGUFFiles, intermediate: int, hidden: int) -> None:
        self.files, self.intermediate, self.hidden = files, intermediate, hidden
        self._layers: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def layer(self, block: int) -> dict[str, torch.Tensor]:
        """"gate" / "up" -> fp32 [E, I], "down" -> [E, H] of decoder layer ``block``."""
        with self._lock:
            found = self._layers.get(block)
            if found is None:
                found = {p: self._read(block, p, self.hidden if p == "down" else self.intermediate)
                         for p in ("gate", "up", "down")}
                self._layers[block] = found
        return found

    def exact_in(self, dtype: torch.dtype, blocks: tuple[int, ...]) -> bool:
        """Whether every expert bias of decoder layers ``blocks`` survives a round trip through ``dtype`` (a format
        that stores its biases in its scales' dtype, fp16 for Q4_0's, is then exact)."""
        return all(torch.equal(t.to(dtype).float(), t) for b in blocks for t in self.layer(b).values())

    def _read(self, block: int, proj: str, out: int) -> torch.Tensor:
        name = f"blk.{block}.ffn_{proj}_exps.bias"
        info = self.files.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.files.path}: no tensor {name!r} (the expert biases of layer {block})")
        if len(info.shape) != 2 or info.shape[1] != out:
            raise CheckpointError(f"{info.path}: tensor {name!r} has shape {info.shape}, but the metadata implies "
                                  f"[experts, {out}]")
        raw = torch.from_numpy(np.ascontiguousarray(self.files.read(info)))
        return dequantize(raw, info.type.id, f"{info.path}: {name}")

    def __call__(self, expert: ExpertBytes) -> dict[str, torch.Tensor]:
        """``w13_bias`` fp32 [2I] (gate, then up) and ``w2_bias`` [H] of ``expert``."""
        if expert.block < 0 or expert.expert < 0:
            raise ValueError("ExpertBiases needs an ExpertBytes that says its block and expert")
        b = self.layer(expert.block)
        e = expert.expert
        return {"w13_bias": torch.cat([b["gate"][e], b["up"][e]]), "w2_bias": b["down"][e].clone()}


class BiasedConvert:
    """An ``ExpertConvert``: ``weights``' tensors of an expert and its biases (:class:`ExpertBiases`)."""

    def __init__(self, weights: ExpertConvert, biases: ExpertBiases) -> None:
        self.weights, self.biases = weights, biases

    def __call__(self, expert: ExpertBytes, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**self.weights(expert, raw), **self.biases(expert)}
