"""FineMoE's Expert Map Store (§4.1, §4.4) and its searches (§4.2), as the runtime runs them on the host.

The store keeps, beside each map [L, E] and its semantic embedding [H], the squared norms the cosine
similarities need: per map the running sum over layers of each layer's squared norm ([C, L], so the norm of
layers 0..m-1 is one read) and each embedding's norm. A search is then one matrix-vector product and a
division, never a re-normalisation of the whole store; the trajectory search of one iteration
(:class:`TrajectorySearch`) is incremental: layer l adds its row's dot products with every map's layer l, so
each layer's search costs O(C E) instead of O(C l E). Cosines are the same values as normalising first
(``a / |a| . b / |b|``) up to rounding; a zero vector scores 0.

:func:`ranked_selection` is eqs. 6-8 plus the §4.5 prefetch order on host arrays (numpy: a few microseconds,
where the same dozen torch ops on [1, E] tensors cost tens).
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import torch

from moeflow.offload.predictors.base import PredictorError

DEFAULT_CAPACITY = 1000
PAPER_DISTANCE = 3  # Mixtral-8x7B in the paper
_EPS = 1e-12  # norms below this count as this (a zero vector scores 0)
# numpy scalars of the arrays' dtypes, and array methods rather than module functions: on tiny arrays numpy's
# Python-level wrappers (np.clip, np.argsort) and Python-int operands cost 10-20 us a call, the methods ~1 us
_F0, _F1, _TOL = np.float32(0.0), np.float32(1.0), np.float32(1e-6)
_EPS64 = np.float64(_EPS)
_F32 = struct.Struct("f")
_TOL_F = float(_TOL)
_SMALL_E = 32  # rows up to this many experts are selected in plain Python (numpy's per-call cost dominates)


def _f32(x: float) -> float:
    """x rounded to float32. An add, subtract or divide of two float32 values done in float64 and then rounded
    is the float32 operation's result exactly (float64 carries more than 2 * 24 + 2 bits)."""
    return _F32.unpack(_F32.pack(x))[0]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, D], b [C, D] -> [B, C] cosine similarity (0 against zero vectors)."""
    an = a / a.norm(dim=1, keepdim=True).clamp(min=_EPS)
    bn = b / b.norm(dim=1, keepdim=True).clamp(min=_EPS)
    return an @ bn.T


def _best(dots: np.ndarray, qnorm: np.ndarray, knorm: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """dots [B, n], query norms [B], key norms [n] -> (argmax index int64 [B], its cosine fp32 [B])."""
    score = dots / (np.maximum(qnorm, _EPS64)[:, None] * np.maximum(knorm, _EPS64)[None, :])
    idx = score.argmax(1)
    best = score[np.arange(score.shape[0]), idx] if score.shape[0] > 1 else score[0, idx]
    return torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(best.astype(np.float32))


class ExpertMapStore:
    """Capacity-bounded store of (expert map [L, E], semantic embedding [H]) records, thread-safe."""

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int | None, capacity: int = DEFAULT_CAPACITY,
                 distance: int = PAPER_DISTANCE) -> None:
        if capacity < 1:
            raise ValueError(f"Expert Map Store capacity must be >= 1, got {capacity}")
        self.num_layers, self.num_experts, self.hidden_size = num_layers, num_experts, hidden_size
        self.capacity, self.distance = capacity, distance
        self.maps = torch.zeros(capacity, num_layers, num_experts)  # [C, L, E]
        self.sems = torch.zeros(capacity, hidden_size) if hidden_size else None  # [C, H]
        self._has_sem = np.zeros(capacity, dtype=bool)
        self.has_sem = torch.from_numpy(self._has_sem)  # [C], the same memory (read as numpy by the searches)
        self._by_layer = np.zeros((num_layers, capacity, num_experts), dtype=np.float32)  # maps, layer-major
        self._layer_sq = np.zeros((capacity, num_layers))  # [C, L]: sum of squares of layers 0..l of each map
        self._sem_norm = np.zeros(capacity)  # [C]
        self.size = 0
        self.replaced = 0
        self.version = 0  # bumped by every write (an incremental search restarts)
        self.lock = threading.RLock()
        # the last semantic search's (store version, query, cosines [B, n]): the iteration's map is published
        # with the same query against the same store, and its redundancy reuses them (the same values)
        self._sem_memo: tuple[int, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.size

    def _write(self, slot: int, m: torch.Tensor, sem: torch.Tensor | None) -> None:
        m32 = self.maps.numpy()[slot]  # [L, E], the store's memory
        m32[...] = m.detach().float().cpu().numpy()
        m64 = m32.astype(np.float64)
        self._by_layer[:, slot] = m32  # a layer's [C, E] rows contiguous for the search
        self._layer_sq[slot] = (m64 * m64).sum(1).cumsum()
        if sem is not None:
            s32 = self.sems.numpy()[slot]
            s32[...] = sem.detach().float().cpu().numpy()
            s64 = s32.astype(np.float64)
            self._sem_norm[slot] = np.sqrt((s64 * s64).sum())
        self._has_sem[slot] = sem is not None
        self.version += 1

    def redundancy(self, maps: torch.Tensor, sems: torch.Tensor | None) -> torch.Tensor:
        """RDY [B, size] = d/L * semantic cosine + (L-d)/L * trajectory cosine (whole maps).
        maps [B, L, E], sems [B, H] or None (then the trajectory term alone)."""
        with self.lock:
            n = self.size
            q = maps.detach().float().cpu().reshape(maps.shape[0], -1).numpy()
            traj = self._cosines(q, self.maps[:n].reshape(n, -1).numpy(), np.sqrt(self._layer_sq[:n, -1]))
            if sems is None or self.sems is None:
                return torch.from_numpy(traj.astype(np.float32))
            sem = self._semantic_cosines(sems.detach().float().cpu().numpy())
            sem = np.where(self._has_sem[:n][None, :], sem, traj)  # a stored map without embedding
            L, d = self.num_layers, self.distance
            return torch.from_numpy((np.float64(d / L) * sem + np.float64((L - d) / L) * traj).astype(np.float32))

    def _semantic_cosines(self, q: np.ndarray) -> np.ndarray:
        """(lock held) q fp32 [B, H] -> cosines float64 [B, size] with every stored embedding (the memo's when
        the store and the query are those of the last call)."""
        memo = self._sem_memo
        if memo is not None and memo[0] == self.version and np.array_equal(memo[1], q):
            return memo[2]
        n = self.size
        cos = self._cosines(q, self.sems[:n].numpy(), self._sem_norm[:n])
        self._sem_memo = (self.version, q.copy(), cos)
        return cos

    @staticmethod
    def _cosines(q: np.ndarray, keys: np.ndarray, key_norms: np.ndarray) -> np.ndarray:
        """q fp32 [B, D], keys fp32 [n, D] with their norms [n] -> cosines float64 [B, n]."""
        q64 = q.astype(np.float64)
        qn = np.maximum(np.sqrt((q64 * q64).sum(1)), _EPS64)
        return (q @ keys.T) / (qn[:, None] * np.maximum(key_norms, _EPS64)[None, :])

    def add(self, maps: torch.Tensor, sems: torch.Tensor | None = None) -> list[int]:
        """Store new iterations (maps [B, L, E], sems [B, H]); when full, each replaces the stored map
        with the highest redundancy score. Returns the slots written."""
        if maps.dim() != 3 or tuple(maps.shape[1:]) != (self.num_layers, self.num_experts):
            raise PredictorError(f"expert maps must be [B, {self.num_layers}, {self.num_experts}], "
                                 f"got {list(maps.shape)}")
        if sems is not None and (self.sems is None or sems.shape != (maps.shape[0], self.hidden_size)):
            raise PredictorError(f"semantic embeddings must be [{maps.shape[0]}, {self.hidden_size}], "
                                 f"got {list(sems.shape)}")
        slots = []
        with self.lock:
            for x in range(maps.shape[0]):
                sem = None if sems is None else sems[x : x + 1]
                if self.size < self.capacity:
                    slot = self.size
                    self.size += 1
                else:
                    slot = int(self.redundancy(maps[x : x + 1], sem)[0].numpy().argmax())  # the first maximum
                    self.replaced += 1
                self._write(slot, maps[x], None if sem is None else sem[0])
                slots.append(slot)
        return slots

    def search_semantic(self, sems: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Eq. 4: for each query [B, H], (index of the most similar stored embedding [B], its cosine [B])."""
        with self.lock:
            n = self.size
            has = self._has_sem[:n]
            if n == 0 or self.sems is None or not has.any():
                return None
            score = self._semantic_cosines(sems.detach().float().cpu().numpy())
            if not has.all():  # a map stored without an embedding never matches semantically
                score = np.where(has[None, :], score, -np.inf)
            idx = score.argmax(1)
            best = score[np.arange(score.shape[0]), idx] if score.shape[0] > 1 else score[0, idx]
            return torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(best.astype(np.float32))

    def search_trajectory(self, traj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Eq. 5: traj [B, m, E] (layers 0..m-1 of this iteration) against the same layers of every map."""
        with self.lock:
            n, m = self.size, traj.shape[1]
            if n == 0:
                return None
            q = traj.detach().float().cpu().reshape(traj.shape[0], -1).numpy().astype(np.float64)
            dots = q @ self.maps[:n, :m].reshape(n, -1).numpy().T
            return _best(dots, np.sqrt((q * q).sum(1)), np.sqrt(self._layer_sq[:n, m - 1]))

    def layer_maps(self, idx: torch.Tensor, layer: int) -> torch.Tensor:
        """P_layer of the stored maps ``idx`` [B] -> [B, E]."""
        rows = idx.numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)  # not np.asarray of a tensor: slow
        with self.lock:
            return torch.from_numpy(self.maps.numpy()[rows, layer])  # fancy indexing: a copy

    def state(self) -> dict[str, torch.Tensor]:
        with self.lock:
            out = {"maps": self.maps[: self.size].clone(), "has_sem": self.has_sem[: self.size].clone()}
            if self.sems is not None:
                out["sems"] = self.sems[: self.size].clone()
            return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        maps = state.get("maps")
        if maps is None or maps.dim() != 3 or tuple(maps.shape[1:]) != (self.num_layers, self.num_experts):
            raise PredictorError(f"finemoe predictor file: stored maps have shape "
                                 f"{None if maps is None else list(maps.shape)}, expected [C, {self.num_layers}, "
                                 f"{self.num_experts}]")
        n = min(maps.shape[0], self.capacity)
        with self.lock:
            sems = state.get("sems") if self.sems is not None else None
            has = state.get("has_sem", torch.ones(n, dtype=torch.bool)) if sems is not None else None
            for i in range(n):
                self._write(i, maps[i], sems[i] if sems is not None and bool(has[i]) else None)
            self.size = n


class TrajectorySearch:
    """Eq. 5 for one iteration, one layer at a time (layers 0, 1, ... in order): the trajectory's dot product
    with every stored map's same layers and its squared norm are kept across layers, so layer l adds one
    [B, E] x [E, n] product. Restarts from the whole trajectory if the store changed or a layer was skipped."""

    def __init__(self, store: ExpertMapStore) -> None:
        self.store = store
        self._dots: np.ndarray | None = None  # [B, n]
        self._qsq: np.ndarray | None = None  # [B]
        self._next = 0  # the layer the running sums expect next
        self._version = -1

    def step(self, traj: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """traj [B, L, E] (layers 0..layer filled): (best map [B], its cosine [B]) over layers 0..layer."""
        store = self.store
        with store.lock:
            n = store.size
            if n == 0:
                return None
            t = traj.numpy()
            restart = store.version != self._version or layer != self._next or self._dots is None \
                or self._dots.shape[1] != n
            if restart:
                self._dots, self._qsq, self._version = np.zeros((t.shape[0], n)), np.zeros(t.shape[0]), store.version
            for source in range(0 if restart else layer, layer + 1):
                row = t[:, source]  # [B, E]
                keys = store._by_layer[source, :n]  # [n, E], contiguous
                if row.shape[0] == 1:  # a decode step: one matrix-vector product
                    self._dots[0] += keys.dot(row[0])
                else:
                    self._dots += (keys @ row.T).T
                row64 = row.astype(np.float64)
                self._qsq += (row64 * row64).sum(1)
            self._next = layer + 1
            return _best(self._dots, np.sqrt(self._qsq), np.sqrt(store._layer_sq[:n, layer]))


def ranked_selection(p: np.ndarray, score: np.ndarray, top_k: int, distance: int) -> list[int]:
    """Eqs. 6-8 and §4.5 on the host: p [B, E] searched probabilities, score [B] their search cosines ->
    the experts some row selects (per row the fewest most probable with mass >= delta = clip(1 - score, 0, 1),
    at least ``top_k``), most wanted first by summed p / distance (ties: lower expert first)."""
    p = np.asarray(p, dtype=np.float32)
    delta = np.minimum(np.maximum(_F1 - np.asarray(score, dtype=np.float32), _F0), _F1)
    if p.shape[0] == 1 and p.shape[1] <= _SMALL_E:
        row = p[0].tolist()
        if all(x == x for x in row):  # no NaN (numpy's sort order for NaN is not Python's)
            return _ranked_one(row, float(delta[0]), top_k, distance)
    if p.shape[0] == 1:  # one row (a decode step): the same selection without the along-axis helpers
        row = p[0]
        order = (-row).argsort(kind="stable")
        ranked_p = row[order]
        take = (ranked_p.cumsum() - ranked_p) < (delta[0] - _TOL)
        take[:top_k] = True
        chosen = order[take]
        chosen.sort()
        return chosen[(-(row[chosen] / np.float32(distance))).argsort(kind="stable")].tolist()
    order = (-p).argsort(axis=1, kind="stable")
    sorted_p = np.take_along_axis(p, order, 1)
    take = (sorted_p.cumsum(axis=1) - sorted_p) < (delta[:, None] - _TOL)
    take[:, :top_k] = True
    mask = np.zeros_like(take)
    np.put_along_axis(mask, order, take, 1)
    prio = np.where(mask, p / np.float32(distance), _F0).sum(0)
    chosen = mask.any(0)
    return [int(e) for e in (-prio).argsort(kind="stable") if chosen[e]]


def _ranked_one(row: list[float], delta: float, top_k: int, distance: int) -> list[int]:
    """:func:`ranked_selection` of one row of float32 values in plain Python, every float32 operation rounded
    as numpy's: a stable sort by -p, the running float32 sum (numpy's cumsum is sequential), the threshold
    delta - 1e-6 in float32, then the chosen experts (ascending) stably by -(p / distance) in float32."""
    order = sorted(range(len(row)), key=lambda e: -row[e])
    limit = _f32(delta - _TOL_F)
    chosen, cum = [], 0.0
    for i, e in enumerate(order):
        x = row[e]
        cum = _f32(cum + x)
        if i < top_k or _f32(cum - x) < limit:
            chosen.append(e)
    chosen.sort()
    d = float(distance)
    return sorted(chosen, key=lambda e: -_f32(row[e] / d))
