"""The interface every expert predictor implements, its file format and shared helpers.

Life cycle inside one forward pass ("iteration") of L MoE layers over T tokens::

    predictor.reset()                                # new sequence (clears per-sequence state)
    predictor.begin_iteration(embed)                 # embed [T, H] token embeddings (or None)
    scores = predictor.predict(t)                    # t < distance: the iteration-start guess
    for l in range(L):
        predictor.observe(l, hidden, probs, topk_ids)    # hidden [T, H], probs [T, E], topk_ids [T, k]
        scores = predictor.predict(l + distance)         # [T or 1, E], higher = more likely needed
        mask = predictor.predicted_mask(scores, l + distance)   # bool [T or 1, E]: what to prefetch
    predictor.end_iteration()                        # e.g. FineMoE publishes the iteration's map

``predict(t)`` uses what was observed up to layer ``t - distance`` of the current iteration (the
source layer); for ``t < distance`` there is no source yet and the predictor gives its prior
(popularity for the learned predictors, the semantic search for FineMoE).

An ExpertPredictor is a :class:`~moeflow.offload.predictors.interface.Predictor` (the one interface the
runtime speaks): :meth:`ExpertPredictor.propose` serves it, provided the backend calls ``observe(layer, ...)``
before ``propose(layer, x)`` for predictors with ``needs_routing`` (DuoServe, FineMoE).
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from moeflow.errors import MoeflowError
from moeflow.offload.predictors.interface import Predictor

PREDICTOR_FORMAT = "moeflow-predictor"
PREDICTOR_VERSION = 1


class PredictorError(MoeflowError, ValueError):
    """A predictor file is unreadable, a predictor is used out of order, or its inputs are mis-shaped."""


class PredictorMismatchError(PredictorError):
    """A predictor built for one model shape (layers, experts, top-k, hidden) was given another."""


@dataclass(frozen=True)
class ModelShape:
    """What a predictor must agree on with the model (and the trace) it serves."""

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int | None = None

    @classmethod
    def from_trace(cls, trace) -> ModelShape:
        return cls(trace.num_layers, trace.num_experts, trace.top_k, trace.hidden_size)

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        """From a :class:`~moeflow.families.mixtral.MixtralConfig` (or anything with its field names)."""
        return cls(cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size)

    def check(self, other: ModelShape, what: str = "the predictor", against: str = "the model") -> None:
        """Raise :class:`PredictorMismatchError` naming every field that disagrees (None matches anything)."""
        bad = [
            f"{name}={mine} but {against} has {name}={theirs}"
            for name, mine, theirs in (
                ("num_layers", self.num_layers, other.num_layers),
                ("num_experts", self.num_experts, other.num_experts),
                ("top_k", self.top_k, other.top_k),
                ("hidden_size", self.hidden_size, other.hidden_size),
            )
            if mine is not None and theirs is not None and mine != theirs
        ]
        if bad:
            raise PredictorMismatchError(f"{what} was built for another model: " + "; ".join(bad))


@dataclass
class TrainInfo:
    """Where a predictor's statistics came from: which trace and which of its sequences."""

    trace_fingerprint: str = ""
    trace_model: str = ""
    train_seq_ids: list[int] = field(default_factory=list)
    eval_seq_ids: list[int] = field(default_factory=list)
    eval_fraction: float = 0.0
    seed: int = 0
    train_tokens: int = 0
    train_seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


def popularity_matrix(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """DuoServe eq. 2: P_l(i) = share of layer l's selections that chose expert i.

    topk_ids int [N, L, k] -> float32 [L, E] (rows sum to 1; a layer never seen is uniform).
    """
    n, L, _ = topk_ids.shape
    counts = torch.zeros(L, num_experts, dtype=torch.float64)
    if n:
        counts.scatter_add_(1, topk_ids.long().permute(1, 0, 2).reshape(L, -1),
                            torch.ones(L, topk_ids.shape[0] * topk_ids.shape[2], dtype=torch.float64))
    total = counts.sum(1, keepdim=True)
    out = torch.where(total > 0, counts / total.clamp(min=1), torch.full_like(counts, 1.0 / num_experts))
    return out.float()


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, E] -> bool [R, E] marking each row's k highest scores."""
    idx = torch.topk(scores.float(), min(k, scores.shape[-1]), dim=-1).indices
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, idx, True)


def ids_to_mask(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids int [..., k] -> bool [..., E]."""
    shape = (*topk_ids.shape[:-1], num_experts)
    return torch.zeros(shape, dtype=torch.bool, device=topk_ids.device).scatter_(-1, topk_ids.long(), True)


class RowViews:
    """The row views (``unbind(0)``) of some tensors, made once and again only when a tensor is replaced (by
    identity: ``.to`` or ``load_state_dict`` hand over new tensors). Indexing a tuple of views costs less than
    ``tensor[i]`` on every call of a per-layer hot path."""

    def __init__(self) -> None:
        self._of: tuple[torch.Tensor, ...] = ()
        self._rows: tuple[tuple[torch.Tensor, ...], ...] = ()

    def __call__(self, *tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
        if len(tensors) != len(self._of) or any(map(operator.is_not, tensors, self._of)):
            self._of, self._rows = tensors, tuple(t.unbind(0) for t in tensors)
        return self._rows


class ExpertPredictor(Predictor):
    """Base class: iteration state, argument checks, prior, selection, runtime adapter, save/load.

    Subclasses set ``kind`` and the ``needs_*`` flags, implement :meth:`_predict` (and usually
    :meth:`fit`, :meth:`_extra_state`, :meth:`_load_extra_state`).
    """

    kind: ClassVar[str] = "base"
    needs_hidden: ClassVar[bool] = False  # observe() must be given the MoE-layer inputs
    needs_routing: ClassVar[bool] = True  # predictions use the observed routing (probs / top-k ids)
    needs_embed: ClassVar[bool] = False  # begin_iteration() should be given the token embeddings
    eval_block: ClassVar[int | None] = None  # tokens per iteration in evaluation (None: a whole sequence)

    def __init__(self, shape: ModelShape, distance: int = 1, popularity: torch.Tensor | None = None) -> None:
        if distance < 1:
            raise ValueError(f"prediction distance must be >= 1, got {distance}")
        if distance >= shape.num_layers and shape.num_layers > 1:
            raise ValueError(f"prediction distance {distance} leaves nothing to predict in a "
                             f"{shape.num_layers}-layer model (expected 1 <= distance < num_layers)")
        self.shape = shape
        self.distance = distance
        L, E = shape.num_layers, shape.num_experts
        self.popularity = popularity.float() if popularity is not None else torch.full((L, E), 1.0 / E)  # [L, E]
        self.train_info = TrainInfo()
        self._hidden: dict[int, torch.Tensor] = {}  # layer -> [T, H] of the current iteration
        self._probs: dict[int, torch.Tensor] = {}  # layer -> [T, E]
        self._topk: dict[int, torch.Tensor] = {}  # layer -> [T, k]
        self._embed: torch.Tensor | None = None  # [T, H]
        self._rows: int | None = None  # T of the current iteration
        self._last_layer = -1
        self._fresh = False  # begin_iteration() called and no layer observed since
        self._paddings: dict[tuple[int, torch.device], torch.Tensor] = {}  # see _padding

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Start a new sequence: forget the iteration state (learned statistics are kept)."""
        self._clear_iteration()

    def _clear_iteration(self) -> None:
        self._hidden.clear()
        self._probs.clear()
        self._topk.clear()
        self._embed = None
        self._rows = None
        self._last_layer = -1
        self._fresh = False

    def begin_iteration(self, embed: torch.Tensor | None = None) -> None:
        """A forward pass starts. embed: token embeddings [T, H] (the embedding-layer output) or None."""
        self._clear_iteration()
        if embed is not None:
            embed = self._check_rows("embed", embed, 2, self.shape.hidden_size)
            self._embed = embed
        self._fresh = True

    def end_iteration(self) -> None:
        """The forward pass is over (every layer observed). Called implicitly when layer 0 is observed
        again without :meth:`begin_iteration`."""
        self._fresh = False

    @property
    def device(self) -> torch.device:
        return self.popularity.device

    def to(self, device: torch.device | str) -> ExpertPredictor:
        """Move the predictor's tensors and networks (the runtime keeps them next to the model)."""
        self.popularity = self.popularity.to(device)
        self._move(torch.device(device))
        return self

    def _move(self, device: torch.device) -> None:
        """Subclasses move their own tensors / modules."""

    def observe(self, layer: int, hidden: torch.Tensor | None, probs: torch.Tensor | None,
                topk_ids: torch.Tensor | None) -> None:
        """Layer ``layer``'s routing: hidden [T, H] (MoE input), probs [T, E] (router softmax), topk_ids [T, k]."""
        L = self.shape.num_layers
        if not 0 <= layer < L:
            raise PredictorError(f"observe(layer={layer}): layer outside [0, {L})")
        if layer == 0 and not self._fresh:  # a new iteration that nobody announced
            if self._last_layer >= 0:
                self.end_iteration()
            self._clear_iteration()
        self._fresh = False
        if self.needs_hidden:
            if hidden is None:
                raise PredictorError(f"the {self.kind} predictor needs the MoE-layer input (hidden) of layer {layer}")
            self._hidden[layer] = self._check_rows("hidden", hidden, 2, self.shape.hidden_size).float()
        if self.needs_routing:
            if probs is None or topk_ids is None:
                raise PredictorError(
                    f"the {self.kind} predictor needs the routing (probs and topk_ids) of layer {layer}"
                )
            self._probs[layer] = self._check_rows("probs", probs, 2, self.shape.num_experts).float()
            self._topk[layer] = self._check_rows("topk_ids", topk_ids, 2, self.shape.top_k).long()
        self._last_layer = max(self._last_layer, layer)
        self._on_observe(layer)

    def _on_observe(self, layer: int) -> None:
        """Hook for subclasses (FineMoE starts its asynchronous search here)."""

    def _check_rows(self, name: str, t: torch.Tensor, dims: int, width: int | None) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            got = t.shape if isinstance(t, torch.Tensor) else type(t)
            raise PredictorError(f"{name} must be a {dims}-d tensor [T, ...], got {got}")
        if width is not None and t.shape[-1] != width:
            raise PredictorError(f"{name} has last dimension {t.shape[-1]}, but the {self.kind} predictor was "
                                 f"built for {width} ({self.shape})")
        if name != "embed":
            if self._rows is None:
                self._rows = t.shape[0]
            elif t.shape[0] != self._rows:
                raise PredictorError(f"{name} has {t.shape[0]} rows, but this iteration has {self._rows} tokens")
        return t.detach() if t.requires_grad else t

    # ------------------------------------------------------------------ prediction
    def source_layer(self, target_layer: int) -> int:
        """The layer whose observation predicts ``target_layer`` (negative: none, use the prior)."""
        return target_layer - self.distance

    def predict(self, target_layer: int) -> torch.Tensor:
        """Scores [T or 1, E] (float32, higher = more likely) for ``target_layer``'s experts."""
        L = self.shape.num_layers
        if not 0 <= target_layer < L:
            raise PredictorError(f"predict(target_layer={target_layer}): layer outside [0, {L})")
        src = self.source_layer(target_layer)
        if src < 0:
            return self.prior(target_layer)
        if src > self._last_layer:
            raise PredictorError(
                f"predict({target_layer}) with distance {self.distance} needs layer {src} observed first "
                f"(last observed: {self._last_layer})"
            )
        return self._predict(target_layer, src)

    def prior(self, target_layer: int) -> torch.Tensor:
        """The guess before any layer of this iteration ran: popularity [1, E]."""
        return self.popularity[target_layer].unsqueeze(0).clone()

    def _predict(self, target_layer: int, source_layer: int) -> torch.Tensor:
        raise NotImplementedError

    def predicted_mask(self, scores: torch.Tensor, target_layer: int) -> torch.Tensor:
        """bool [R, E]: the experts to prefetch for ``target_layer`` (default: the top-k of each row)."""
        return topk_mask(scores, self.shape.top_k)

    def prefetch_priority(self, scores: torch.Tensor, target_layer: int, layer_now: int | None = None) -> torch.Tensor:
        """Copy-queue priorities [R, E] (larger first): the score, discounted by distance as FineMoE's
        p / (l - l_now) does (the learned predictors' scores are not probabilities, but the order is)."""
        now = self._last_layer if layer_now is None else layer_now
        return scores.float() / max(target_layer - now, 1)

    # ------------------------------------------------------------------ runtime adapter
    def propose(self, layer: int, x: torch.Tensor, max_experts: int | None = None) -> list[tuple[int, torch.Tensor]]:
        """The runtime's :class:`Predictor` call: at layer ``layer`` (MoE input x [T, H]),
        [(layer + distance, expert ids int64 [E])], most wanted first, unselected experts as -1 (``max_experts``:
        exactly that many ids, no padding); several tokens are merged by summed priority.
        Hidden-only predictors observe ``x`` here; routing-based ones need ``observe(layer, ...)`` called first."""
        target = layer + self.distance
        if target >= self.shape.num_layers:
            return []
        if self.needs_routing and layer > self._last_layer:
            raise PredictorError(f"the {self.kind} predictor needs observe({layer}, ...) before propose({layer}, x)")
        if not self.needs_routing:  # hidden-only: this call is the observation
            if layer == 0:
                self._clear_iteration()
            self._hidden[layer] = self._check_rows("hidden", x, 2, self.shape.hidden_size).float()
            self._last_layer = max(self._last_layer, layer)
        scores = self.predict(target)
        if scores.shape[0] == 1 and max_experts is None and self._default_selection:
            # one row (decode), the default top-k: ranked by p / distance is ranked by score, which topk gives
            k = min(self.shape.top_k, self.shape.num_experts)
            ids = torch.cat((torch.topk(scores[0].float(), k).indices, self._padding(k, scores.device)))
            return [(target, ids.to(x.device))]
        mask = self.predicted_mask(scores, target)
        prio = torch.where(mask, self.prefetch_priority(scores, target, layer), 0.0)
        # one row (a decode step): its own values, without the reductions over rows
        mass, chosen = (prio[0], mask[0]) if prio.shape[0] == 1 else (prio.sum(0), mask.any(0))
        if max_experts is not None:
            n = min(max_experts, self.shape.num_experts)
            return [(target, torch.topk(mass, max(n, 1)).indices.to(x.device))]
        # every expert some row selected, most wanted first; the others padded with -1: a fixed shape, so
        # counting the selection (a device->host read) is left to the layer's one read-back
        ranked, order = torch.sort(torch.where(chosen, mass, -1.0), descending=True)
        return [(target, torch.where(ranked >= 0, order, -1).to(x.device))]

    def _padding(self, k: int, device: torch.device) -> torch.Tensor:
        """int64 [E - k] of -1 on ``device`` (made once; read only): a one-row proposal's padding."""
        pads = self._paddings
        pad = pads.get((k, device))
        if pad is None:
            pad = pads[(k, device)] = torch.full((self.shape.num_experts - k,), -1, dtype=torch.int64, device=device)
        return pad

    @property
    def _default_selection(self) -> bool:
        """Whether selection and priority are the base's (the top-k of each row, the score / distance)."""
        cls = type(self)
        return (cls.predicted_mask is ExpertPredictor.predicted_mask
                and cls.prefetch_priority is ExpertPredictor.prefetch_priority)

    def observe_and_propose(self, layer: int, x: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor,
                            max_experts: int | None = None) -> list[tuple[int, torch.Tensor]]:
        """observe() then propose(): the order routing-based predictors need."""
        self.observe(layer, x if self.needs_hidden else None, probs, topk_ids)
        return self.propose(layer, x, max_experts)

    # ------------------------------------------------------------------ persistence
    def config(self) -> dict[str, Any]:
        """JSON-able constructor options besides shape and distance."""
        return {}

    def _extra_state(self) -> dict[str, Any]:
        """Tensors / state dicts to save besides popularity."""
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def save(self, path: str | Path) -> Path:
        """Write the predictor (torch.save of plain containers; loadable with weights_only=True)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = {
            "format": PREDICTOR_FORMAT, "version": PREDICTOR_VERSION, "kind": self.kind,
            "shape": asdict(self.shape), "distance": self.distance, "config": self.config(),
            "popularity": self.popularity.contiguous(), "train_info": asdict(self.train_info),
            "state": self._extra_state(),
        }
        tmp = path.with_name(path.name + ".tmp")
        torch.save(blob, tmp)
        tmp.replace(path)
        return path

    @classmethod
    def _from_blob(cls, blob: dict[str, Any]) -> ExpertPredictor:
        shape = ModelShape(**blob["shape"])
        self = cls(shape, distance=int(blob["distance"]), popularity=blob["popularity"], **blob.get("config", {}))
        self.train_info = TrainInfo(**blob.get("train_info", {}))
        self._load_extra_state(blob.get("state", {}))
        return self

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "distance": self.distance, **asdict(self.shape), **self.config()}

    def __repr__(self) -> str:
        s = self.shape
        return (f"{type(self).__name__}(layers={s.num_layers}, experts={s.num_experts}, top_k={s.top_k}, "
                f"hidden={s.hidden_size}, distance={self.distance})")


def read_predictor_blob(path: str | Path) -> dict[str, Any]:
    """Read and check the envelope of a predictor file."""
    path = Path(path)
    if not path.is_file():
        raise PredictorError(f"predictor file {path} does not exist")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds (pickle, zip, unsupported global)
        raise PredictorError(f"cannot read predictor file {path} (not a moeflow predictor, or corrupt): {e}") from e
    if not isinstance(blob, dict) or blob.get("format") != PREDICTOR_FORMAT:
        raise PredictorError(f"{path} is not a moeflow predictor file (format tag missing)")
    if int(blob.get("version", -1)) > PREDICTOR_VERSION:
        raise PredictorError(f"{path}: predictor file version {blob['version']} is newer than this moeflow "
                             f"({PREDICTOR_VERSION})")
    for key in ("kind", "shape", "distance", "popularity"):
        if key not in blob:
            raise PredictorError(f"{path}: predictor file lacks {key!r}")
    return blob


def default_width(first: int, in_dim: int, paper_scale_in: int) -> int:
    """Scale a paper's layer width for small models: ``first`` at or above ``paper_scale_in`` inputs,
    shrinking with the input size (powers of two, at least 64)."""
    if in_dim >= paper_scale_in:
        return first
    w = 2 ** math.ceil(math.log2(max(64, first * in_dim / paper_scale_in)))
    return int(min(first, max(64, w)))
