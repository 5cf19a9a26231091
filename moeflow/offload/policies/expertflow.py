"""ExpertFlow's Expert Cache Engine: Predictive Locality-aware Expert Caching (PLEC) with real-time correction.

``OffloadConfig(policy="expertflow")`` (ExpertFlow §3.2):

* **Prediction before the pass.** ``begin_step`` (the engine calls it before layer 0) reads each sequence's
  tokens so far from the :class:`~moeflow.moe.backend.StepInfo` (``history_ids``: the engine keeps them by
  KV-cache row, so regrouped micro-batches keep their history) and runs the routing-path predictor
  (:mod:`moeflow.offload.predictors.expertflow`) once: the step's plan
  is the OR over its tokens of each token's predicted path (top-k per layer), experts of a layer ranked by
  summed score.
* **Prefetch across the whole slot budget** (§3.2.1). Right after the prediction, and again at every layer's
  gate (``propose``), the planned experts of the layers still ahead are queued in layer order, as many as
  the pool can take without evicting a planned expert of a nearer layer: there is no per-layer share, a
  layer with many predicted experts takes what the others leave.
* **Real-time correction** (§3.2.2). A missed expert is loaded at high priority by the runtime; the slot it
  takes is chosen by :class:`PLECEviction`, in this order:

  0. mis-prefetched experts: loaded ahead of their gate and not used since (predicted, but the gate passed
     without them, or no longer planned);
  1. experts of layers still ahead that the plan predicts idle for this step;
  2. experts whose compute for this step is done (layers already passed), the one whose layer comes back
     last first (the layer just computed), then the least frequently used;
  3. last resort: planned experts of layers still ahead, the farthest layer first.

  The paper names classes 0 and 2 (in that order); class 1 is our addition: such an expert is neither
  mis-prefetched nor done, and by the prediction its next use is further away than a done expert's.

Where the prediction runs before layer 0, layer 0's prefetches are issued just before its gate (on a GPU
they overlap the embedding and attention of layer 0 only; the paper's dual-batch pipeline, which predicts
the next micro-batch during the current one, is not built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moeflow.moe.backend import StepInfo
from moeflow.offload.eviction import EvictionPolicy, Key
from moeflow.offload.policies.files import load_policy_predictor
from moeflow.offload.policies.spec import PolicyContext, PolicySpec
from moeflow.offload.predictors.interface import Predictor


class PLECState:
    """What the predictor side and the eviction side share: the step's plan and its progress."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.plan: dict[int, list[int]] = {}  # layer -> planned experts, most likely first
        self.planned: dict[Key, int] = {}  # (layer, expert) -> rank within its layer
        self.pass_no = 0
        self.layer_now = -1  # last layer whose gate ran in this pass (-1: before layer 0)
        self.started = False  # False during the warm start (those loads are not prefetches)
        self.accessed: dict[Key, int] = {}  # key -> pass of its last gate access
        self.prefetched: set[Key] = set()  # loaded ahead of the gate, not used since

    def new_pass(self, plan: dict[int, list[int]]) -> None:
        self.pass_no += 1
        self.layer_now = -1
        self.started = True
        self.plan = plan
        self.planned = {(layer, e): r for layer, es in plan.items() for r, e in enumerate(es)}

    def eviction_class(self, key: Key, layer_now: int) -> tuple:
        """Sort key of PLEC's correction order (the smallest is replaced first); see the module docstring."""
        layer = key[0]
        L = self.num_layers
        if layer > layer_now and key in self.planned:
            return (3, -layer, -self.planned[key])
        if key in self.prefetched:
            return (0,)
        if layer > layer_now:
            return (1, -(L + layer - layer_now))
        return (2, -(((layer - layer_now - 1) % L) + 1))


class PLECEviction(EvictionPolicy):
    """PLEC's replacement order (real-time correction); ties by frequency, then recency."""

    name = "plec"

    def __init__(self, state: PLECState) -> None:
        super().__init__()
        self.state = state

    def access(self, key: Key) -> None:
        super().access(key)
        self.state.accessed[key] = self.state.pass_no
        self.state.prefetched.discard(key)

    def loaded(self, key: Key) -> None:
        super().loaded(key)
        s = self.state
        demand = s.accessed.get(key) == s.pass_no and key[0] == s.layer_now
        if s.started and not demand:
            s.prefetched.add(key)

    def evicted(self, key: Key) -> None:
        self.state.prefetched.discard(key)

    def order(self, key: Key, layer_now: int | None = None) -> tuple:
        now = self.state.layer_now if layer_now is None else layer_now
        return (*self.state.eviction_class(key, now), self.freq.get(key, 0), self.last_use.get(key, 0))

    def victim(self, candidates: Sequence[Key], layer_now: int) -> Key:
        return min(candidates, key=lambda k: self.order(k, layer_now))


class PLECPredictor(Predictor):
    """The runtime side of PLEC: predicts each pass's path from the token ids and proposes prefetches."""

    def __init__(self, predictor: Any, state: PLECState) -> None:
        self.predictor = predictor  # ExpertFlowPredictor
        self.state = state
        self.backend: Any = None
        self._planned = False  # begin_step planned the pass that is starting

    # ------------------------------------------------------------------ wiring
    def bind(self, runtime: Any) -> None:
        """The runtime's backend (its cache and ``prefetch``)."""
        self.backend = runtime

    def predict_paths(self, step: StepInfo, last_only: bool = False) -> torch.Tensor:
        """bool [B, L, E] of ``step``'s sequences from their tokens so far (ExpertFlowPredictor.predict_paths)."""
        ids = step.history_ids if step.history_ids is not None else step.input_ids
        mask = step.history_mask if step.history_ids is not None else step.token_mask
        return self.predictor.predict_paths(ids, mask, last_only=last_only)

    # ------------------------------------------------------------------ the pass
    def begin_step(self, step: StepInfo) -> None:
        """Plan the pass: the OR over its tokens of each token's predicted path, then prefetch ahead."""
        if step.history_ids is None:
            raise ValueError("the expertflow policy predicts from the tokens so far: StepInfo.history_ids is None")
        hist, valid = step.history_ids.cpu(), step.history_mask.cpu()
        mask = step.token_mask.cpu()
        L, E = self.state.num_layers, self.state.num_experts
        mass = torch.zeros(L, E)
        active = torch.zeros(L, E, dtype=torch.bool)
        for i in range(hist.shape[0]):
            new = int(mask[i].sum())
            if new == 0:
                continue
            context = hist[i][valid[i]]
            scores = self.predictor.token_scores(context, new).cpu()  # [new, L, E]
            paths = self.predictor.token_paths(scores)
            active |= paths.any(0)
            mass += (scores * paths).sum(0)
        plan = {layer: [e for e in torch.argsort(mass[layer], descending=True).tolist() if active[layer, e]]
                for layer in range(L)}
        self.state.new_pass(plan)
        self._planned = True
        self._prefetch_ahead(-1)

    def _budget_targets(self, layer_now: int) -> list[tuple[int, list[int]]]:
        """Planned experts of layers after ``layer_now`` not resident yet, as many as the pool can take without
        evicting a planned expert: [(layer, experts)] in layer order."""
        if self.backend is None:
            return []
        cache = self.backend.cache
        free = 0
        for s in cache.slots:
            if s.in_use:
                continue
            if s.key is None:
                free += 1
            elif s.task is None and self.state.eviction_class(s.key, layer_now)[0] < 3:  # READY, not planned ahead
                free += 1
        out = []
        for layer in range(layer_now + 1, self.state.num_layers):
            if free <= 0:
                break
            want = [e for e in self.state.plan.get(layer, []) if cache.lookup((layer, e)) is None][:free]
            if want:
                out.append((layer, want))
                free -= len(want)
        return out

    def _prefetch_ahead(self, layer_now: int) -> None:
        backend = self.backend
        if backend is None:
            return
        for target, experts in self._budget_targets(layer_now):
            backend.prefetch(target, experts, layer_now)

    # ------------------------------------------------------------------ Predictor protocol
    def observe(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if layer == 0 and not self._planned:  # driven without begin_step (simulator, unit tests): popularity
            pop = self.predictor.popularity.cpu()
            k = self.predictor.shape.top_k
            self.state.new_pass({t: torch.topk(pop[t], k).indices.tolist() for t in range(pop.shape[0])})
        self._planned = False
        self.state.layer_now = layer

    def propose(self, layer: int, x: torch.Tensor) -> list[tuple[int, list[int]]]:
        """The plan's experts for the layers ahead, as host lists: the plan lives on the host, nothing to read back."""
        if self.backend is None:  # without the hook: the plan's next layers, best effort
            targets = [(t, self.state.plan.get(t, [])) for t in range(layer + 1, self.state.num_layers)]
        else:
            self.backend.cache.poll()
            targets = self._budget_targets(layer)
        return [(t, list(es)) for t, es in targets if es]


# ---------------------------------------------------------------------- the policy
def make_plec_predictor(ctx: PolicyContext) -> PLECPredictor:
    """The expertflow predictor from ``OffloadConfig.predictor_path`` or ``<checkpoint>/predictors/expertflow.pt``."""
    pred = load_policy_predictor(ctx, "expertflow")
    return PLECPredictor(pred, PLECState(ctx.num_layers, ctx.num_experts))


def make_plec_eviction(ctx: PolicyContext) -> PLECEviction:
    """PLEC's correction order over the predictor's plan (``ctx.predictor``, made first)."""
    pred = ctx.predictor
    state = pred.state if isinstance(pred, PLECPredictor) else PLECState(ctx.num_layers, ctx.num_experts)
    return PLECEviction(state)


EXPERTFLOW = PolicySpec(
    "expertflow", "ExpertFlow PLEC: routing paths predicted from the token ids before each pass, prefetched across "
                  "the whole slot budget; misses replace mis-prefetched experts first, then idle and finished ones",
    eviction=make_plec_eviction, predictor=make_plec_predictor,
)
