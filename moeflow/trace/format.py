"""Routing traces: what every MoE layer chose for every processed token, recorded with forward hooks.

A trace is the one input of predictor training and evaluation (and of the simulator). It is a
safetensors file with, for N processed tokens of L MoE layers, E experts and top-k routing:

======================  ==========  =====================================================================
tensor                  dtype       shape and meaning
======================  ==========  =====================================================================
``topk_ids``            int32       [N, L, k]  experts chosen by each layer's router (most probable first)
``probs``               float16     [N, L, E]  router softmax (fp32 softmax of the gate logits, stored fp16)
``token_ids``           int32       [N]        the input token of the forward pass that processed the row
``seq_id``              int32       [N]        which prompt (sequence) the row belongs to
``pos``                 int32       [N]        position of the token in its sequence (0 = first prompt token)
``phase``               int8        [N]        0 = prefill (prompt tokens), 1 = decode (generated tokens)
``hidden`` (optional)   float16     [N, L, H]  the MoE-layer inputs (post-attention RMSNorm output)
``embed`` (optional)    float16     [N, H]     the token embeddings (embedding-layer output)
======================  ==========  =====================================================================

Metadata (strings): ``format`` (``moeflow-trace``), ``version``, ``num_layers``, ``num_experts``,
``top_k``, ``hidden_size``, ``model`` and, when recorded here, ``max_new_tokens``.

Rows of one sequence are contiguous and ordered by position: the prompt (prefill, one forward pass),
then one row per decode step. Greedy generation of ``n`` new tokens runs ``n - 1`` decode passes
(the last token is produced but never fed back), so a sequence has ``prompt + n - 1`` rows.

Recording from a model is :mod:`moeflow.tools.record`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from moeflow.errors import MoeflowError

TRACE_FORMAT = "moeflow-trace"
TRACE_VERSION = 1
PREFILL, DECODE = 0, 1

# name -> (dtype, dims as named sizes); N tokens, L layers, K top-k, E experts, H hidden
_REQUIRED = {
    "topk_ids": (torch.int32, ("N", "L", "K")),
    "probs": (torch.float16, ("N", "L", "E")),
    "token_ids": (torch.int32, ("N",)),
    "seq_id": (torch.int32, ("N",)),
    "pos": (torch.int32, ("N",)),
    "phase": (torch.int8, ("N",)),
}
_OPTIONAL = {
    "hidden": (torch.float16, ("N", "L", "H")),
    "embed": (torch.float16, ("N", "H")),
}


class TraceError(MoeflowError, ValueError):
    """A trace file or tensor is missing, mis-shaped or inconsistent with the trace's metadata."""


@dataclass
class Trace:
    """A routing trace in memory (see the module docstring for the tensors)."""

    topk_ids: torch.Tensor  # int32 [N, L, k]
    probs: torch.Tensor  # float16 [N, L, E]
    token_ids: torch.Tensor  # int32 [N]
    seq_id: torch.Tensor  # int32 [N]
    pos: torch.Tensor  # int32 [N]
    phase: torch.Tensor  # int8 [N]
    num_layers: int
    num_experts: int
    top_k: int
    model: str = ""
    hidden: torch.Tensor | None = None  # float16 [N, L, H]
    embed: torch.Tensor | None = None  # float16 [N, H]
    hidden_size: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        if self.hidden_size is None:
            for t in (self.hidden, self.embed):
                if t is not None:
                    self.hidden_size = int(t.shape[-1])
                    break
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise :class:`TraceError` naming the tensor whose presence, dtype, shape or values are wrong."""
        where = self.source
        for name, value in (("num_layers", self.num_layers), ("num_experts", self.num_experts),
                            ("top_k", self.top_k)):
            if not isinstance(value, int) or value < 1:
                raise TraceError(f"{where}: metadata {name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise TraceError(f"{where}: metadata top_k={self.top_k} exceeds num_experts={self.num_experts}")
        n = self.topk_ids.shape[0] if isinstance(self.topk_ids, torch.Tensor) and self.topk_ids.dim() else None
        sizes = {"N": n, "L": self.num_layers, "K": self.top_k, "E": self.num_experts, "H": self.hidden_size}
        for name, (dtype, dims) in {**_REQUIRED, **_OPTIONAL}.items():
            t = getattr(self, name)
            if t is None:
                if name in _REQUIRED:
                    raise TraceError(f"{where}: tensor {name!r} is missing")
                continue
            if not isinstance(t, torch.Tensor):
                raise TraceError(f"{where}: {name!r} must be a tensor, got {type(t).__name__}")
            want = tuple(sizes[d] for d in dims)
            if t.dim() != len(dims) or any(w is not None and s != w for s, w in zip(t.shape, want, strict=False)):
                shown = "[" + ", ".join(f"{d}={sizes[d]}" if sizes[d] is not None else d for d in dims) + "]"
                raise TraceError(f"{where}: tensor {name!r} has shape {list(t.shape)}, expected {shown}")
            if t.dtype != dtype:
                raise TraceError(f"{where}: tensor {name!r} has dtype {t.dtype}, expected {dtype}")
        if n:
            lo, hi = int(self.topk_ids.min()), int(self.topk_ids.max())
            if lo < 0 or hi >= self.num_experts:
                raise TraceError(f"{where}: tensor 'topk_ids' holds expert id {lo if lo < 0 else hi}, "
                                 f"outside [0, num_experts={self.num_experts})")
            bad = ~torch.isin(self.phase, torch.tensor([PREFILL, DECODE], dtype=torch.int8))
            if bool(bad.any()):
                raise TraceError(f"{where}: tensor 'phase' holds values other than 0 (prefill) and 1 (decode)")

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def has_hidden(self) -> bool:
        return self.hidden is not None

    @property
    def has_embed(self) -> bool:
        return self.embed is not None

    def shape_dict(self) -> dict[str, int | None]:
        return {"num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k,
                "hidden_size": self.hidden_size}

    def sequence_ids(self) -> list[int]:
        """The distinct sequence ids, in order of first appearance."""
        seen: dict[int, None] = {}
        for s in self.seq_id.tolist():
            seen.setdefault(int(s), None)
        return list(seen)

    def topk_mask(self) -> torch.Tensor:
        """bool [N, L, E]: which experts each layer used for each token."""
        mask = torch.zeros(len(self), self.num_layers, self.num_experts, dtype=torch.bool)
        return mask.scatter_(2, self.topk_ids.long(), True)

    def rows(self, index: torch.Tensor) -> Trace:
        """The trace restricted to rows ``index`` (bool mask [N] or int indices)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return replace(
            self, topk_ids=pick(self.topk_ids), probs=pick(self.probs), token_ids=pick(self.token_ids),
            seq_id=pick(self.seq_id), pos=pick(self.pos), phase=pick(self.phase), hidden=pick(self.hidden),
            embed=pick(self.embed), metadata=dict(self.metadata),
        )

    def select(self, seq_ids: Iterable[int]) -> Trace:
        """The rows of the given sequences (in the trace's order)."""
        wanted = torch.tensor(sorted({int(s) for s in seq_ids}), dtype=torch.int32)
        return self.rows(torch.isin(self.seq_id, wanted))

    def sequences(self) -> Iterator[tuple[int, Trace]]:
        """(seq_id, rows of that sequence) in order of first appearance."""
        for s in self.sequence_ids():
            yield s, self.rows(self.seq_id == s)

    def phase_rows(self, phase: str) -> Trace:
        """``"all"``, ``"prefill"`` or ``"decode"`` rows."""
        if phase == "all":
            return self
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase={phase!r}: expected 'all', 'prefill' or 'decode'")
        return self.rows(self.phase == (PREFILL if phase == "prefill" else DECODE))

    def split(self, eval_fraction: float = 0.1, seed: int = 0) -> tuple[Trace, Trace]:
        """(train, held_out) by whole sequences: a seeded shuffle of the sequence ids, the last
        ``ceil(eval_fraction * S)`` of them held out (at least one when there are two or more)."""
        train_ids, eval_ids = split_sequence_ids(self.sequence_ids(), eval_fraction, seed)
        return self.select(train_ids), self.select(eval_ids)

    def fingerprint(self) -> str:
        """A short hash of what identifies the recorded runs (token ids, sequence ids, routing)."""
        h = hashlib.sha256()
        for t in (self.token_ids, self.seq_id, self.topk_ids):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ files
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, name).contiguous() for name in _REQUIRED}
        out.update({name: getattr(self, name).contiguous() for name in _OPTIONAL if getattr(self, name) is not None})
        return out

    def save(self, path: str | Path) -> Path:
        """Write the trace as safetensors (atomically: a temporary file renamed into place)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {**self.metadata, "format": TRACE_FORMAT, "version": str(TRACE_VERSION),
                "num_layers": str(self.num_layers), "num_experts": str(self.num_experts), "top_k": str(self.top_k),
                "model": self.model}
        if self.hidden_size is not None:
            meta["hidden_size"] = str(self.hidden_size)
        tmp = path.with_name(path.name + ".tmp")
        save_file(self.tensors(), str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read and validate a trace file; a :class:`TraceError` names what is missing or wrong."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise TraceError(f"trace file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise TraceError(f"cannot read trace file {path} (not safetensors, truncated or corrupt?): {e}") from e
        if meta.get("format", TRACE_FORMAT) != TRACE_FORMAT:
            raise TraceError(f"{path}: metadata format={meta['format']!r} is not {TRACE_FORMAT!r}")
        ints = {}
        for key in ("num_layers", "num_experts", "top_k"):
            if key not in meta:
                raise TraceError(f"{path}: metadata {key!r} is missing")
            try:
                ints[key] = int(meta[key])
            except ValueError:
                raise TraceError(f"{path}: metadata {key}={meta[key]!r} is not an integer") from None
        for name in _REQUIRED:
            if name not in tensors:
                raise TraceError(f"{path}: tensor {name!r} is missing")
        hidden_size = int(meta["hidden_size"]) if meta.get("hidden_size", "").isdigit() else None
        extra = {k: v for k, v in meta.items()
                 if k not in ("format", "version", "num_layers", "num_experts", "top_k", "model", "hidden_size")}
        return cls(
            **{name: tensors[name] for name in _REQUIRED},
            hidden=tensors.get("hidden"), embed=tensors.get("embed"), hidden_size=hidden_size,
            model=meta.get("model", ""), metadata=extra, source=str(path), **ints,
        )

    @staticmethod
    def concat(traces: Sequence[Trace]) -> Trace:
        """Rows of several traces of the same model, sequence ids renumbered to stay distinct."""
        if not traces:
            raise ValueError("Trace.concat needs at least one trace")
        first = traces[0]
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in (*_REQUIRED, *_OPTIONAL)}
        offset = 0
        for t in traces:
            if (t.num_layers, t.num_experts, t.top_k) != (first.num_layers, first.num_experts, first.top_k):
                raise TraceError(
                    f"{t.source}: shape {t.shape_dict()} differs from {first.source}: {first.shape_dict()}"
                )
            for name in parts:
                value = getattr(t, name)
                if name == "seq_id":
                    value = value + offset
                parts[name].append(value)
            offset += (int(t.seq_id.max()) + 1) if len(t) else 0
        cat = {n: (torch.cat(v) if all(x is not None for x in v) else None) for n, v in parts.items()}
        return replace(first, **cat, metadata=dict(first.metadata), source="<concat>")


def split_sequence_ids(
    seq_ids: Sequence[int], eval_fraction: float = 0.1, seed: int = 0
) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): seeded shuffle, ``ceil(eval_fraction * S)`` held out (>= 1 when S >= 2)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction}: expected a value in [0, 1)")
    ids = sorted(int(s) for s in seq_ids)
    random.Random(seed).shuffle(ids)
    n_eval = 0 if len(ids) < 2 or eval_fraction == 0 else min(max(math.ceil(eval_fraction * len(ids)), 1), len(ids) - 1)
    held = sorted(ids[len(ids) - n_eval:]) if n_eval else []
    return sorted(ids[: len(ids) - n_eval]), held
