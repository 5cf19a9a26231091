"""DuoServe-MoE's decode-phase predictor (§4): popularity, inter-layer affinity and the activation
path, fed to a seven-layer MLP ("ExpertMLP") trained with binary cross-entropy.

From the training trace (the "Experts Tracer" of §4.1):

* eq. 2, popularity ``P_l(i)``: the share of layer l's selections that chose expert i;
* eq. 3, affinity ``A_{l,l+1}(i, j)``: given expert i selected at layer l, the probability that
  expert j is selected at layer l+1 (rows normalised to 1). With a prediction distance ``d > 1`` the
  same statistic is taken between layers l and l+d.

For target layer ``t`` (source ``s = t - d``), eqs. 4-5 build the state ``s_t = [h_t, p_t, a_{s,t}]``:

* ``h_t``: the activation path, i.e. the experts selected at layers 0..s of this iteration; stored as
  a fixed-length [L, E] multi-hot (layers after ``s`` zero-padded), the paper's "flattened, zero-padded
  expert indices" in a form an MLP can use;
* ``p_t``: the popularity vector of the target layer [E];
* ``a_{s,t}``: the affinity rows of the experts just selected at layer s, in routing order [k, E]
  (what the State Constructor reads from the affinity matrix), flattened.

ExpertMLP: seven fully connected layers, hidden widths halving from 2048 to 64 (2048, 1024, 512,
256, 128, 64) and an output layer of E logits; each hidden layer is followed by BatchNorm, ReLU and
Dropout(0.1). Trained with BCE on the target layer's top-k (eq. 6). One MLP serves every layer (a
layer-level predictor); for small models the widths are scaled down with the input size, keeping
the structure (the first width is a power of two in [64, 2048]).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from moeflow.offload.predictors.base import (
    ExpertPredictor,
    ModelShape,
    PredictorError,
    RowViews,
    default_width,
    ids_to_mask,
    popularity_matrix,
)
from moeflow.offload.predictors.eval_mlp import EvalSequential
from moeflow.offload.predictors.train_mlp import train_bce

PAPER_WIDTHS = (2048, 1024, 512, 256, 128, 64)
MIXTRAL_INPUT = 32 * 8 + 8 + 2 * 8  # state size for Mixtral-8x7B (L=32, E=8, k=2): the paper's scale


def affinity_matrices(topk_ids: torch.Tensor, num_experts: int, distance: int = 1) -> torch.Tensor:
    """DuoServe eq. 3 between layers s and s+distance.

    topk_ids int [N, L, k] -> float32 [L - distance, E, E]; row i of matrix s is the distribution of
    the experts chosen at layer s+distance given expert i chosen at layer s (uniform if i never was).
    """
    n, L, k = topk_ids.shape
    E = num_experts
    out = torch.zeros(max(L - distance, 0), E, E, dtype=torch.float64)
    mask = ids_to_mask(topk_ids, E).double()  # [N, L, E]
    for s in range(L - distance):
        out[s] = mask[:, s].T @ mask[:, s + distance]  # co-selection counts [E, E]
    total = out.sum(-1, keepdim=True)
    out = torch.where(total > 0, out / total.clamp(min=1), torch.full_like(out, 1.0 / E))
    return out.float()


def expert_mlp(in_dim: int, num_experts: int, widths: tuple[int, ...], dropout: float = 0.1) -> nn.Sequential:
    """Linear -> BatchNorm -> ReLU -> Dropout for each hidden width, then Linear to E logits."""
    layers: list[nn.Module] = []
    prev = in_dim
    for w in widths:
        layers += [nn.Linear(prev, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(dropout)]
        prev = w
    layers.append(nn.Linear(prev, num_experts))
    return nn.Sequential(*layers)


def scaled_widths(in_dim: int) -> tuple[int, ...]:
    """The paper's 2048 -> 64 halving at Mixtral scale; the same six halving steps from a smaller start
    for smaller models (never below 8)."""
    first = default_width(PAPER_WIDTHS[0], in_dim, MIXTRAL_INPUT)
    return tuple(max(8, first >> i) for i in range(len(PAPER_WIDTHS)))


class DuoServePredictor(ExpertPredictor):
    """DuoServe-MoE's layer-level ExpertMLP (see the module docstring)."""

    kind = "duoserve"

    def __init__(self, shape: ModelShape, distance: int = 1, popularity: torch.Tensor | None = None,
                 widths: list[int] | None = None, dropout: float = 0.1) -> None:
        super().__init__(shape, distance, popularity)
        L, E, k = shape.num_layers, shape.num_experts, shape.top_k
        self.in_dim = L * E + E + k * E
        self.widths = tuple(widths) if widths else scaled_widths(self.in_dim)
        self.dropout = dropout
        self.affinity = torch.full((max(L - distance, 0), E, E), 1.0 / E)  # [L-d, E, E]
        self.mlp = expert_mlp(self.in_dim, E, self.widths, dropout).eval()
        self._mlp_eval = EvalSequential(self.mlp)  # the runtime's call: no per-module overhead
        self._offset_cache: dict[torch.device, torch.Tensor] = {}
        self._decode_state: DecodeState | None = None  # one row's state, built layer by layer (the runtime's call)

    # ------------------------------------------------------------------ features
    def state_vector(self, topk_path: torch.Tensor, target_layer: int) -> torch.Tensor:
        """Eq. 5. topk_path int [R, s+1, k]: the experts chosen at layers 0..s (s = target - distance).
        -> float32 [R, L*E + E + k*E]."""
        L, E = self.shape.num_layers, self.shape.num_experts
        r, m, _ = topk_path.shape
        src = target_layer - self.distance
        if m != src + 1:
            raise PredictorError(f"activation path of {m} layers given for target {target_layer} (needs {src + 1})")
        topk_path = topk_path.to(self.affinity.device).long()
        state = torch.zeros(r, self.in_dim, device=topk_path.device)
        # h_t: layers 0..s multi-hot at l * E + expert, zero-padded after (one scatter, no [r, L, E] temporary)
        flat = (topk_path + self._offsets(m, topk_path.device)).reshape(r, -1)
        state[:, : L * E].scatter_(1, flat, 1.0)
        state[:, L * E : L * E + E] = self.popularity[target_layer]  # p_t
        state[:, L * E + E :] = self.affinity[src][topk_path[:, -1]].reshape(r, -1)  # a_{s,t}: the chosen rows
        return state

    def _offsets(self, m: int, device: torch.device) -> torch.Tensor:
        """[m, 1] int64: l * E for layers 0..m-1 (cached per device)."""
        cache = self._offset_cache
        if device not in cache:
            cache[device] = (torch.arange(self.shape.num_layers, device=device) * self.shape.num_experts)[:, None]
        return cache[device][:m]

    def _predict(self, target_layer: int, source_layer: int) -> torch.Tensor:
        state = self._one_row_state(target_layer, source_layer)
        if state is None:
            path = torch.stack([self._topk[layer] for layer in range(source_layer + 1)], dim=1)  # [T, s+1, k]
            state = self.state_vector(path, target_layer)
        return torch.sigmoid_(self._mlp_eval(state))  # in place: the MLP's output is a fresh tensor

    def _one_row_state(self, target_layer: int, source_layer: int) -> torch.Tensor | None:
        """A decode step's state (one row) from :class:`DecodeState`, bitwise ``state_vector`` of the observed path;
        None where it does not apply (several rows, the routing on another device, an earlier target than the
        layers already written)."""
        if self._rows != 1:
            return None
        ids = self._topk.get(source_layer)
        if ids is None or ids.device != self.affinity.device:
            return None
        st = self._decode_state
        if st is None or st.device != ids.device:
            st = self._decode_state = DecodeState(self.shape, self.in_dim, ids.device)
        return st.state(self._topk, self.popularity, self.affinity, target_layer, source_layer)

    def _clear_iteration(self) -> None:
        super()._clear_iteration()
        if self._decode_state is not None:
            self._decode_state.restart()

    def _on_observe(self, layer: int) -> None:
        st = self._decode_state
        if st is not None and layer < st.written:  # a layer observed again: its new ids replace the written ones
            st.restart()

    def _move(self, device: torch.device) -> None:
        self.affinity = self.affinity.to(device)
        self.mlp.to(device)
        self._mlp_eval.reset()
        self._decode_state = None

    # ------------------------------------------------------------------ training
    def dataset(self, trace) -> tuple[torch.Tensor, torch.Tensor]:
        """(states [M, in], targets [M, E]) for every token and every target layer t >= distance."""
        xs, ys = [], []
        topk = trace.topk_ids.long()
        for t in range(self.distance, self.shape.num_layers):
            xs.append(self.state_vector(topk[:, : t - self.distance + 1], t))
            ys.append(ids_to_mask(topk[:, t], self.shape.num_experts).float())
        return torch.cat(xs), torch.cat(ys)

    @classmethod
    def fit(cls, trace, distance: int = 1, epochs: int = 20, batch_size: int = 256, lr: float = 1e-3,
            widths: list[int] | None = None, dropout: float = 0.1, seed: int = 0,
            max_seconds: float | None = None) -> DuoServePredictor:
        """Statistics (eqs. 2-3) from ``trace`` (the training rows), then ExpertMLP trained with BCE (eq. 6).
        The paper trains 15-20 epochs for Mixtral-8x7B; ``max_seconds`` caps the wall time."""
        start = time.perf_counter()
        shape = ModelShape.from_trace(trace)
        self = cls(shape, distance, popularity_matrix(trace.topk_ids, shape.num_experts), widths, dropout)
        self.affinity = affinity_matrices(trace.topk_ids, shape.num_experts, distance)
        x, y = self.dataset(trace)
        losses = train_bce(self.mlp, x, y, epochs, batch_size, lr, seed, max_seconds)
        self.train_info.train_tokens = len(trace)
        self.train_info.train_seconds = time.perf_counter() - start
        self.train_info.notes = {"samples": int(x.shape[0]), "epochs_run": len(losses),
                                 "final_loss": losses[-1] if losses else None}
        return self

    # ------------------------------------------------------------------ persistence
    def config(self) -> dict[str, Any]:
        return {"widths": list(self.widths), "dropout": self.dropout}

    def _extra_state(self) -> dict[str, Any]:
        return {"affinity": self.affinity.contiguous(), "mlp": self.mlp.state_dict()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        aff = state.get("affinity")
        if aff is None or tuple(aff.shape) != tuple(self.affinity.shape):
            raise PredictorError(f"duoserve predictor file: 'affinity' has shape "
                                 f"{None if aff is None else tuple(aff.shape)}, expected {tuple(self.affinity.shape)}")
        self.affinity = aff.float()
        try:
            self.mlp.load_state_dict(state["mlp"])
        except (KeyError, RuntimeError) as e:
            raise PredictorError(f"duoserve predictor file: the ExpertMLP weights do not fit: {e}") from e
        self.mlp.eval()


class DecodeState:
    """Eq. 5's state of one row (a decode step) kept in one buffer [1, L*E + E + k*E] across an iteration's layers:
    h_t grows by one scatter per newly observed layer (the layers after the source stay zero), p_t and a_{s,t}
    are written in place per call. Bitwise :meth:`DuoServePredictor.state_vector` of the same path (the same
    zeros, ones, popularity and affinity values), in about 3 torch calls instead of ~15.

    The buffer is handed to the MLP, which reads it before the next call writes it (on a GPU: one stream, the
    prediction stream, runs both).
    """

    def __init__(self, shape: ModelShape, in_dim: int, device: torch.device) -> None:
        L, E, k = shape.num_layers, shape.num_experts, shape.top_k
        self.device = device
        self.buffer = torch.zeros(1, in_dim, device=device)
        self._path = self.buffer[:, : L * E]
        self._layer = [self.buffer[:, l * E : (l + 1) * E] for l in range(L)]  # h_t's block of layer l [1, E]
        self._popularity = self.buffer[0, L * E : L * E + E]  # [E]
        self._affinity = self.buffer[0, L * E + E :].view(k, E)  # the k chosen rows
        self.written = 0  # layers 0..written-1 of this iteration are in h_t
        self._stale = False  # h_t holds an earlier iteration's path
        self._rows = RowViews()  # the rows of the predictor's popularity and affinity

    def restart(self) -> None:
        """A new iteration: h_t is cleared at the next call."""
        self._stale = self._stale or self.written > 0
        self.written = 0

    def state(self, topk: dict[int, torch.Tensor], popularity: torch.Tensor, affinity: torch.Tensor, target: int,
              source: int) -> torch.Tensor | None:
        """topk: layer -> int64 ids [1, k] of this iteration; popularity [L, E]; affinity [L - d, E, E] -> the state
        of ``target`` from layers 0..``source`` [1, in_dim] (this object's buffer), or None if layers past
        ``source`` are already written (an earlier target asked after later layers)."""
        if source < self.written - 1:
            return None
        for layer in range(self.written, source + 1):
            if layer not in topk:
                return None
        if self._stale:
            self._path.zero_()
            self._stale = False
        for layer in range(self.written, source + 1):
            self._layer[layer].scatter_(1, topk[layer], 1.0)
        self.written = source + 1
        popularity_rows, affinity_rows = self._rows(popularity, affinity)
        self._popularity.copy_(popularity_rows[target])
        torch.index_select(affinity_rows[source], 0, topk[source].view(-1), out=self._affinity)
        return self.buffer
