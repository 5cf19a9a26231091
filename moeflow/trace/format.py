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

Recording needs no change to the model: hooks on ``model.model.embed_tokens`` (embeddings and input
ids), on each ``layers[l].block_sparse_moe`` (pre-hook: the MoE input) and on its ``gate`` (router
logits, routed with :func:`moeflow.moe.route` exactly as the block does).
"""

from __future__ import annotations

import hashlib
import json
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


# ---------------------------------------------------------------------- recording
class TraceRecorder:
    """Forward hooks that capture, for each forward pass, the embeddings, MoE inputs and routing.

    Use as a context manager around ``model.generate`` / ``model(...)`` of a
    :class:`~moeflow.models.offloaded.MoEOffloadedMixtral` (batch size 1). ``steps`` holds one dict per
    forward pass: ``input_ids`` [T], ``embed`` [T, H], ``hidden`` [L][T, H], ``probs`` [L][T, E],
    ``topk`` [L][T, k].
    """

    def __init__(self, model, hidden: bool = False, embed: bool = False) -> None:
        self.model = model
        inner = model.model
        self.layers = list(inner.layers)
        self.top_k = self.layers[0].block_sparse_moe.top_k
        self.want_hidden, self.want_embed = hidden, embed
        self.steps: list[dict] = []
        self._pending: int | None = None  # layer whose router call is the next gate call to record
        self._handles: list = []
        self._embed_module = inner.embed_tokens

    def __enter__(self) -> TraceRecorder:
        self._handles.append(self._embed_module.register_forward_hook(self._on_embed))
        for idx, layer in enumerate(self.layers):
            block = layer.block_sparse_moe
            self._handles.append(block.register_forward_pre_hook(self._make_block_hook(idx)))
            self._handles.append(block.gate.register_forward_hook(self._make_gate_hook(idx)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_embed(self, module, inputs, output) -> None:
        ids = inputs[0]
        if ids.shape[0] != 1:
            raise TraceError(f"tracing records one sequence at a time; got a batch of {ids.shape[0]}")
        step = {"input_ids": ids[0].detach().to("cpu", torch.int32), "hidden": {}, "probs": {}, "topk": {}}
        if self.want_embed:
            step["embed"] = output[0].detach().to("cpu", torch.float16)
        self.steps.append(step)

    def _make_block_hook(self, idx: int):
        def hook(module, args) -> None:
            self._pending = idx
            if self.want_hidden:
                x = args[0]
                self.steps[-1]["hidden"][idx] = x.reshape(-1, x.shape[-1]).detach().to("cpu", torch.float16)
        return hook

    def _make_gate_hook(self, idx: int):
        from moeflow.moe import route

        def hook(module, inputs, output) -> None:
            if self._pending != idx:  # a speculative call of this router (prefetching), not the routing
                return
            self._pending = None
            probs, ids, _ = route(output.detach(), self.top_k)
            step = self.steps[-1]
            step["probs"][idx] = probs.to("cpu", torch.float16)
            step["topk"][idx] = ids.to("cpu", torch.int32)
        return hook


@dataclass
class _Columns:
    topk: list[torch.Tensor] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    embed: list[torch.Tensor] = field(default_factory=list)
    token_ids: list[torch.Tensor] = field(default_factory=list)
    seq_id: list[torch.Tensor] = field(default_factory=list)
    pos: list[torch.Tensor] = field(default_factory=list)
    phase: list[torch.Tensor] = field(default_factory=list)


def record_trace(
    model,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    max_new_tokens: int = 32,
    hidden: bool = False,
    embed: bool | None = None,
    progress: bool = False,
) -> Trace:
    """Run each prompt (token ids) as prefill then greedy decode and record every processed token.

    model: a :class:`~moeflow.models.offloaded.MoEOffloadedMixtral` (any offload policy; routing is the
    same). ``hidden`` records the MoE-layer inputs; ``embed`` (default: same as ``hidden``) the token
    embeddings.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    embed = hidden if embed is None else embed
    cfg = model.config
    L, E, k, H = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size
    cols = _Columns()
    iterator = enumerate(prompts)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, total=len(prompts), desc="tracing", unit="prompt")
    for seq, prompt in iterator:
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1)
        if ids.numel() == 0:
            raise TraceError(f"prompt {seq} is empty: it needs at least one token")
        with TraceRecorder(model, hidden=hidden, embed=embed) as rec:
            model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        pos = 0
        for step_no, step in enumerate(rec.steps):
            t = step["input_ids"].shape[0]
            missing = [layer for layer in range(L) if layer not in step["topk"]]
            if missing:
                raise TraceError(f"prompt {seq}, forward pass {step_no}: no routing recorded for layers {missing}")
            cols.token_ids.append(step["input_ids"])
            cols.topk.append(torch.stack([step["topk"][layer] for layer in range(L)], dim=1))
            cols.probs.append(torch.stack([step["probs"][layer] for layer in range(L)], dim=1))
            if hidden:
                cols.hidden.append(torch.stack([step["hidden"][layer] for layer in range(L)], dim=1))
            if embed:
                cols.embed.append(step["embed"])
            cols.seq_id.append(torch.full((t,), seq, dtype=torch.int32))
            cols.pos.append(torch.arange(pos, pos + t, dtype=torch.int32))
            cols.phase.append(torch.full((t,), PREFILL if step_no == 0 else DECODE, dtype=torch.int8))
            pos += t
    empty_f16 = torch.zeros(0, L, E, dtype=torch.float16)
    return Trace(
        topk_ids=torch.cat(cols.topk) if cols.topk else torch.zeros(0, L, k, dtype=torch.int32),
        probs=torch.cat(cols.probs) if cols.probs else empty_f16,
        token_ids=torch.cat(cols.token_ids) if cols.token_ids else torch.zeros(0, dtype=torch.int32),
        seq_id=torch.cat(cols.seq_id) if cols.seq_id else torch.zeros(0, dtype=torch.int32),
        pos=torch.cat(cols.pos) if cols.pos else torch.zeros(0, dtype=torch.int32),
        phase=torch.cat(cols.phase) if cols.phase else torch.zeros(0, dtype=torch.int8),
        hidden=torch.cat(cols.hidden) if hidden and cols.hidden else None,
        embed=torch.cat(cols.embed) if embed and cols.embed else None,
        num_layers=L, num_experts=E, top_k=k, hidden_size=H, model=str(getattr(model, "name_or_path", "")),
        metadata={"max_new_tokens": str(max_new_tokens)},
    )


def read_prompts(path: str | Path, tokenizer=None) -> list[list[int]]:
    """Prompts from a JSONL file: one object per line, ``{"prompt": "text"}`` (needs ``tokenizer``) or
    ``{"input_ids": [ints]}``. Blank lines are skipped; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"prompts file {path} does not exist")
    prompts: list[list[int]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{lineno}: expected an object with 'prompt' or 'input_ids'")
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise TraceError(f"{path}:{lineno}: 'input_ids' must be a non-empty list of non-negative integers")
            prompts.append(ids)
        elif "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise TraceError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
            if tokenizer is None:
                raise TraceError(f"{path}:{lineno}: a text prompt needs the model's tokenizer.json, which this "
                                 "checkpoint lacks; give {\"input_ids\": [...]} instead")
            prompts.append(list(tokenizer.encode(obj["prompt"])))
        else:
            raise TraceError(f"{path}:{lineno}: expected a 'prompt' or 'input_ids' key, got {sorted(obj)}")
    if not prompts:
        raise TraceError(f"prompts file {path} holds no prompts")
    return prompts
