"""ExpertFlow's routing-path predictor (ExpertFlow §3.1, §5.2).

A small transformer *encoder* over the model's own token ids (bidirectional self-attention, as the paper
argues against causal decoders) with one classifier head per MoE layer. One pass gives, for every token,
the active/idle status of every expert of every layer (logits ``[T, L, E]``); the loss is binary
cross-entropy per layer (eq. 5), averaged. It needs nothing from the MoE model's forward pass, so the
whole step's routing path is known before layer 0 runs.

Context: the encoder sees a window of at most ``window`` tokens. For a prompt (prefill) the tokens are cut
into consecutive windows and every token sees its whole window, later tokens included (the prompt is known
in full before the step). For a generated token (decode) the window is the ``window`` tokens that end at it
(nothing after it exists yet). Training samples random windows of 1..``window`` tokens, so both uses are
seen in training (a window's last token is the decode case).

What the paper does differently, and why: it uses a T5 encoder-decoder (the decoder cross-attends to the
encoder); here an encoder only (its decoder adds nothing when all tokens of the input are known, and it
keeps the predictor tiny: about 90k parameters for the embedded model). A token's path is the top-k of each
layer's logits (the model activates exactly k); the paper thresholds sigmoid outputs at 0.5.

Batch-level accuracy (eq. 7; its formula was lost in extraction, the prose reads): the true and predicted
batch paths are the bitwise OR over the batch's tokens of the per-token ``[L, E]`` paths;
``accuracy = 1 - hamming(P, P_hat) / (L * E)`` (the share of (layer, expert) entries whose status is
predicted right), averaged over batches. :func:`batch_level_accuracy` also reports recall, precision, IoU
and exact-match of the batch matrices.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from moeflow.moe.backend import StepInfo
from moeflow.offload.predictors.base import (
    ExpertPredictor,
    ModelShape,
    PredictorError,
    ids_to_mask,
    popularity_matrix,
    topk_mask,
)
from moeflow.offload.predictors.eval_mlp import EvalEncoder

BATCH_SIZES = (1, 4, 16, 32)


def seqs_of(trace, shape: ModelShape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids [n], multi-hot paths float [n, L, E]) of every sequence of ``trace``, in position order."""
    out = []
    for _, seq in trace.sequences():
        order = torch.argsort(seq.pos)
        out.append((seq.token_ids[order].long(), ids_to_mask(seq.topk_ids[order].long(), shape.num_experts).float()))
    return out


class PathEncoder(nn.Module):
    """Token + position embeddings, a bidirectional transformer encoder, one Linear(d, E) head per layer."""

    def __init__(self, vocab_size: int, num_layers: int, num_experts: int, d_model: int = 64, n_heads: int = 4,
                 n_blocks: int = 2, d_ff: int = 128, window: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(window, d_model)
        block = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, n_blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.heads = nn.ModuleList(nn.Linear(d_model, num_experts) for _ in range(num_layers))

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """ids int [B, W] (pad: bool [B, W], True = padding) -> logits [B, W, L, E]."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.tok(ids) + self.pos(pos)[None]
        h = self.norm(self.encoder(h, src_key_padding_mask=pad))
        return torch.stack([head(h) for head in self.heads], dim=2)


class ExpertFlowPredictor(ExpertPredictor):
    """Routing paths of every layer from the token ids alone (``predict_paths`` / ``token_scores``).

    In the per-layer predictor interface (``predict(t)``) it gives the current iteration's scores for any
    layer, observations or not; :meth:`begin_tokens` tells it the iteration's tokens (with their context).
    """

    kind = "expertflow"
    needs_routing = False
    needs_history = True  # predict_paths reads each row's tokens so far

    def __init__(self, shape: ModelShape, distance: int = 1, popularity: torch.Tensor | None = None,
                 vocab_size: int = 256, d_model: int = 64, n_heads: int = 4, n_blocks: int = 2, d_ff: int = 128,
                 window: int = 32) -> None:
        super().__init__(shape, distance, popularity)
        if vocab_size < 1 or window < 1:
            raise PredictorError(f"expertflow: vocab_size and window must be >= 1 (got {vocab_size}, {window})")
        self.opts = dict(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_blocks=n_blocks, d_ff=d_ff,
                         window=window)
        self.vocab_size, self.window = vocab_size, window
        self.net = PathEncoder(vocab_size, shape.num_layers, shape.num_experts, d_model, n_heads, n_blocks, d_ff,
                               window).eval()
        self._net_eval = EvalEncoder(self.net)  # the runtime's call: no per-module overhead, bitwise the module
        self._scores: torch.Tensor | None = None  # [T, L, E] of the current iteration

    # ------------------------------------------------------------------ inference
    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise PredictorError(f"expertflow: token ids outside the predictor's vocabulary [0, {self.vocab_size})")

    def _run(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Token windows (1-d, each <= window) -> sigmoid scores [len, L, E] for each, batched."""
        if not windows:
            return []
        dev = self.popularity.device
        if len(windows) == 1:  # a decode step: the window as it is, nothing padded
            ids = windows[0].reshape(1, -1).to(dev, torch.long)
            if torch.is_inference_mode_enabled():  # the runtime's decode step: already under inference_mode
                return [torch.sigmoid(self._net_eval(ids, None).float())[0]]
            with torch.inference_mode():
                return [torch.sigmoid(self._net_eval(ids, None).float())[0]]
        width = max(w.numel() for w in windows)
        ids = torch.zeros((len(windows), width), dtype=torch.long, device=dev)
        pad = torch.ones((len(windows), width), dtype=torch.bool, device=dev)
        for i, w in enumerate(windows):
            ids[i, : w.numel()] = w.to(dev)
            pad[i, : w.numel()] = False
        with torch.inference_mode():  # bitwise no_grad's result, less dispatch bookkeeping
            probs = torch.sigmoid(self._net_eval(ids, pad).float())
        return [probs[i, : w.numel()] for i, w in enumerate(windows)]

    def token_scores(self, context: torch.Tensor, new: int) -> torch.Tensor:
        """Scores [new, L, E] for the last ``new`` tokens of ``context`` (1-d ids of one sequence).

        ``new == 1`` (decode): the window of ``window`` tokens ending at the token. Otherwise (a prompt):
        the ``new`` tokens in consecutive windows, each token seeing its whole window.
        """
        context = context.reshape(-1).long()
        if new < 1 or new > context.numel():
            raise PredictorError(f"expertflow: {new} new tokens in a context of {context.numel()}")
        # only the tokens the encoder reads are checked: a decode step's cost stays flat as the context grows
        if new == 1:
            window = context[-self.window:]
            self._check_ids(window)
            return self._run([window])[0][-1:]
        toks = context[-new:]
        self._check_ids(toks)
        windows = [toks[i : i + self.window] for i in range(0, new, self.window)]
        return torch.cat(self._run(windows))

    def sequence_scores(self, token_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """A traced sequence (1-d ids, the first ``prompt_len`` the prompt, then one token per decode step)
        -> scores [N, L, E], each row predicted as the runtime would (prompt windows, then decode windows)."""
        token_ids = token_ids.reshape(-1).long()
        self._check_ids(token_ids)
        out = [self.token_scores(token_ids[:prompt_len], prompt_len)] if prompt_len else []
        decode = [token_ids[max(0, p + 1 - self.window): p + 1] for p in range(prompt_len, token_ids.numel())]
        for i in range(0, len(decode), 256):
            out += [s[-1:] for s in self._run(decode[i : i + 256])]
        return torch.cat(out) if out else torch.zeros(0, *self.popularity.shape)

    def token_paths(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores [..., L, E] -> bool paths [..., L, E]: each token's top-k per layer."""
        return topk_mask(scores.reshape(-1, scores.shape[-1]), self.shape.top_k).reshape(scores.shape)

    def predict_paths(self, input_ids: torch.Tensor | StepInfo, attention_mask: torch.Tensor | None = None,
                      last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] (left-padded; attention_mask [B, T], 1 = real) -> bool [B, L, E]: the path of each
        sequence's next step, the OR over the tokens that step processes (every real token of the prompt,
        or with ``last_only`` only the last token, as in a decode step). A :class:`StepInfo` (the runtime's
        call) stands for its tokens so far (``history_ids`` / ``history_mask``)."""
        if isinstance(input_ids, StepInfo):
            step = input_ids
            last_only = bool(attention_mask) if isinstance(attention_mask, bool) else last_only
            if step.history_ids is not None:
                input_ids, attention_mask = step.history_ids, step.history_mask
            else:
                input_ids, attention_mask = step.input_ids, step.token_mask
        if input_ids.dim() != 2:
            raise PredictorError(f"predict_paths: input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise PredictorError(f"predict_paths: attention_mask has shape {tuple(attention_mask.shape)}, "
                                 f"input_ids {tuple(input_ids.shape)}")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
        L, E = self.shape.num_layers, self.shape.num_experts
        out = torch.zeros((input_ids.shape[0], L, E), dtype=torch.bool)
        for b in range(input_ids.shape[0]):
            ids = input_ids[b][mask[b].to(input_ids.device)].cpu()
            if ids.numel() == 0:
                continue
            scores = self.token_scores(ids, 1 if last_only else ids.numel())
            out[b] = self.token_paths(scores).any(0).cpu()
        return out

    # ------------------------------------------------------------------ per-layer interface
    def begin_tokens(self, context: torch.Tensor, new: int) -> torch.Tensor:
        """Start an iteration over the last ``new`` tokens of ``context``; returns their scores [new, L, E]."""
        self.begin_iteration()
        self._scores = self.token_scores(context, new)
        return self._scores

    def predict(self, target_layer: int) -> torch.Tensor:
        L = self.shape.num_layers
        if not 0 <= target_layer < L:
            raise PredictorError(f"predict(target_layer={target_layer}): layer outside [0, {L})")
        if self._scores is None:
            return self.prior(target_layer)
        return self._scores[:, target_layer]

    def _clear_iteration(self) -> None:
        super()._clear_iteration()
        self._scores = None

    def _move(self, device: torch.device) -> None:
        self.net.to(device)
        self._net_eval.reset()

    # ------------------------------------------------------------------ training
    @classmethod
    def fit(cls, trace, distance: int = 1, epochs: int = 30, batch_size: int = 64, lr: float = 1e-3,
            weight_decay: float = 0.01, seed: int = 0, max_seconds: float | None = None,
            vocab_size: int | None = None, **net: Any) -> ExpertFlowPredictor:
        """Train on ``trace``'s training rows: random windows of 1..window tokens of a sequence, BCE per layer
        on every token's top-k; Adam (lr 1e-3, weight decay 0.01) with a cosine schedule, as the paper."""
        start = time.perf_counter()
        shape = ModelShape.from_trace(trace)
        if len(trace) == 0:
            raise PredictorError(f"{trace.source}: the trace holds no tokens")
        vocab = vocab_size or int(trace.token_ids.max()) + 1
        with torch.random.fork_rng():  # seeded initialisation and dropout, the caller's RNG untouched
            torch.manual_seed(seed)
            self = cls(shape, distance, popularity_matrix(trace.topk_ids, shape.num_experts), vocab_size=vocab,
                       **net)
            self._train(seqs_of(trace, shape), epochs, batch_size, lr, weight_decay, seed, max_seconds, start)
        return self

    def _train(self, seqs: list, epochs: int, batch_size: int, lr: float, weight_decay: float, seed: int,
               max_seconds: float | None, start: float) -> None:
        shape = self.shape
        W = self.window
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.tensor([s[0].numel() for s in seqs], dtype=torch.float64)
        n_tokens = int(lengths.sum())
        per_epoch = max(1, math.ceil(n_tokens / max(1, W // 2) / batch_size))
        total = max(1, epochs * per_epoch)
        opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
        loss_fn = nn.BCEWithLogitsLoss(reduction="none")
        self.net.train()
        losses: list[float] = []
        steps = 0
        for _ in range(total):
            pick = torch.multinomial(lengths, batch_size, replacement=True, generator=gen).tolist()
            ids = torch.zeros((batch_size, W), dtype=torch.long)
            y = torch.zeros((batch_size, W, shape.num_layers, shape.num_experts))
            pad = torch.ones((batch_size, W), dtype=torch.bool)
            for i, s in enumerate(pick):
                tok, path = seqs[s]
                n = int(torch.randint(1, min(W, tok.numel()) + 1, (1,), generator=gen))
                a = int(torch.randint(0, tok.numel() - n + 1, (1,), generator=gen))
                ids[i, :n], y[i, :n], pad[i, :n] = tok[a : a + n], path[a : a + n], False
            logits = self.net(ids, pad)
            per = loss_fn(logits, y).mean(dim=(2, 3))  # [B, W]: BCE per layer, averaged over layers
            loss = per[~pad].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            steps += 1
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
        self.net.eval()
        self.train_info.train_tokens = n_tokens
        self.train_info.train_seconds = time.perf_counter() - start
        tail = losses[-per_epoch:]
        self.train_info.notes = {"steps": steps, "final_loss": sum(tail) / len(tail), "parameters":
                                 sum(p.numel() for p in self.net.parameters())}

    # ------------------------------------------------------------------ evaluation
    def trace_scores(self, trace) -> torch.Tensor:
        """Scores [N, L, E] for every row of ``trace``, each as the runtime would predict it."""
        out = torch.zeros(len(trace), self.shape.num_layers, self.shape.num_experts)
        for seq in trace.sequence_ids():
            rows = torch.nonzero(trace.seq_id == seq).flatten()
            order = rows[torch.argsort(trace.pos[rows])]
            prompt_len = int((trace.phase[order] == 0).sum())
            out[order] = self.sequence_scores(trace.token_ids[order], prompt_len).float().cpu()
        return out

    def evaluate_trace(self, trace, phase: str = "all"):
        """EvalResult over every (token, layer) pair (all layers are predicted before the pass)."""
        from moeflow.offload.predictors.evaluate import EvalResult, Tally

        if phase not in ("all", "prefill", "decode"):
            raise ValueError(f"phase={phase!r}: expected 'all', 'prefill' or 'decode'")
        start = time.perf_counter()
        res = EvalResult()
        pred = self.token_paths(self.trace_scores(trace))
        actual = trace.topk_mask()
        keep = torch.ones(len(trace), dtype=torch.bool) if phase == "all" else \
            trace.phase == (0 if phase == "prefill" else 1)
        res.tokens = int(keep.sum())
        for t in range(self.shape.num_layers):
            res.ahead.add(pred[keep, t], actual[keep, t])
            res.per_layer.setdefault(t, Tally()).add(pred[keep, t], actual[keep, t])
        res.seconds = time.perf_counter() - start
        return res

    # ------------------------------------------------------------------ persistence
    def config(self) -> dict[str, Any]:
        return dict(self.opts)

    def _extra_state(self) -> dict[str, Any]:
        return {"net": self.net.state_dict()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        try:
            self.net.load_state_dict(state["net"])
        except (KeyError, RuntimeError) as e:
            raise PredictorError(f"expertflow predictor file: the encoder weights do not fit: {e}") from e
        self.net.eval()
        self._net_eval.reset()


def batch_level_accuracy(pred: torch.Tensor, actual: torch.Tensor, batch_size: int, seed: int = 0) -> dict[str, Any]:
    """Eq. 7 on per-token paths pred, actual bool [N, L, E]: the rows are shuffled (seeded) and cut into
    batches of ``batch_size`` tokens (the last, incomplete batch dropped unless it is the only one); each
    batch's true and predicted paths are the OR over its tokens.

    accuracy: 1 - hamming / (L*E), mean over batches (our reading of eq. 7); recall, precision, iou of the
    active entries; exact: share of batches whose matrices are equal; active: mean true active entries."""
    n = pred.shape[0]
    if n == 0:
        return {"batch_size": batch_size, "batches": 0}
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    nb = max(1, n // batch_size)
    idx = order[: nb * batch_size].reshape(nb, -1) if n >= batch_size else order.reshape(1, -1)
    p = pred[idx].any(1).flatten(1)  # [nb, L*E]
    a = actual[idx].any(1).flatten(1)
    inter, union = (p & a).sum(1).double(), (p | a).sum(1).double()
    return {
        "batch_size": batch_size, "batches": int(idx.shape[0]),
        "accuracy": float((p == a).double().mean()),
        "recall": float(inter.sum() / a.sum().clamp(min=1)),
        "precision": float(inter.sum() / p.sum().clamp(min=1)),
        "iou": float((inter / union.clamp(min=1)).mean()),
        "exact": float((p == a).all(1).double().mean()),
        "active": float(a.sum(1).double().mean()),
    }


def batch_level_report(predictor: ExpertFlowPredictor, trace, batch_sizes=BATCH_SIZES, seed: int = 0,
                       phase: str = "all") -> dict[str, Any]:
    """Eq. 7 figures at each batch size, for the predictor and for the popularity baseline (top-k per layer)."""
    pred = predictor.token_paths(predictor.trace_scores(trace))
    actual = trace.topk_mask()
    if phase != "all":
        keep = trace.phase == (0 if phase == "prefill" else 1)
        pred, actual = pred[keep], actual[keep]
    pop = topk_mask(predictor.popularity.cpu(), predictor.shape.top_k)[None].expand_as(actual)
    return {str(b): {**batch_level_accuracy(pred, actual, b, seed),
                     "popularity_accuracy": batch_level_accuracy(pop, actual, b, seed).get("accuracy"),
                     "popularity_recall": batch_level_accuracy(pop, actual, b, seed).get("recall")}
            for b in batch_sizes}
