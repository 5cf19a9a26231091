"""The decode step under ``torch.compile`` (``from_pretrained(compile=True)`` / ``MoEModel.compile_decode``).

Two shapes of step, chosen per call by the expert backend in use:

* a backend dynamo can trace (:class:`~moeflow.moe.resident.ResidentExperts`: the kernels' custom ops): the
  whole step is one graph (``fullgraph=True``, static shapes);
* a backend with host logic (the offload scheduler, whose ``forward`` is ``torch.compiler.disable``d): one
  graph break per MoE layer, at that call. Dynamo then compiles each decoder layer's code as its own frame;
  every layer runs the same code on its own parameters, and only the layer index (``layer_idx`` ints on the
  attention and the MoE block: the KV cache row, the backend's layer) differs. Those ints are traced as
  symbolic ints (``allow_unspec_int_on_nn_module`` with automatic dynamic ints): the first layer compiles
  them static, the second once with a symbol, and every later layer and step reuses that graph instead of
  compiling one per layer (which hit dynamo's recompile limit at 8 layers and left the rest eager).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from moeflow import compile_boundary
from moeflow.engine.kv_cache import PassCache
from moeflow.families.base import CausalDecoder
from moeflow.moe.backend import ExpertBackend
from moeflow.moe.block import RoutingRecorder
from moeflow.moe.resident import ResidentExperts

# torch >= 2.3 has the flag (2.11 on the GPU machine and 2.13 here); without it layers compile per index
_UNSPEC_INT_FLAG = "allow_unspec_int_on_nn_module"


def traces_through(experts: ExpertBackend | None) -> bool:
    """Whether dynamo traces ``experts.forward`` (pure tensor work through custom ops) rather than breaking."""
    return isinstance(experts, ResidentExperts)


def _symbolic_layer_indices() -> contextlib.AbstractContextManager:
    """Dynamo config under which int attributes of modules (the layer indices) may become symbolic."""
    import torch._dynamo

    if hasattr(torch._dynamo.config, _UNSPEC_INT_FLAG):
        return torch._dynamo.config.patch(**{_UNSPEC_INT_FLAG: True})
    return contextlib.nullcontext()


class CompiledDecode:
    """A ``Runner.decode_fn``: ``decoder(embeds, positions, cache, cache_position, token_mask, experts, routing)``
    through ``torch.compile`` (``compiler``: a dynamo backend name, "inductor" by default; "eager" traces
    without generating code). The compiled forms are made on first use, one per kind of backend, so a
    backend swapped in later (``use_backend``) gets the right one."""

    def __init__(self, decoder: CausalDecoder, compiler: str | Callable = "inductor") -> None:
        self.decoder, self.compiler = decoder, compiler
        self._compiled: dict[bool, Callable[..., torch.Tensor]] = {}

    def _compile(self, whole: bool) -> Callable[..., torch.Tensor]:
        compile_boundary.arm()  # the host-logic methods become graph breaks (moeflow.compile_boundary)
        if whole:  # one graph, nothing symbolic: every layer index is a constant of the one trace
            return torch.compile(self.decoder, fullgraph=True, dynamic=False, backend=self.compiler)
        # dynamic=None: automatic dynamic, which is what turns the layer index symbolic on its second value
        # (decode shapes never change within a generate; a new cache length later compiles once more)
        return torch.compile(self.decoder, fullgraph=False, dynamic=None, backend=self.compiler)

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, cache: PassCache, cache_position: torch.Tensor,
                 token_mask: torch.Tensor, experts: ExpertBackend, routing: RoutingRecorder | None = None
                 ) -> torch.Tensor:
        whole = traces_through(experts)
        fn = self._compiled.get(whole)
        if fn is None:
            fn = self._compiled[whole] = self._compile(whole)
        if whole:
            return fn(embeds, positions, cache, cache_position, token_mask, experts, routing)
        with _symbolic_layer_indices():  # dynamo reads its config while it compiles, i.e. inside this call
            return fn(embeds, positions, cache, cache_position, token_mask, experts, routing)
