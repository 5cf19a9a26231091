"""``duoserve`` (DuoServe-MoE §5).

Prefill streams each layer's missing experts through a ring of k slots (at most k of a layer's loads hold
slots at once; one computes while the next copies), cached experts first. Decode runs the DuoServe ExpertMLP
as a separate prediction step beside the expert compute (a side CUDA stream on a GPU) and prefetches its
guesses for the next layer once the layer's first expert group is computed (the paper's second
synchronisation point); a miss at the gate is re-fetched at high priority (the runtime's acquire). Global LRU.
No predictor runs in prefill (the paper's §5.2; ``policy_options={"predict_in_prefill": True}`` runs it).
"""

from __future__ import annotations

from moeflow.offload.policies.duoserve.runtime import OverlappedPredictor
from moeflow.offload.policies.files import load_policy_predictor
from moeflow.offload.policies.spec import Mechanisms, PolicyContext, PolicySpec, evict


def _duoserve_predictor(ctx: PolicyContext) -> OverlappedPredictor:
    return OverlappedPredictor(load_policy_predictor(ctx, "duoserve"), ctx.device)


DUOSERVE = PolicySpec(
    "duoserve", "DuoServe-MoE: prefill streams experts through a k-slot ring; decode prefetches the ExpertMLP's "
                "next-layer guess, predicted beside the expert compute; misses re-fetched at the gate",
    eviction=evict("lru"), predictor=_duoserve_predictor, prefill_ring=True,
    mechanisms=Mechanisms(predict_in_prefill=False),  # the paper's: the ExpertMLP serves decode only
)
