"""FineMoE's expert-map guidance (§4.1-4.5): an Expert Map Store searched by semantic and trajectory
similarity, a similarity-aware prefetch threshold, and the prefetch and eviction priorities.

* Expert map (§4.1): for one iteration, the router probability distributions of all layers,
  ``map_i = {P_1, ..., P_L}`` ([L, E]); stored with the iteration's semantic embedding (the
  embedding-layer output, [H]).
* Search (§4.2): for the first ``d`` layers (``d`` = prefetch distance) no routing of this iteration
  is known yet, so the map whose semantic embedding is most cosine-similar (eq. 4) guides them; for a
  layer ``l >= d`` the observed trajectory ``P_0 .. P_{l-d}`` is compared by cosine (eq. 5) with the
  same layers of every stored map, and the best map's ``P_l`` guides layer ``l``.
* Similarity-aware selection (§4.3): ``delta_l = clip(1 - score, 0, 1)``; experts are taken in
  decreasing probability until their summed probability reaches ``delta_l``, and never fewer than
  ``k`` (eqs. 6-8). A confident match prefetches few experts, a poor one many.
* Priorities (§4.5): prefetch ``p_{l,j} / (l - l_now)``; eviction ``1 / (p_{l,j} * freq_{l,j})``
  (LFU weighted by the searched map; the lowest ``p * freq`` goes first).
* Store management (§4.4): capacity ``C`` maps (1K in the paper); once full, each new map replaces
  the stored map most redundant with it, ``RDY = d/L * score_sem + (L-d)/L * score_traj``.
* Asynchrony (§4.3): the inference thread publishes contexts (embeddings, each layer's probabilities,
  finished maps) and a single worker thread searches and updates the store off the critical path
  (``async_search=True``); ``predict`` then collects the search started when the source layer was
  observed.

No offline training: the store fills as the predictor serves (``online=True`` publishes each
finished iteration) and can be warmed from a trace (:meth:`FineMoEPredictor.fit`). An iteration is
one token of a sequence by default (decode iterations are one token; ``aggregate=True`` makes a
multi-token forward pass, a prefill, one iteration with mean probabilities and mean embedding).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from moeflow.offload.policies.finemoe.store import (
    DEFAULT_CAPACITY,
    PAPER_DISTANCE,
    ExpertMapStore,
    TrajectorySearch,
    ranked_selection,
)
from moeflow.offload.predictors.base import ExpertPredictor, ModelShape, PredictorError, popularity_matrix

__all__ = ["DEFAULT_CAPACITY", "PAPER_DISTANCE", "ExpertMapStore", "FineMoEPredictor", "eviction_priority",
           "prefetch_priority", "select_experts", "similarity_threshold"]

def similarity_threshold(score: torch.Tensor | float) -> torch.Tensor:
    """delta = clip(1 - score, 0, 1) (FineMoE §4.3)."""
    return torch.clamp(1.0 - torch.as_tensor(score, dtype=torch.float32), 0.0, 1.0)


def select_experts(probs: torch.Tensor, delta: torch.Tensor | float, k: int) -> torch.Tensor:
    """Eqs. 6-8: per row, the fewest most-probable experts whose probabilities sum to >= delta, at least k.

    probs [R, E], delta [R] or scalar -> bool [R, E].
    """
    probs = probs.float()
    r, e = probs.shape
    delta = torch.as_tensor(delta, dtype=torch.float32).expand(r)
    sorted_p, order = torch.sort(probs, dim=1, descending=True, stable=True)  # ties: lower expert first
    before = torch.cumsum(sorted_p, dim=1) - sorted_p  # mass of the experts ranked above each one
    # an expert is taken while the mass before it is still short of delta (tolerance for fp rounding)
    take = before < delta[:, None] - 1e-6
    take[:, : min(k, e)] = True
    return torch.zeros_like(take).scatter_(1, order, take)


def prefetch_priority(p: torch.Tensor | float, layer: int, layer_now: int) -> torch.Tensor:
    """PRI_prefetch = p / (l - l_now) (FineMoE §4.5); layer > layer_now."""
    if layer <= layer_now:
        raise ValueError(f"prefetch priority of layer {layer} at layer {layer_now}: the layer must lie ahead")
    return torch.as_tensor(p, dtype=torch.float32) / (layer - layer_now)


def eviction_priority(p: torch.Tensor | float, freq: torch.Tensor | float) -> torch.Tensor:
    """PRI_evict = 1 / (p * freq) (FineMoE §4.5): the highest is evicted first (inf when p * freq = 0)."""
    denom = torch.as_tensor(p, dtype=torch.float32) * torch.as_tensor(freq, dtype=torch.float32)
    return torch.where(denom > 0, 1.0 / denom.clamp(min=1e-30), torch.full_like(denom, float("inf")))


class _Done:
    """A finished result with the two methods of a Future the predictor uses."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        return self.value


class FineMoEPredictor(ExpertPredictor):
    """FineMoE's expert-map search as a predictor (see the module docstring)."""

    kind = "finemoe"
    needs_embed = True
    eval_block = 1  # an iteration is one token: serve them in order, publishing each map

    def __init__(self, shape: ModelShape, distance: int = PAPER_DISTANCE, popularity: torch.Tensor | None = None,
                 capacity: int = DEFAULT_CAPACITY, online: bool = True, aggregate: bool = False,
                 async_search: bool = False) -> None:
        super().__init__(shape, distance, popularity)
        L, E = shape.num_layers, shape.num_experts
        self.capacity, self.online, self.aggregate = capacity, online, aggregate
        self.store = ExpertMapStore(L, E, shape.hidden_size, capacity, distance)
        self.freq = torch.zeros(L, E)  # visit counts (observed activations) for the eviction priority
        self.guidance = torch.full((L, E), 1.0 / E)  # the latest searched probabilities per layer
        self._found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # target -> (p [B, E], score [B])
        self._futures: dict[int, Future | _Done] = {}
        self._query_sem: torch.Tensor | None = None
        self._published = False
        self._traj: torch.Tensor | None = None  # [B, L, E] this iteration's probabilities, filled layer by layer
        self.runtime_mode = False  # True (the offload runtime): one search per observed layer, used one layer later
        self._searches: dict[int, Future | _Done] = {}  # source layer -> search of the trajectory 0..source
        self._traj_search = TrajectorySearch(self.store)  # the runtime's incremental eq. 5 of this iteration
        self._executor: ThreadPoolExecutor | None = None
        if async_search:
            self.start_async()

    # ------------------------------------------------------------------ async worker
    def start_async(self) -> None:
        """Search and update the store on a worker thread (publish/subscribe, off the critical path)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finemoe-search")

    def close(self) -> None:
        """Stop the worker thread (pending work finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def is_async(self) -> bool:
        return self._executor is not None

    def _submit(self, fn, *args) -> Future | _Done:
        if self._executor is not None:
            return self._executor.submit(fn, *args)
        return _Done(fn(*args))  # synchronous: no Future (its condition variable costs more than a search)

    # ------------------------------------------------------------------ iteration
    def _clear_iteration(self) -> None:
        super()._clear_iteration()
        self._published = False
        self._found = {}
        self._futures = {}
        self._query_sem = None
        self._traj = None  # a new tensor per iteration: a search of the last one may still read the old
        self._searches = {}
        self._traj_search = TrajectorySearch(self.store)

    def begin_iteration(self, embed: torch.Tensor | None = None) -> None:
        """embed [T, H]: the iteration's token embeddings (its semantic context)."""
        super().begin_iteration(embed)
        if embed is not None:
            sem = embed.float().cpu()
            self._query_sem = sem.mean(0, keepdim=True) if self.aggregate else sem
            if self.is_async:  # start the semantic search for the first d layers now
                sem_query = self._query_sem
                self._futures[-1] = self._submit(self.store.search_semantic, sem_query)

    def _rows_of(self, t: torch.Tensor) -> torch.Tensor:
        return t.mean(0, keepdim=True) if self.aggregate else t

    def _on_observe(self, layer: int) -> None:
        E, L = self.shape.num_experts, self.shape.num_layers
        top, probs = self._topk[layer], self._probs[layer]
        ids = (top if top.is_cpu else top.cpu()).reshape(-1).tolist()
        freq = self.freq.numpy()[layer]
        if len(set(ids)) == len(ids):  # a decode step's top-k: += 1 each is exactly bincount's += count
            for e in ids:
                freq[e] += 1
        else:
            freq += np.bincount(np.asarray(ids, dtype=np.int64), minlength=E)
        row = self._rows_of(probs if probs.is_cpu else probs.cpu())
        if self._traj is None or self._traj.shape[0] != row.shape[0]:
            self._traj = torch.zeros(row.shape[0], L, E)
        self._traj.numpy()[:, layer] = row.numpy()  # incremental: earlier layers are never copied again
        if self.runtime_mode:  # the search adds this layer to the iteration's running dot products
            if layer + 1 + self.distance < L:  # only layers up to L-1-d propose, each from an earlier layer's search
                self._searches[layer] = self._submit(self._traj_search.step, self._traj, layer)
            return
        target = layer + self.distance
        if self.is_async and target < L:
            self._futures[target] = self._submit(self._search_trajectory, self._trajectory(layer), target)

    def _trajectory(self, last_layer: int) -> torch.Tensor:
        """[B, last_layer + 1, E]: this iteration's probabilities of layers 0..last_layer (a view)."""
        if self._traj is None:
            raise PredictorError(f"no layer of this iteration observed (asked for layers 0..{last_layer})")
        return self._traj[:, : last_layer + 1]

    def runtime_proposals(self, layer: int) -> list[tuple[int, list[int]]]:
        """At layer ``layer`` (its gate): [(layer + d, expert ids, most wanted first)] as a host list, from the
        latest trajectory search already finished (the one started at layer ``layer - 1``, never waited for),
        or the semantic search before any; delta-threshold selection, ranked by p / (target - layer)."""
        target = layer + self.distance
        if target >= self.shape.num_layers:
            return []
        found = None
        for src in range(layer - 1, -1, -1):
            fut = self._searches.get(src)
            if fut is not None and fut.done():
                hit = fut.result()
                if hit is not None:
                    idx, score = hit
                    found = (self.store.layer_maps(idx, target), score)
                    self._remember(target, found)
                break
        return [(target, self.selection(target, layer))]

    def selection(self, target: int, layer_now: int) -> list[int]:
        """The delta-selected experts of ``target`` from its latest search result (the semantic search when
        none), most wanted first by p / (target - layer_now): host lists, computed on host arrays."""
        if target not in self._found:
            self._semantic(target)
        p, score = self._found[target]
        return ranked_selection(p.numpy(), score.numpy(), self.shape.top_k, max(target - layer_now, 1))

    def _search_trajectory(self, traj: torch.Tensor, target: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        hit = self.store.search_trajectory(traj)
        if hit is None:
            return None
        idx, score = hit
        return self.store.layer_maps(idx, target), score

    def _no_match(self, rows: int, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Nothing to search (empty store or no embedding): popularity with similarity 0 (delta = 1)."""
        return self.popularity[target].expand(rows, -1).clone(), torch.zeros(rows)

    def _request_rows(self) -> int:
        if self._query_sem is not None:
            return self._query_sem.shape[0]
        if self._rows is not None:
            return 1 if self.aggregate else self._rows
        return 1

    def prior(self, target_layer: int) -> torch.Tensor:
        """Semantic search (first d layers): P_target of the map with the most similar embedding."""
        self._semantic(target_layer)
        return self._found[target_layer][0].clone()

    def _semantic(self, target_layer: int) -> None:
        """:meth:`prior`'s search result for ``target_layer`` remembered (``_found``), without the copy."""
        if target_layer not in self._found:
            hit = None
            if -1 not in self._futures and self._query_sem is not None:  # once per iteration, for every target
                self._futures[-1] = self._submit(self.store.search_semantic, self._query_sem)
            if -1 in self._futures:
                hit = self._futures[-1].result()
            if hit is None:
                found = self._no_match(self._request_rows(), target_layer)
            else:
                idx, score = hit
                found = (self.store.layer_maps(idx, target_layer), score)
            self._remember(target_layer, found)

    def _predict(self, target_layer: int, source_layer: int) -> torch.Tensor:
        """Trajectory search: P_target of the map whose layers 0..target-d best match this iteration's."""
        if target_layer not in self._found:
            fut = self._futures.get(target_layer)
            hit = fut.result() if fut is not None else self._search_trajectory(self._trajectory(source_layer),
                                                                               target_layer)
            self._remember(target_layer, hit if hit is not None else self._no_match(self._request_rows(), target_layer))
        return self._found[target_layer][0].clone()

    def _remember(self, target: int, found: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._found[target] = found
        p = found[0].numpy()
        self.guidance.numpy()[target] = p[0] if p.shape[0] == 1 else p.max(0)  # one row: its own values

    def search_score(self, target_layer: int) -> torch.Tensor:
        """Cosine score [B] of the map guiding ``target_layer`` (after ``predict``)."""
        if target_layer not in self._found:
            raise PredictorError(f"no search result for layer {target_layer}: call predict({target_layer}) first")
        return self._found[target_layer][1]

    def predicted_mask(self, scores: torch.Tensor, target_layer: int) -> torch.Tensor:
        """delta = clip(1 - score, 0, 1); the fewest most-probable experts with mass >= delta, at least k."""
        found = self._found.get(target_layer)
        score = found[1] if found is not None and found[1].shape[0] == scores.shape[0] else torch.zeros(scores.shape[0])
        return select_experts(scores, similarity_threshold(score), self.shape.top_k)

    def end_iteration(self) -> None:
        """Publish the finished iteration's map (and embedding) to the store."""
        super().end_iteration()
        L = self.shape.num_layers
        if self.online and not self._published and all(layer in self._probs for layer in range(L)):
            self._published = True
            maps = self._trajectory(L - 1).clone()  # [B, L, E]
            sems = self._query_sem if self._query_sem is not None and self._query_sem.shape[0] == maps.shape[0] \
                else None
            self._submit(self.store.add, maps, sems)

    def to(self, device: torch.device | str) -> FineMoEPredictor:
        """The Expert Map Store and its search live in host memory (as in the paper); proposals are
        returned on the device of the hidden state they were asked for."""
        return self

    # ------------------------------------------------------------------ cache priorities
    def eviction_priority(self, layer: int, expert: int, freq: float | None = None) -> float:
        """1 / (p * freq): p from the latest searched map of ``layer``, freq the visit count (own count
        of observed activations unless the cache passes its own)."""
        f = float(self.freq[layer, expert]) if freq is None else freq
        return float(eviction_priority(self.guidance[layer, expert], f))

    def eviction_score(self, key: tuple[int, int], layer_now: int = 0) -> float:
        """For :class:`moeflow.offload.eviction.PriorityEviction` (evicts the lowest): p * freq."""
        layer, expert = key
        return float(self.guidance[layer, expert] * self.freq[layer, expert])

    # ------------------------------------------------------------------ warm start and files
    @classmethod
    def fit(cls, trace, distance: int | None = None, capacity: int = DEFAULT_CAPACITY, online: bool = True,
            aggregate: bool = False) -> FineMoEPredictor:
        """Warm the store with the training rows of ``trace`` (one map per token; needs ``embed``)."""
        if trace.embed is None:
            raise PredictorError(f"{trace.source}: the finemoe predictor searches semantic embeddings, but the trace "
                                 "has no 'embed' tensor (record it with `moeflow trace --hidden`)")
        start = time.perf_counter()
        shape = ModelShape.from_trace(trace)
        if distance is None:
            distance = max(1, min(PAPER_DISTANCE, shape.num_layers - 1))
        self = cls(shape, distance, popularity_matrix(trace.topk_ids, shape.num_experts), capacity, online, aggregate)
        self.store.add(trace.probs.float(), trace.embed.float())
        self.freq += torch.zeros_like(self.freq).scatter_add_(
            1, trace.topk_ids.long().permute(1, 0, 2).reshape(shape.num_layers, -1),
            torch.ones(shape.num_layers, trace.topk_ids.shape[0] * shape.top_k))
        self.train_info.train_tokens = len(trace)
        self.train_info.train_seconds = time.perf_counter() - start
        self.train_info.notes = {"stored_maps": len(self.store), "replaced": self.store.replaced}
        return self

    def config(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "online": self.online, "aggregate": self.aggregate}

    def _extra_state(self) -> dict[str, Any]:
        return {"store": self.store.state(), "freq": self.freq.clone()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "store" not in state:
            raise PredictorError("finemoe predictor file: the Expert Map Store is missing")
        self.store.load_state(state["store"])
        freq = state.get("freq")
        if freq is not None and tuple(freq.shape) == tuple(self.freq.shape):
            self.freq = freq.float()

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
