"""ExpertFlow's Expert Cache Engine: Predictive Locality-aware Expert Caching (PLEC) with real-time correction.

``OffloadConfig(policy="expertflow")`` (ExpertFlow §3.2):

* **Prediction before the pass.** ``begin_step`` (the engine calls it before layer 0) reads each sequence's
  tokens so far from the :class:`~moeflow.moe.backend.StepInfo` (``history_ids``: the engine keeps them by
  KV-cache row, so regrouped micro-batches keep their history) and runs the routing-path predictor
  (:mod:`moeflow.offload.policies.expertflow.predictor`) once: the step's plan
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

Run alone, the prediction runs before layer 0 and layer 0's prefetches are issued just before its gate. Under
the dual-batch pipeline (:mod:`moeflow.offload.policies.expertflow.pipeline`, §4.1-4.2) the scores arrive precomputed
(``StepInfo.path_scores``) and the plan of the *next* micro-batch is known while this one runs
(``PLECState.upcoming``): once a layer's compute for this pass is done, the next pass's planned experts of that
layer are prefetched into slots nothing of this pass still needs, so the copies of pass t+1 overlap the compute
of pass t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from moeflow.moe.backend import StepInfo
from moeflow.offload.cache import ExpertCache
from moeflow.offload.eviction import EvictionPolicy, Key
from moeflow.offload.policies.expertflow.predictor import ExpertFlowPredictor
from moeflow.offload.policies.expertflow.scheduler import activated_pairs, balanced_split, group_by_routing
from moeflow.offload.predictors.interface import Predictor, PrefetchTarget


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
        # the next pass's plan when already known (the dual-batch pipeline's), polled without blocking
        self.upcoming: Callable[[], dict[int, list[int]] | None] | None = None
        self.next_planned: dict[Key, int] = {}  # of the upcoming plan, once polled in this pass
        self.next_pass_prefetches = 0  # prefetches issued for the next pass during this one (§4.1)
        self.planned_at_start = self.resident_at_start = 0  # planned experts / resident or loading at pass start
        # the same sets as arrays [L, E], for the vectorised victim choice (PLECEviction.pick)
        self.planned_mask = np.zeros((num_layers, num_experts), dtype=bool)
        self.planned_rank = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.next_mask = np.zeros((num_layers, num_experts), dtype=bool)
        self.next_rank = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.prefetched_mask = np.zeros((num_layers, num_experts), dtype=bool)
        # the token scheduler in prefill (Mechanisms.prefill_regroup): passes regrouped, and the (layer, expert)
        # pairs of the predicted paths their two token micro-batches activate, as grouped / in token order
        self.prefill_regroups = self.prefill_pairs = self.prefill_contiguous_pairs = 0

    def new_pass(self, plan: dict[int, list[int]]) -> None:
        self.pass_no += 1
        self.layer_now = -1
        self.started = True
        self.plan = plan
        self.planned = {(layer, e): r for layer, es in plan.items() for r, e in enumerate(es)}
        self.next_planned = {}
        self.planned_mask[:] = False
        self.next_mask[:] = False
        if self.planned:  # one fancy assignment per array instead of two per planned expert
            (layers, experts), ranks = zip(*self.planned.keys(), strict=True), list(self.planned.values())
            self.planned_mask[layers, experts] = True
            self.planned_rank[layers, experts] = ranks

    def mark_prefetched(self, key: Key, prefetched: bool) -> None:
        if prefetched:
            self.prefetched.add(key)
        else:
            self.prefetched.discard(key)
        self.prefetched_mask[key] = prefetched

    def count_resident_at_start(self, cache: ExpertCache | None) -> None:
        """How much of the new plan is resident or loading as the pass starts (§4.1's overlap, measured)."""
        if cache is None:
            return
        self.planned_at_start += len(self.planned)
        self.resident_at_start += sum(1 for key in self.planned if cache.lookup(key) is not None)

    def poll_upcoming(self) -> dict[int, list[int]]:
        """The next pass's plan if the pipeline has it (never waits); {} otherwise."""
        plan = self.upcoming() if self.upcoming is not None else None
        if plan is None:
            return {}
        if not self.next_planned:
            self.next_planned = {(layer, e): r for layer, es in plan.items() for r, e in enumerate(es)}
            for (layer, e), r in self.next_planned.items():
                self.next_mask[layer, e], self.next_rank[layer, e] = True, r
        return plan

    def eviction_class(self, key: Key, layer_now: int) -> tuple:
        """Sort key of PLEC's correction order (the smallest is replaced first); see the module docstring."""
        layer = key[0]
        L = self.num_layers
        if layer > layer_now and key in self.planned:
            return (3, -layer, -self.planned[key])
        if key in self.prefetched and key not in self.next_planned:
            return (0,)
        if layer > layer_now:
            return (1, -(L + layer - layer_now))
        if key in self.next_planned:  # done for this pass, planned for the next: after the done ones
            return (2.5, -self.next_planned[key])
        return (2, -(((layer - layer_now - 1) % L) + 1))


class PLECEviction(EvictionPolicy):
    """PLEC's replacement order (real-time correction); ties by frequency, then recency.

    ``victim`` ranks a candidate list by :meth:`PLECState.eviction_class`; ``pick`` (the cache's call, with its
    evictable flags [L, E]) finds the same victim with a fixed number of array operations over [L, E], whatever
    the number of slots: the class masks, then within the first non-empty class its secondary order (the
    layer, the plan's rank), then frequency and recency, kept here as arrays beside the base's dicts.
    """

    name = "plec"
    vectorise_from = 32  # candidates; below, ranking the list by ``order`` costs less than the array passes

    def __init__(self, state: PLECState) -> None:
        super().__init__()
        self.state = state
        shape = (state.num_layers, state.num_experts)
        self._freq = np.zeros(shape, dtype=np.int64)
        self._last = np.zeros(shape, dtype=np.int64)
        self._layers = np.arange(state.num_layers)[:, None]

    def access(self, key: Key) -> None:
        super().access(key)
        self._freq[key], self._last[key] = self.freq[key], self.last_use[key]
        self.state.accessed[key] = self.state.pass_no
        self.state.mark_prefetched(key, False)

    def loaded(self, key: Key) -> None:
        super().loaded(key)
        self._last[key] = self.last_use[key]
        s = self.state
        demand = s.accessed.get(key) == s.pass_no and key[0] == s.layer_now
        if s.started and not demand:
            s.mark_prefetched(key, True)

    def evicted(self, key: Key) -> None:
        self.state.mark_prefetched(key, False)

    def order(self, key: Key, layer_now: int | None = None) -> tuple:
        now = self.state.layer_now if layer_now is None else layer_now
        return (*self.state.eviction_class(key, now), self.freq.get(key, 0), self.last_use.get(key, 0))

    def victim(self, candidates: Sequence[Key], layer_now: int) -> Key:
        return min(candidates, key=lambda k: self.order(k, layer_now))

    def pick(self, evictable, layer_now, allowed=None, flags=None):  # noqa: D102 (the base's)
        if flags is None or allowed is not None or len(evictable) < self.vectorise_from:
            return super().pick(evictable, layer_now, allowed, flags)  # a few candidates: the list is cheaper
        s = self.state
        ahead = self._layers > layer_now  # [L, 1]
        planned_ahead = ahead & s.planned_mask  # class 3
        misfetched = s.prefetched_mask & ~s.next_mask & ~planned_ahead  # class 0
        classes = (misfetched, ahead & ~planned_ahead & ~misfetched,  # 0, 1 (predicted idle ahead)
                   ~ahead & ~s.next_mask & ~misfetched, ~ahead & s.next_mask, planned_ahead)  # 2, 2.5, 3
        c = next((i for i, cls in enumerate(classes) if (flags & cls).any()), None)
        if c is None:
            return None
        m = flags & classes[c]
        if c in (1, 2, 4):  # the latest layer first
            m &= self._layers == np.flatnonzero(m.any(1))[-1]
        rank = s.next_rank if c == 3 else s.planned_rank if c == 4 else None
        if rank is not None:  # then the plan's least likely first
            m &= rank == rank[m].max()
        idx = np.flatnonzero(m)
        f = self._freq.flat[idx]
        idx = idx[f == f.min()]
        i = int(idx[self._last.flat[idx].argmin()])
        return (i // s.num_experts, i % s.num_experts)


class PLECPredictor(Predictor):
    """The runtime side of PLEC: predicts each pass's path from the token ids and proposes prefetches."""

    needs_history = True  # begin_step plans from each row's tokens so far

    def __init__(self, predictor: ExpertFlowPredictor, state: PLECState, keep_contiguous: bool = True,
                 prefill_regroup: bool = False) -> None:
        """keep_contiguous: the token scheduler's variant (``Mechanisms.keep_contiguous``, :meth:`group`);
        prefill_regroup: regroup a prefill's tokens across its prompts (``Mechanisms.prefill_regroup``,
        :meth:`token_groups`)."""
        self.predictor = predictor
        self.state = state
        self.keep_contiguous, self.prefill_regroup = keep_contiguous, prefill_regroup
        self._token_groups: list[list[int]] | None = None
        self.backend: PrefetchTarget | None = None
        self._planned = False  # begin_step planned the pass that is starting

    # ------------------------------------------------------------------ wiring
    def as_path_planner(self) -> PLECPredictor:
        return self  # step_scores / paths_from_scores / plan_from_scores: the dual-batch pipeline's planner

    def bind(self, runtime: PrefetchTarget) -> None:
        """The backend's loads (their cache and ``prefetch``)."""
        self.backend = runtime

    def predict_paths(self, step: StepInfo, last_only: bool = False) -> torch.Tensor:
        """bool [B, L, E] of ``step``'s sequences from their tokens so far (ExpertFlowPredictor.predict_paths)."""
        ids = step.history_ids if step.history_ids is not None else step.input_ids
        mask = step.history_mask if step.history_ids is not None else step.token_mask
        return self.predictor.predict_paths(ids, mask, last_only=last_only)

    # ------------------------------------------------------------------ the pass
    def step_scores(self, step: StepInfo) -> torch.Tensor:
        """Scores fp32 [B, L, E] of each row's last token (a decode step) from its tokens so far: what the
        dual-batch pipeline computes beside the previous pass (reads the predictor, changes no state)."""
        if step.history_ids is None:
            raise ValueError("the expertflow policy predicts from the tokens so far: StepInfo.history_ids is None")
        hist, valid = step.history_ids.cpu(), step.history_mask.cpu()
        return torch.stack([self.predictor.token_scores(hist[i][valid[i]], 1)[0].cpu()
                            for i in range(hist.shape[0])])

    def group(self, paths: torch.Tensor, micro_batch_size: int) -> list[list[int]]:
        """paths bool [B, L, E] -> micro-batches by the token scheduler (§3.3), the policy's variant of it."""
        return group_by_routing(paths.cpu(), micro_batch_size, keep_contiguous=self.keep_contiguous)

    def paths_from_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores [B, L, E] -> bool paths [B, L, E] (each row's top-k per layer), for micro-batch grouping."""
        return self.predictor.token_paths(scores)

    def plan_from_scores(self, scores: torch.Tensor) -> dict[int, list[int]]:
        """Scores [N, L, E] of a pass's tokens -> its plan: per layer the experts on some token's path, ranked
        by summed score."""
        if scores.shape[0] == 1:  # a decode step: one token's path, without the reductions over tokens
            return self._plan_one(scores[0])
        paths = self.predictor.token_paths(scores)
        active, mass = paths.any(0).tolist(), (scores * paths).sum(0)
        order = torch.argsort(mass, dim=1, descending=True).tolist()  # every layer's row at once
        return {layer: [e for e in order[layer] if active[layer][e]] for layer in range(self.state.num_layers)}

    def _plan_one(self, scores: torch.Tensor) -> dict[int, list[int]]:
        """:meth:`plan_from_scores` of one token, scores [L, E]: the same top-k (``topk_mask``'s call) and the same
        argsort of the same masses (a score, or 0 off the path), the mask built on the host."""
        L, E = scores.shape
        scores = scores.float()
        top = torch.topk(scores, min(self.predictor.shape.top_k, E), dim=-1).indices.numpy()
        active = np.zeros((L, E), dtype=bool)
        active[np.arange(L)[:, None], top] = True
        mass = torch.from_numpy(scores.numpy() * active)  # x * True is x, x * False is 0: the summed masses of one row
        order = torch.argsort(mass, dim=1, descending=True).tolist()
        flags = active.tolist()
        return {layer: [e for e in order[layer] if flags[layer][e]] for layer in range(L)}

    def begin_step(self, step: StepInfo) -> None:
        """Plan the pass: the OR over its tokens of each token's predicted path, then prefetch ahead."""
        self._token_groups = None
        if step.path_scores is not None:  # predicted beside the previous pass (dual-batch pipeline)
            rows = step.token_mask.cpu().any(1)
            plan = self.plan_from_scores(step.path_scores.cpu()[rows])
        else:
            if step.history_ids is None:
                raise ValueError("the expertflow policy predicts from the tokens so far: StepInfo.history_ids "
                                 "is None")
            hist, valid = step.history_ids.cpu(), step.history_mask.cpu()
            new = step.token_mask.cpu().sum(1).tolist()  # tokens this pass processes, per row
            scores = [self.predictor.token_scores(hist[i][valid[i]], n).cpu()
                      for i, n in enumerate(new) if n]  # [new, L, E] each
            L, E = self.state.num_layers, self.state.num_experts
            if len(scores) > 1:
                scores = [torch.cat(scores)]
                if self.prefill_regroup and step.phase == "prefill":
                    self._token_groups = self._regroup_tokens(scores[0])
            plan = self.plan_from_scores(scores[0] if scores else torch.zeros(0, L, E))
        self.state.new_pass(plan)
        self.state.count_resident_at_start(self.backend.cache if self.backend is not None else None)
        self._planned = True
        self._prefetch_ahead(-1)

    def _regroup_tokens(self, scores: torch.Tensor) -> list[list[int]]:
        """ExpertFlow §3.3 on a prefill's tokens, scores fp32 [N, L, E] (every prompt's tokens, row by row): two
        balanced token micro-batches by the Hamming similarity of the predicted paths (the policy's variant of the
        clustering, ``keep_contiguous``). O(N^2) memory (the similarity matrix): for prefills of a few thousand
        tokens."""
        paths = self.predictor.token_paths(scores).cpu()
        size = -(-paths.shape[0] // 2)
        groups = group_by_routing(paths, size, keep_contiguous=self.keep_contiguous)
        st = self.state
        st.prefill_regroups += 1
        st.prefill_pairs += activated_pairs(paths, groups)
        st.prefill_contiguous_pairs += activated_pairs(paths, balanced_split(paths.shape[0], size))
        return groups

    def token_groups(self) -> list[list[int]] | None:
        """This pass's token micro-batches (a prefill of several prompts with ``prefill_regroup``), else None."""
        return self._token_groups

    def _budget_targets(self, layer_now: int) -> list[tuple[int, list[int]]]:
        """Planned experts of layers after ``layer_now`` not resident yet, as many as the pool can take without
        evicting a planned expert: [(layer, experts)] in layer order."""
        if self.backend is None:
            return []
        cache = self.backend.cache
        free = self._free_slots(cache, layer_now)
        out = []
        for layer in range(layer_now + 1, self.state.num_layers):
            if free <= 0:
                break
            want = [e for e in self.state.plan.get(layer, []) if cache.lookup((layer, e)) is None][:free]
            if want:
                out.append((layer, want))
                free -= len(want)
        if free > 0 and layer_now >= 0:
            out += self._next_pass_targets(layer_now, cache)
        return out

    def _free_slots(self, cache: ExpertCache, layer_now: int) -> int:
        """Empty slots + READY unused ones, less those holding a planned expert of a layer ahead (class 3):
        O(plan ahead), not a walk over the slots."""
        free = cache.empty_slots() + cache.evictable_count()
        plan = self.state.plan
        for layer in range(layer_now + 1, self.state.num_layers):
            free -= sum(1 for e in plan.get(layer, ()) if cache.is_evictable((layer, e)))
        return free

    def _next_pass_targets(self, layer_now: int, cache: ExpertCache) -> list[tuple[int, list[int]]]:
        """§4.1: the next pass's planned experts of layers this pass is done with (0..layer_now), into slots
        holding nothing this pass or the next still plans (classes 0-2): [(layer, experts)] in layer order."""
        upcoming = self.state.poll_upcoming()
        if not upcoming:
            return []
        # less also the slots of done layers' experts the next pass plans (class 2.5)
        free = self._free_slots(cache, layer_now)
        free -= sum(1 for key in self.state.next_planned if key[0] <= layer_now and cache.is_evictable(key))
        out = []
        for layer in range(layer_now + 1):
            if free <= 0:
                break
            want = [e for e in upcoming.get(layer, []) if cache.lookup((layer, e)) is None][:free]
            if want:
                out.append((layer, want))
                free -= len(want)
                self.state.next_pass_prefetches += len(want)
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
