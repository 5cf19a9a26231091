"""A GGUF file read as the HF-layout checkpoint its family expects: :class:`GGUFCheckpointReader`.

The families name tensors as transformers checkpoints do (``model.layers.3.mlp.experts.5.gate_proj.weight``).
This reader answers those names from the GGUF file, so every family's ``checkpoint_name``, ``detect_expert_layout``
and ``read_expert`` work unchanged:

* names: gguf-py's own map for the architecture (``gguf.get_tensor_name_map``: every HF spelling llama.cpp's
  converter accepts -> the GGUF name), after taking the expert index out of a per-expert name
  (``...experts.5.gate_proj`` is row 5 of the stacked ``blk.3.ffn_gate_exps`` ``[E, out, in]``);
* values: dequantized in fp32 by :mod:`moeflow.quant.ggml` (exactly as ggml does), reading only the bytes asked
  for (one expert is a contiguous byte range of its stacked tensor);
* the ``llama`` architecture's q/k rows: llama.cpp's converter permutes them for GGML's interleaved rotary
  (``LlamaModel.permute``); they are permuted back (:func:`unpermute_rope_rows`) to HF's two-halves rotary;
* a GGUF ``[n]`` vector asked for as ``[1, n]`` (Qwen2-MoE's shared-expert gate) is reshaped;
* an HF tensor the file stores as several (deepseek2's ``kv_b_proj`` as ``attn_k_b`` and ``attn_v_b``): joined by
  the architecture's ``joined`` (:class:`~moeflow.io.gguf.config.JoinedTensors`);
* gpt-oss's stacked expert biases (``ffn_{gate,up,down}_exps.bias`` ``[E, out]``) answer per-expert names
  (``...experts.5.gate_proj.bias``), its ``self_attn.sinks`` the converter's ``attn_sinks.weight``;
* the multi-token-prediction (nextn) layers llama.cpp's converter appends past the decoder's blocks (GLM-4.5's
  glm4moe, GLM-4.7-Flash's deepseek2; ``{arch}.nextn_predict_layers``): the name map covers those blocks too, and
  their own tensors (``model.layers.N.eh_proj`` -> ``blk.N.nextn.eh_proj``, ``enorm``, ``hnorm``,
  ``shared_head.norm``, ...) are answered from gguf-py's nextn names even where its map of the architecture lacks
  them (gguf-py 0.19's deepseek2).

The non-expert tensors are dequantized once, at load, into the model dtype: they are read once and are small
next to the experts (the embedding and lm_head are the largest), so keeping them quantized would save little and
need a quantized kernel per layer type. Experts go through :mod:`moeflow.io.gguf.experts` instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from moeflow.errors import CheckpointError
from moeflow.io.checkpoint import CheckpointReader
from moeflow.io.gguf.config import architecture
from moeflow.io.gguf.files import GGUFFiles, TensorInfo, _gguf
from moeflow.io.gguf.mapped import MappedGGUF
from moeflow.io.gguf.nextn import mtp_blocks, nextn_names
from moeflow.quant.ggml import dequantize

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # stored as these dtypes

PER_EXPERT = re.compile(r"^(?P<head>.*\.experts)\.(?P<expert>\d+)\.(?P<tail>.*)$")
SUFFIXES = (".weight", ".bias")


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` on the output rows of q (``n_head`` heads) or k (kv heads):
    w [out, ...] -> [out, ...] (each head's rows back from interleaved pairs to two halves)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpointReader(CheckpointReader):
    """The tensors of ``files`` under the HF names of ``config`` (the dict :func:`gguf_config` made)."""

    def __init__(self, files: GGUFFiles, config: dict) -> None:
        gguf = _gguf()
        self.files, self.config = files, config
        self.directory = files.path.parent
        self.source = str(files.path)
        self.arch = architecture(files.architecture, self.source)
        arch_id = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == files.architecture), None)
        if arch_id is None:
            raise CheckpointError(f"{files.path}: gguf-py {getattr(gguf, '__version__', '')} does not know the "
                                  f"architecture {files.architecture!r}")
        blocks = mtp_blocks(config)  # (the MTP layers' blocks follow the decoder's)
        self.name_map = gguf.get_tensor_name_map(arch_id, int(config["num_hidden_layers"]) + len(blocks))
        self.nextn = nextn_names(gguf, blocks)  # their own tensors (blk.N.nextn.*)
        self.num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        self.weight_map = {name: info.path for name, info in files.tensors.items()}  # by GGUF name: which part
        self._names: list[str] | None = None

    # ------------------------------------------------------------------ names
    def gguf_name(self, name: str) -> tuple[str, int | None] | None:
        """(the GGUF tensor name HF tensor ``name`` maps to, the expert row or None), whether or not the file holds
        it; None when gguf-py's map (and the nextn names) have no such name."""
        expert = None
        if name.endswith("e_score_correction_bias"):  # a buffer, spelled as the converter renames it
            name = name[: -len("_bias")] + ".bias"
        m = PER_EXPERT.match(name)
        if m is not None:
            expert = int(m["expert"])
            name = f"{m['head']}.{m['tail']}"
        found = self.name_map.get_type_and_name(name, try_suffixes=SUFFIXES)
        if found is not None:
            return found[1], expert
        base, dot, suffix = name.rpartition(".")
        return (f"{self.nextn[base]}{dot}{suffix}", expert) if base in self.nextn else None

    def resolve(self, name: str) -> tuple[TensorInfo, int | None] | None:
        """(the GGUF tensor holding HF tensor ``name``, the expert row or None), or None when the file has none."""
        mapped = self.gguf_name(name)
        if mapped is None:
            return None
        gguf_name, expert = mapped
        # (gpt-oss's ``self_attn.sinks`` has no suffix in HF; the converter writes ``attn_sinks.weight``)
        info = self.files.tensors.get(gguf_name) or self.files.tensors.get(f"{gguf_name}.weight")
        if info is None:
            return None
        if expert is not None:  # a row of a stacked [E, out, in] weight or [E, out] bias (gpt-oss)
            if len(info.shape) != (2 if gguf_name.endswith(".bias") else 3) or expert >= info.shape[0]:
                return None
        elif len(info.shape) == 3 and ".experts." in name:  # a stacked tensor asked for whole: not an HF name
            return None
        return info, expert

    def joined_parts(self, name: str) -> list[TensorInfo] | None:
        """The GGUF tensors HF tensor ``name`` is joined from (the architecture's ``joined``), or None when the file
        holds it as one tensor or not at all."""
        parts = self.arch.joined.parts(name) if self.arch.joined is not None else None
        if parts is None or not all(p in self.files.tensors for p in parts) or self.resolve(name) is not None:
            return None
        return [self.files.tensors[p] for p in parts]

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) is not None or self.joined_parts(name) is not None

    def names(self) -> list[str]:
        """Every HF spelling (``model.*``, ``lm_head.*``) of every tensor in the file, experts one by one."""
        if self._names is None:
            by_gguf: dict[str, list[str]] = {}
            for hf, (_kind, gguf_name) in self.name_map.mapping.items():
                if hf.startswith(("model.", "lm_head")):
                    by_gguf.setdefault(gguf_name, []).append(hf)
            for hf, gguf_name in self.nextn.items():
                if hf not in by_gguf.get(gguf_name, []):
                    by_gguf.setdefault(gguf_name, []).append(hf)
            out = []
            for tname, info in self.files.tensors.items():
                base, dot, suffix = tname.rpartition(".")
                for hf in by_gguf.get(base, []):
                    head, _, proj = hf.rpartition(".")
                    if len(info.shape) != 3:
                        out.append(f"{hf}_bias" if hf.endswith("e_score_correction") else f"{hf}{dot}{suffix}")
                    elif head.endswith(".experts"):  # a stacked [E, out, in] tensor: one name per expert
                        out += [f"{head}.{e}.{proj}{dot}{suffix}" for e in range(info.shape[0])]
            if self.arch.joined is not None:
                out += self.arch.joined.names(self.files.tensors)
            self._names = out
        return list(self._names)

    def _info(self, name: str) -> tuple[TensorInfo, int | None]:
        found = self.resolve(name)
        if found is None:
            raise CheckpointError(f"tensor {name!r} is missing from {self.source} (GGUF architecture "
                                  f"{self.files.architecture!r})")
        return found

    def shape(self, name: str) -> tuple[int, ...]:
        joined = self.joined_parts(name)
        if joined is not None:
            return self.arch.joined.shape([p.shape for p in joined])
        info, expert = self._info(name)
        return info.shape[1:] if expert is not None else info.shape

    # ------------------------------------------------------------------ values
    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor ``name`` in fp32 (CPU), dequantized exactly; ``shape``: what config.json implies (checked)."""
        joined = self.joined_parts(name)
        if joined is not None:
            t = self.arch.joined.join([dequantize(torch.from_numpy(np.ascontiguousarray(self.files.read(p))),
                                                  p.type.id, f"{p.path}: {p.name}") for p in joined], self.source)
            if shape is not None and tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"tensor {name!r} (joined from {', '.join(p.name for p in joined)} in "
                                      f"{self.source}) has shape {tuple(t.shape)}, but the metadata implies "
                                      f"{tuple(shape)}")
            return t
        info, expert = self._info(name)
        raw = self.files.read(info, expert, expert + 1) if expert is not None else self.files.read(info)
        if expert is not None:
            raw = raw[0]
        t = dequantize(torch.from_numpy(np.ascontiguousarray(raw)), info.type.id, f"{info.path}: {info.name}")
        if self.arch.rope_permuted and info.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.config["num_attention_heads" if "attn_q" in info.name else "num_key_value_heads"]
            t = unpermute_rope_rows(t, int(heads or self.config["num_attention_heads"]))
        if shape is not None and tuple(t.shape) != tuple(shape):
            if t.numel() == int(np.prod(shape)) and t.dim() == 1:  # [n] stored, [1, n] asked (a gate vector)
                return t.reshape(shape)
            raise CheckpointError(f"tensor {name!r} ({info.name} in {info.path.name}) has shape {tuple(t.shape)}, but "
                                  f"the GGUF metadata implies {tuple(shape)}")
        return t

    def stored_float(self, name: str, shape: tuple[int, ...], mapping: MappedGGUF | None = None
                     ) -> torch.Tensor | None:
        """Tensor ``name`` in the float type the file stores it in (F32, F16, BF16: the same numbers as
        :meth:`get`, without its fp32 copy), a view of ``mapping`` when given (nothing read: an F16 Mixtral
        lm_head is 262 MB read and 524 MB of fp32 written otherwise), else read; None where :meth:`get` has more to
        do (a quantized type, a joined, rope-permuted or expert tensor, another shape). For a caller that quantizes
        the weight next (``load_non_expert_weights``' ``as_stored``)."""
        if self.joined_parts(name) is not None:
            return None
        info, expert = self._info(name)
        dtype = FLOAT_TYPES.get(info.type.name)
        if dtype is None or expert is not None or tuple(info.shape) != tuple(shape) or (
                self.arch.rope_permuted and info.name.endswith(("attn_q.weight", "attn_k.weight"))):
            return None
        if mapping is not None:
            raw = mapping.view(info.path, info.offset, info.nbytes, f"tensor {info.name!r}")
        else:
            raw = torch.from_numpy(np.ascontiguousarray(self.files.read(info))).reshape(-1)
        return raw.view(dtype).view(tuple(shape))

    def close(self) -> None:
        pass


def open_gguf_reader(path: str | Path) -> tuple[GGUFCheckpointReader, dict]:
    """(the reader, config.json as a dict) of the GGUF model at ``path`` (a file; a split set's first part)."""
    from moeflow.io.gguf.config import gguf_config

    files = GGUFFiles(path)
    config = gguf_config(files.metadata, {n: t.shape for n, t in files.tensors.items()}, str(files.path))
    return GGUFCheckpointReader(files, config), config
