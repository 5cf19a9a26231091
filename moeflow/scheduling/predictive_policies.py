"""The predictor presets: ``duoserve``, ``promoe``, ``finemoe`` and ``auto`` (docs/policies.md).

Each is a :class:`~moeflow.scheduling.policies.PolicySpec` over the runtime's parts (slot cache, copy engine,
ring, reordered inference) plus a predictor from ``moeflow.scheduling.predictors``:

* ``duoserve`` (DuoServe-MoE §5): prefill streams each layer's missing experts through a ring of k slots
  (``prefill_ring=k``: at most k of a layer's loads hold slots at once; one computes while the next copies),
  cached experts first; decode runs the DuoServe ExpertMLP as a separate prediction step beside the expert
  compute (a side CUDA stream on a GPU) and prefetches its guesses for the next layer once the layer's first
  expert group is computed (the paper's second synchronisation point); a miss at the gate is re-fetched at
  high priority (the runtime's acquire). Global LRU cache.
* ``promoe`` (ProMoE §4-5): the learned per-layer predictor with stride (distance 2 from its file), chunked
  low-priority prefetch, early preemption at the gate, reordered inference, per-layer LRU cache.
* ``finemoe`` (FineMoE §4): Expert Map Store search (semantic search from the token embeddings for the first
  d layers, trajectory search after), δ-threshold prefetch ranked by p / (l − l_now), eviction by
  1 / (p · freq) (``PriorityEviction(LFU(), p · freq)``). Needs no file: the store fills as it serves.
* ``auto``: picks one of the above (or plain LRU when every expert fits) from the slot budget and the
  predictor files at hand; see :func:`choose_policy`.

Predictor files: ``OffloadConfig.predictor_path``, else ``<checkpoint dir>/predictors/<kind>.pt``; a learned
policy without either raises :class:`~moeflow.errors.SchedulingError` saying how to train one.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch

from moeflow.errors import SchedulingError
from moeflow.scheduling.eviction import LFU, EvictionPolicy, PriorityEviction
from moeflow.scheduling.policies import PolicyContext, PolicySpec, register_policy

PREDICTOR_DIR = "predictors"  # inside a checkpoint directory: <kind>.pt


# ------------------------------------------------------------------------------------------ predictor files
def default_predictor_path(ctx: PolicyContext, kind: str) -> Path | None:
    """``<checkpoint dir>/predictors/<kind>.pt`` (None without a checkpoint directory)."""
    if ctx.checkpoint_dir is None:
        return None
    return Path(ctx.checkpoint_dir) / PREDICTOR_DIR / f"{kind}.pt"


def find_predictor_file(ctx: PolicyContext, kind: str) -> Path | None:
    """The predictor file for ``kind``: ``config.predictor_path`` (must exist), else the checkpoint's own."""
    given = ctx.config.predictor_path
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise SchedulingError(f"OffloadConfig.predictor_path={given!r}: no such file")
        return path
    path = default_predictor_path(ctx, kind)
    return path if path is not None and path.is_file() else None


def _train_hint(ctx: PolicyContext, kind: str) -> str:
    model = ctx.checkpoint_dir or "PATH"
    out = default_predictor_path(ctx, kind) or f"{kind}.pt"
    return (f"train one with `moeflow trace --model {model} --prompts prompts.jsonl --out trace.safetensors "
            f"--hidden` then `moeflow train-predictor --kind {kind} --trace trace.safetensors --out {out}`, "
            f"and pass OffloadConfig(predictor_path=...) unless it sits at <checkpoint>/{PREDICTOR_DIR}/{kind}.pt")


def load_policy_predictor(ctx: PolicyContext, kind: str) -> Any:
    """The ``kind`` predictor for the model of ``ctx``, checked against its shape (layers, experts, top-k,
    hidden size), on ``ctx.device``. FineMoE without a file starts with an empty store."""
    from moeflow.scheduling.predictors import PredictorError, read_predictor_blob
    from moeflow.scheduling.predictors.runtime import build_predictor

    path = find_predictor_file(ctx, kind)
    if path is None and kind != "finemoe":
        where = default_predictor_path(ctx, kind)
        looked = f"no predictor file at {where}" if where is not None else "no predictor file given"
        raise SchedulingError(f"policy {ctx.config.policy!r} needs a trained {kind} predictor: {looked}; "
                              + _train_hint(ctx, kind))
    try:
        if path is not None:
            found = str(read_predictor_blob(path)["kind"])
            if found != kind:
                raise SchedulingError(f"policy {ctx.config.policy!r} needs a {kind} predictor, but {path} holds a "
                                      f"{found!r} predictor")
        return build_predictor(kind, ctx, path)
    except PredictorError as e:
        raise SchedulingError(f"policy {ctx.config.policy!r}: {e}") from e


# ------------------------------------------------------------------------------------------ runtime adapters
class OverlappedPredictor:
    """A predictor whose prediction step runs beside the expert compute (DuoServe's prediction stream).

    ``observe`` records the routing and starts predicting the next layer: on CUDA on a side stream that
    first waits for the compute stream, so the ExpertMLP runs while the layer's experts compute; on the
    CPU at once. ``propose`` gives nothing (nothing rides on the routing sync); the backend calls
    :meth:`collect_proposals` after the layer's first expert group is computed, which joins the side
    stream and hands over the guesses.
    """

    def __init__(self, predictor: Any, device: torch.device | str) -> None:
        self.predictor = predictor
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: tuple[int, list[tuple[int, torch.Tensor]]] | None = None

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        pred = self.predictor
        pred.observe(layer, x if pred.needs_hidden else None, probs, topk_ids)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                proposals = pred.propose(layer, x)
        else:
            proposals = pred.propose(layer, x)
        self._pending = (layer, proposals)

    def propose(self, layer: int, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        return []

    def collect_proposals(self, layer: int) -> list[tuple[int, torch.Tensor]]:
        if self._pending is None or self._pending[0] != layer:
            return []
        _, proposals = self._pending
        self._pending = None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return proposals

    def __getattr__(self, name: str) -> Any:  # pred.distance, pred.kind, ... for callers that inspect it
        if "predictor" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["predictor"], name)


class FineMoERuntime:
    """FineMoE in the runtime: each forward pass is announced with its token embeddings.

    A forward hook on ``embed_tokens`` publishes the previous iteration's map (``end_iteration``), starts
    the new one with the embeddings (``begin_iteration``: the semantic search) and prefetches the first
    ``d`` layers' δ-selected experts through :meth:`OffloadedExperts.prefetch`; during the pass the backend's
    ``observe`` / ``propose`` drive the trajectory search for layer ``l + d``.
    """

    def __init__(self, predictor: Any, embed_tokens: torch.nn.Module | None) -> None:
        self.predictor = predictor
        self._backend: Any = None
        self._hook = None
        if embed_tokens is not None:
            self._hook = embed_tokens.register_forward_hook(self._on_embed)

    def bind_backend(self, backend: Any) -> None:
        self._backend = weakref.ref(backend)

    def _on_embed(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        pred = self.predictor
        pred.end_iteration()
        pred.begin_iteration(output.detach().reshape(-1, output.shape[-1]))
        backend = self._backend() if self._backend is not None else None
        if backend is None:
            return
        for target in range(min(pred.distance, pred.shape.num_layers)):
            scores = pred.predict(target)
            mask = pred.predicted_mask(scores, target)
            prio = torch.where(mask, pred.prefetch_priority(scores, target, -1), torch.zeros_like(scores)).sum(0)
            n = int(mask.any(0).sum())
            ids = torch.topk(prio, max(n, 1)).indices.tolist()
            backend.prefetch(target, ids, layer_now=0)

    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        self.predictor.observe(layer, None, probs, topk_ids)

    def propose(self, layer: int, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        return self.predictor.propose(layer, x)

    def eviction_score(self, key: tuple[int, int], layer_now: int = 0) -> float:
        return self.predictor.eviction_score(key, layer_now)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.predictor.close()

    def __getattr__(self, name: str) -> Any:
        if "predictor" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["predictor"], name)

    def __del__(self) -> None:
        hook = self.__dict__.get("_hook")
        if hook is not None:
            hook.remove()


# ------------------------------------------------------------------------------------------ factories
def _duoserve_predictor(ctx: PolicyContext) -> OverlappedPredictor:
    return OverlappedPredictor(load_policy_predictor(ctx, "duoserve"), ctx.device)


def _promoe_predictor(ctx: PolicyContext) -> Any:
    return load_policy_predictor(ctx, "promoe")


def _finemoe_predictor(ctx: PolicyContext) -> FineMoERuntime:
    pred = load_policy_predictor(ctx, "finemoe")
    if torch.device(ctx.device).type == "cuda":
        pred.start_async()  # searches on a worker thread, off the critical path (FineMoE §4.3)
    return FineMoERuntime(pred, ctx.embed_tokens)


def _finemoe_eviction(ctx: PolicyContext) -> EvictionPolicy:
    if ctx.predictor is None:
        raise SchedulingError("the finemoe eviction policy ranks by its predictor's maps, but none was built")
    return PriorityEviction(LFU(), ctx.predictor.eviction_score)


def _duoserve_backend(ctx: PolicyContext) -> dict:
    return {"prefill_ring": ctx.top_k}


def _has_file(ctx: PolicyContext, kind: str) -> bool:
    given = ctx.config.predictor_path
    if given is not None:
        from moeflow.scheduling.predictors import PredictorError, read_predictor_blob

        try:
            return str(read_predictor_blob(given)["kind"]) == kind
        except PredictorError:
            return False
    path = default_predictor_path(ctx, kind)
    return path is not None and path.is_file()


def choose_policy(ctx: PolicyContext) -> str:
    """What ``auto`` runs, from the slot budget and the predictor files at hand (docs/policies.md has the
    measurements behind it):

    * every expert fits: ``lru`` (the warm start loads them all; nothing to predict);
    * fewer slots than one token's experts (L x k): ``duoserve`` with its file (the best decode hit rate at
      that budget; a per-layer split would leave a layer fewer than k slots), else ``mixtral-offloading``
      (needs no file: the model's own routers);
    * otherwise ``promoe`` with its file (the fewest bytes moved and the most useful prefetches of the
      predictor policies), else ``finemoe`` (needs no file: it learns as it serves).

    Prefill is the same in every case: the layer's missing experts stream through the runtime's ring while
    resident ones compute first; only the decode-phase predictor and cache differ.
    """
    if ctx.n_slots >= ctx.num_layers * ctx.num_experts:
        return "lru"
    if ctx.n_slots < ctx.num_layers * ctx.top_k:
        return "duoserve" if _has_file(ctx, "duoserve") else "mixtral-offloading"
    return "promoe" if _has_file(ctx, "promoe") else "finemoe"


PREDICTIVE_PRESETS = (
    PolicySpec(
        "duoserve", eviction="lru", make_predictor=_duoserve_predictor, backend_options=_duoserve_backend,
        description="DuoServe-MoE: prefill streams experts through a k-slot ring; decode prefetches the ExpertMLP's "
                    "next-layer guess, predicted beside the expert compute; misses re-fetched at the gate",
    ),
    PolicySpec(
        "promoe", eviction="lru", per_layer=True, make_predictor=_promoe_predictor,
        description="ProMoE: learned per-layer predictor with stride, chunked prefetch, early preemption, "
                    "reordered inference, per-layer LRU cache",
    ),
    PolicySpec(
        "finemoe", eviction="lfu", make_predictor=_finemoe_predictor, make_eviction=_finemoe_eviction,
        description="FineMoE: expert-map search (semantic, then trajectory), delta-threshold prefetch by "
                    "p/(l - l_now), eviction by 1/(p*freq)",
    ),
    PolicySpec(
        "auto", select=choose_policy,
        description="picks lru / duoserve / promoe (or, without files, mixtral-offloading / finemoe) from the slot "
                    "budget",
    ),
)

for _spec in PREDICTIVE_PRESETS:
    register_policy(_spec, replace=True)
