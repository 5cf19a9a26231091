"""Recording a :class:`~moeflow.trace.format.Trace` from a model: forward hooks on the embeddings and on each
MoE block and its router (the routing recomputed with the block's own router function), one sequence at a
time. The model is not changed; any offload policy records the same routing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeflow.trace.format import DECODE, PREFILL, Trace, TraceError


class TraceRecorder:
    """Forward hooks that capture, for each forward pass, the embeddings, MoE inputs and routing.

    Use as a context manager around ``model.generate`` / ``model(...)`` of a
    :class:`~moeflow.api.MoEModel` (batch size 1). ``steps`` holds one dict per
    forward pass: ``input_ids`` [T], ``embed`` [T, H], ``hidden`` [L][T, H], ``probs`` [L][T, E],
    ``topk`` [L][T, k].
    """

    def __init__(self, model, hidden: bool = False, embed: bool = False) -> None:
        self.model = model
        inner = model.model
        self.blocks = inner.moe_blocks
        self.want_hidden, self.want_embed = hidden, embed
        self.steps: list[dict] = []
        self._pending: int | None = None  # layer whose router call is the next gate call to record
        self._handles: list = []
        self._embed_module = inner.embed_tokens

    def __enter__(self) -> TraceRecorder:
        self._handles.append(self._embed_module.register_forward_hook(self._on_embed))
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._make_block_hook(block.layer_idx)))
            self._handles.append(block.gate.register_forward_hook(self._make_gate_hook(block.layer_idx, block.route)))
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

    def _make_gate_hook(self, idx: int, route):
        def hook(module, inputs, output) -> None:
            if self._pending != idx:  # a speculative call of this router (prefetching), not the routing
                return
            self._pending = None
            probs, ids, _ = route(output.detach())
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

    model: a :class:`~moeflow.api.MoEModel` (any offload policy; routing is the
    same). ``hidden`` records the MoE-layer inputs; ``embed`` (default: same as ``hidden``) the token
    embeddings.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    embed = hidden if embed is None else embed
    family = model.family
    L, E, k, H = len(family.moe_layers), family.num_experts, family.router_spec().top_k, model.config.hidden_size
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
