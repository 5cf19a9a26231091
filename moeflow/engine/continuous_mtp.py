"""MTP speculation in the serving engine (``ContinuousEngine(num_speculative_tokens=k)``, ``moeflow serve
--speculative mtp --num-speculative-tokens k``): while one greedy sequence decodes alone, a decode pass feeds its
last token and up to k tokens drafted by the model's multi-token-prediction layers (what
``generate(num_speculative_tokens=k)`` drafts, :mod:`moeflow.engine.mtp`), and keeps the draft's longest prefix
that equals the model's argmax plus the model's own next token: the verify pass, the recording (stop tokens, stop
strings, max_tokens cut inside an accepted draft, streamed one token at a time) and the invalidation of rejected
keys are prompt lookup's (:mod:`moeflow.engine.continuous_lookup`). So a greedy reply is plain greedy decoding's.
When not drafting (sampling, penalties, logit bias, a grammar, another sequence decoding or prefilling) the
iteration runs the ordinary decode pass.

What the MTP layer reads. Its input at position i is the main model's final-normed hidden state at i and the token
at i + 1. With the drafter on, every engine pass (prefill chunks, decode passes of any batch, verify passes) runs
the eager decoder and returns its hidden states (``Runner.forward_pass(return_hidden=True)``); they are kept per
row and position (``hidden`` [rows, max_len, H], on the model's device: a KV-cache-sized buffer). The MTP layer
has its own slotted cache of the main cache's rows and length (``cache``). Before drafting, the MTP layer runs over
the positions of the row not yet given to it (``done``: per row; the whole prompt at the first draft, the kept
positions of the last verify pass after a drafted pass, more after passes it did not draft in) up to n - 2 (n: the
sequence's tokens; the last one not fed yet), whose logits at n - 2 give the first draft; chained drafts feed the
layer's normed output and the drafted token at the next positions (keys past ``done``, rewritten by the next
catch-up before any query reads them, as in ``generate``). Positions the prefix cache gave the row (never prefilled
here) have no hidden state: the MTP layer starts after them (its keys there stay invalid), which changes the
drafts, never the tokens.

Linear-attention layers (Qwen3-Next, Qwen3.5-MoE): the row's states are copied before the verify pass; when a draft
is rejected (and the sequence goes on) they are put back and the DeltaNet layers alone run again over the verify
pass's inputs at the kept positions, as ``generate`` does (:mod:`moeflow.engine.linear_rollback`); with a compiled
decode step (which records no layer input) the row runs one more pass over the kept tokens instead.

Limits: eager passes (the engine's CUDA graphs are off with the drafter: ``ContinuousEngine`` refuses
``cuda_graphs=True`` together with it).
"""

from __future__ import annotations

import torch

from moeflow.engine.continuous_lookup import LookupDrafter, settle_verified, verify_inputs
from moeflow.engine.kv_slots import LatentSlotKVCache, SlotKVCache, cache_spec
from moeflow.engine.linear_rollback import LinearInputRecorder
from moeflow.engine.sequence import Sequence
from moeflow.engine.served import DraftHost, ServedModel
from moeflow.families.mtp import MultiTokenPredictor
from moeflow.moe.backend import StepInfo


def mtp_slot_cache(model: ServedModel, mtp: MultiTokenPredictor, rows: int, max_len: int) -> SlotKVCache:
    """A slotted cache for the MTP layers' attention: ``rows`` rows of ``max_len`` positions, one layer per MTP
    layer, latent (MLA) or full-head as the model's own."""
    spec, n = cache_spec(model), len(mtp.layers)
    if spec.latent_dim:
        return LatentSlotKVCache(n, rows, max_len, spec.latent_dim, model.dtype, model.device)
    return SlotKVCache(n, rows, max_len, spec.kv_heads, spec.head_dim, model.dtype, model.device)


def mtp_row_bytes(model: ServedModel, max_len: int) -> int:
    """Bytes one engine row of ``max_len`` positions costs the drafter besides the main KV cache: its hidden states
    (hidden size per position) and the MTP layers' own keys (or latent vectors); ``moeflow serve`` sizes its rows
    with it. 0 for a model loaded without MTP layers."""
    if model.mtp is None:
        return 0
    spec, element = cache_spec(model), torch.tensor([], dtype=model.dtype).element_size()
    per_layer = spec.latent_dim if spec.latent_dim else 2 * spec.kv_heads * spec.head_dim
    hidden = model.runner.decoder.norm.weight.shape[-1]
    return (len(model.mtp.layers) * per_layer + hidden) * element * max_len


class MTPEngineDrafter:
    """Drafted decode passes of ``engine`` with the model's MTP layers: up to ``num_tokens`` tokens per pass. Each
    sequence counts ``draft_tokens`` / ``accepted_tokens`` (and the model's stats), as prompt lookup's."""

    def __init__(self, engine: DraftHost, num_tokens: int) -> None:
        """``engine``: the :class:`~moeflow.engine.continuous.ContinuousEngine` that owns this drafter."""
        model = engine.model
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {num_tokens!r}")
        if model.mtp is None:
            field = model.family.mtp_config_field
            raise ValueError(f"num_speculative_tokens: the model was loaded without multi-token-prediction layers "
                             f"({field or 'no config field'}={model.family.num_mtp_layers()}); load it with "
                             "from_pretrained(..., mtp=True)")
        if engine.graphs is not None:
            raise ValueError("num_speculative_tokens runs the engine's passes eagerly (the MTP layers read every "
                             "pass's hidden states): pass cuda_graphs=False (moeflow serve: --cuda-graphs off)")
        self.engine, self.mtp, self.num_tokens = engine, model.mtp, num_tokens
        # linear-attention rows: the DeltaNet layers' inputs of each verify pass (eager decoder only)
        runner = model.runner
        self.recorder = LinearInputRecorder(runner.decoder) \
            if engine.cache.linear is not None and runner.decode_fn is runner.decoder else None
        rows, max_len = engine.cache.rows, engine.cache.max_len
        self.cache = mtp_slot_cache(model, self.mtp, rows, max_len)
        hidden_size = model.runner.decoder.norm.weight.shape[-1]
        self.hidden = torch.zeros((rows, max_len, hidden_size), dtype=model.dtype, device=model.device)
        self.nbytes = self.cache.nbytes + self.hidden.numel() * self.hidden.element_size()
        self.owner = [-1] * rows  # the sequence id whose hidden states and MTP keys a row holds
        # positions [cached_tokens, done) of a row are in the MTP cache (the prefix cache's have no hidden states)
        self.done = [0] * rows

    eligible = staticmethod(LookupDrafter.eligible)

    def store(self, seqs: list[Sequence], pos: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep a pass's hidden states [B, T, H] at the real positions (pos int64 [B, T], mask bool [B, T], host)
        of ``seqs``' rows."""
        for b, seq in enumerate(seqs):
            row = seq.row
            if self.owner[row] != seq.id:  # a new sequence in this row
                self.owner[row] = seq.id
                self.done[row] = seq.cached_tokens
                self.cache.valid[row] = False
            real = mask[b].nonzero().flatten()
            if len(real):
                self.hidden[row, pos[b, real].to(self.hidden.device)] = hidden[b, real.to(hidden.device)]

    def step(self, seq: Sequence) -> bool:
        """One drafted decode pass for ``seq``, the only sequence decoding; False (nothing run) when it is not
        eligible or has no room for a draft."""
        room = seq.params.max_new_tokens - len(seq.generated)
        if not self.eligible(seq) or room < 2 or self.owner[seq.row] != seq.id:
            return False
        engine, row = self.engine, seq.row
        tokens = seq.prompt_ids + seq.generated
        n = len(tokens)  # the last token, at n - 1, is not fed yet; hidden states cover [start, n - 1)
        if n - 1 <= self.done[row]:  # (never after a pass of this row: it feeds at least one kept token)
            return False
        draft = propose(self, row, tokens, min(self.num_tokens, room - 1))
        ids, pos, real = verify_inputs(tokens[-1], draft, n - 1, 1 + len(draft), engine.cache.max_len)
        linear = engine.cache.linear
        saved = (linear.conv[:, row].clone(), linear.recurrent[:, row].clone()) if linear is not None else None
        if self.recorder is not None and saved is not None:
            with self.recorder:
                self.recorder.active = True
                logits = engine._pass("decode", [seq], ids, pos, real)[0]  # [1 + c, V] (hidden states stored)
                self.recorder.active = False
        else:
            logits = engine._pass("decode", [seq], ids, pos, real)[0]
        settle_verified(engine, seq, draft, logits, n)
        kept = len(seq.generated) - (n - len(seq.prompt_ids))  # tokens recorded: the inputs whose outputs were kept
        if saved is not None and kept < 1 + len(draft) and not seq.done:  # the states went past the kept tokens
            linear.conv[:, row], linear.recurrent[:, row] = saved
            if self.recorder is not None:  # the DeltaNet layers alone, over the verify pass's inputs
                dev = engine.device
                view = engine.cache.batch(torch.tensor([row], device=dev), pos[:, :kept].to(dev),
                                          real[:, :kept].to(dev))
                self.recorder.replay(view, kept)
            else:  # a compiled decode step records nothing: the kept tokens again, a whole pass
                engine._pass("decode", [seq], ids[:, :kept], pos[:, :kept], real[:, :kept])
        return True

    def run(self, depth: int, row: int, hidden: torch.Tensor, next_ids: list[int], first: int, n: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``depth % layers`` of ``row`` over hidden [1, T, H] and the next tokens ``next_ids`` (T) at
        positions first .. first + T - 1 -> (logits fp32 [V] of the last position, its normed output [1, 1, H]).
        ``n``: the sequence's tokens (the backend's token history: the n - 1 fed ones)."""
        engine, runner = self.engine, self.engine.model.runner
        layer = self.mtp.layers[depth % len(self.mtp.layers)]
        dev, t = engine.device, len(next_ids)
        ids = torch.tensor([next_ids], dtype=torch.long, device=dev)
        pos = torch.arange(first, first + t, device=dev)[None]
        mask = torch.ones((1, t), dtype=torch.bool, device=dev)
        rows = torch.tensor([row], dtype=torch.long, device=dev)
        view = self.cache.batch(rows, pos, mask)
        history = (engine.history.ids[row:row + 1, : n - 1], torch.ones((1, n - 1), dtype=torch.bool, device=dev)) \
            if engine.history is not None else (None, None)
        embeds = runner.decoder.embed_tokens(ids)
        engine.model.stats.set_phase("decode")
        runner.backend.begin_step(StepInfo(ids, pos, mask, "decode", rows, embeds, history[0], history[1],
                                           all_real=True))
        cos, sin = runner.decoder.rotary(pos, embeds.dtype)
        view.mark_valid(pos, mask)
        attn = view.attention_mask(view.cache_position, None)
        x = layer(hidden, embeds, pos, cos, sin, view, view.cache_position, attn, runner.backend)
        out = layer.shared_head(x[:, -1:])
        return runner.decoder.lm_head(out).float()[0, -1].cpu(), out


def propose(drafter: MTPEngineDrafter, row: int, tokens: list[int], k: int) -> list[int]:
    """Up to ``k`` greedy draft tokens for ``row`` holding ``tokens`` (the last not fed yet): the first MTP layer
    over the positions not yet given to it, [done, n - 1), then chained one token at a time."""
    n, first = len(tokens), drafter.done[row]
    hidden = drafter.hidden[row:row + 1, first:n - 1]
    logits, out = drafter.run(0, row, hidden, tokens[first + 1:n], first, n)
    drafter.done[row] = n - 1
    draft = [int(logits.argmax())]
    for depth in range(1, k):
        logits, out = drafter.run(depth, row, out, [draft[-1]], n - 2 + depth, n)
        draft.append(int(logits.argmax()))
    return draft
