"""TEMPORARY bridge to today's ``moeflow.scheduling`` (delete at the merge with ``moeflow.offload``).

``moeflow.scheduling``'s offloading backend predates the :class:`ExpertBackend` seam: FineMoE hooks
``embed_tokens``, ExpertFlow's PLEC hooks the decoder (``attach_model``) and the path predictor sits on
``backend.predictor``. ``moeflow.offload``, built beside this branch, implements ``begin_step`` /
``predict_paths`` itself; then :mod:`moeflow.engine.build` calls its ``create_expert_backend`` directly
and this module goes. Nothing else in the engine knows about hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeflow.moe.backend import ExpertBackend, StepInfo
from moeflow.scheduling import create_expert_backend


class LegacySchedulingBackend(ExpertBackend):
    """Wraps a ``moeflow.scheduling`` backend that is not an :class:`ExpertBackend` yet; reads go to it."""

    def __init__(self, inner: Any, decoder: nn.Module) -> None:
        self.inner = inner
        self.fmt = inner.fmt
        self._input_ids: torch.Tensor | None = None
        self._hook = None
        plan = getattr(getattr(inner, "predictor", None), "_before_pass", None)
        if plan is not None:  # ExpertFlow's PLEC plans from the pass's token ids before layer 0
            self._hook = decoder.register_forward_pre_hook(
                lambda module, args: plan(module, (self._input_ids, *args[1:5])))

    def begin_step(self, step: StepInfo) -> None:
        self._input_ids = step.input_ids

    def load_expert(self, layer, expert, tensors):  # noqa: D102
        self.inner.load_expert(layer, expert, tensors)

    def finish_loading(self) -> None:
        self.inner.finish_loading()

    def predict_paths(self, step: StepInfo, last_only: bool = False) -> torch.Tensor | None:
        predictor = getattr(self.inner, "predictor", None)
        if not hasattr(predictor, "predict_paths"):
            return None
        ids = step.history_ids if step.history_ids is not None else step.input_ids
        mask = step.history_mask if step.history_mask is not None else step.token_mask
        return predictor.predict_paths(ids, mask, last_only=last_only)

    def forward(self, layer, x, probs, topk_ids, topk_weights):  # noqa: D102
        return self.inner.forward(layer, x, probs, topk_ids, topk_weights)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # model.experts.cache / .predictor / .stats ... as before
        if "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def __repr__(self) -> str:
        return repr(self.inner)


def as_expert_backend(backend: Any, decoder: nn.Module) -> ExpertBackend:
    """A backend built by ``moeflow.scheduling.create_expert_backend`` (benchmarks swap them in) as an ExpertBackend."""
    return backend if isinstance(backend, ExpertBackend) else LegacySchedulingBackend(backend, decoder)


def create_legacy_backend(config: Any, *, decoder: nn.Module, **kw: Any) -> ExpertBackend:
    """``moeflow.scheduling.create_expert_backend`` plus the module hooks its predictors still need."""
    backend = create_expert_backend(config, embed_tokens=decoder.embed_tokens, **kw)  # FineMoE hooks it
    return as_expert_backend(backend, decoder)
