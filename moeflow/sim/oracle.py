"""The simulator-only ``oracle`` policy: the trace's own routing as the prediction, Belady eviction (an upper bound)."""

from __future__ import annotations

import torch

from moeflow.offload.eviction import LRU, PriorityEviction
from moeflow.offload.policies import PolicySpec
from moeflow.offload.predictors.interface import Predictor
from moeflow.trace import Trace


class OraclePredictor(Predictor):
    """Perfect foresight, the upper bound of prediction (not a real predictor).

    * ``propose``: at layer l, the experts the trace routes at layer l + distance of this forward pass (past
      the last layer: of the sequence's next pass), most used first;
    * ``score``: Belady's eviction for ``PriorityEviction``: the expert whose next use is farthest goes first.
    """

    def __init__(self, trace: Trace, distance: int = 1) -> None:
        self.trace = trace
        self.L = trace.num_layers
        self.distance = distance
        self.steps: list[slice] = []
        self.i = 0
        self._next_use: list[list[list[float]]] = []  # [step][layer][expert]: next step index using it

    def set_sequence(self, steps: list[slice]) -> None:
        mask = self.trace.topk_mask()
        inf = float("inf")
        nxt = [[inf] * self.trace.num_experts for _ in range(self.L)]
        table = [nxt]
        for s in range(len(steps) - 1, -1, -1):
            used = mask[steps[s]].any(0).tolist()
            nxt = [[s if used[l][e] else nxt[l][e] for e in range(len(used[l]))] for l in range(self.L)]
            table.append(nxt)
        self._next_use = table[::-1]  # index s: from step s on; index len(steps): never
        self.steps, self.i = steps, 0

    def set_step(self, i: int) -> None:
        self.i = i

    def _ids(self, rows: slice, layer: int) -> torch.Tensor:
        ids = self.trace.topk_ids[rows, layer].reshape(-1).long()
        counts = torch.bincount(ids)
        order = torch.argsort(counts, descending=True, stable=True)
        return order[counts[order] > 0]

    def propose(self, layer: int, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        out = []
        for d in range(1, self.distance + 1):
            target = layer + d
            if target < self.L:
                out.append((target, self._ids(self.steps[self.i], target)))
            elif self.i + 1 < len(self.steps) and target - self.L < layer:
                out.append((target - self.L, self._ids(self.steps[self.i + 1], target - self.L)))
        return out

    def score(self, key: tuple[int, int], layer_now: int) -> float:
        """Minus the layers until ``key`` is used next (lowest, i.e. farthest, is evicted first)."""
        l, e = key
        s = self._next_use[self.i + (0 if l > layer_now else 1)][l][e]
        return -((s - self.i) * self.L + l - layer_now)


def oracle_policy(oracle: OraclePredictor) -> PolicySpec:
    """The simulator-only "oracle" policy: ``oracle``'s proposals, Belady eviction over LRU."""
    return PolicySpec("oracle", "perfect prediction and Belady eviction from the trace (an upper bound)",
                      predictor=lambda ctx: oracle, eviction=lambda ctx: PriorityEviction(LRU(), oracle.score))


