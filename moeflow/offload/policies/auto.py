"""``auto``: picks one of the other policies from the slot budget and the predictor files at hand."""

from __future__ import annotations

from moeflow.offload.policies.files import has_predictor_file
from moeflow.offload.policies.spec import PolicyContext, PolicySpec


def choose_policy(ctx: PolicyContext) -> str:
    """What ``auto`` runs, from the slot budget and the predictor files at hand (docs/policies.md has the
    measurements behind it):

    * every expert fits: ``lru`` (the warm start loads them all; nothing to predict);
    * fewer slots than one token's experts (L x k): ``duoserve`` with its file (the best decode hit rate at
      that budget; a per-layer split would leave a layer fewer than k slots), else ``mixtral-offloading``
      (needs no file: the model's own routers);
    * otherwise ``promoe`` with its file (the fewest bytes moved and the most useful prefetches of the
      predictor policies), else ``finemoe`` (needs no file: it learns as it serves).

    Prefill is the same in every case: the layer's missing experts stream through the runtime's ring while
    resident ones compute first; only the decode-phase predictor and cache differ.
    """
    if ctx.n_slots >= ctx.num_layers * ctx.num_experts:
        return "lru"
    if ctx.n_slots < ctx.num_layers * ctx.top_k:
        return "duoserve" if has_predictor_file(ctx, "duoserve") else "mixtral-offloading"
    return "promoe" if has_predictor_file(ctx, "promoe") else "finemoe"


AUTO = PolicySpec(
    "auto", "picks lru / duoserve / promoe (or, without files, mixtral-offloading / finemoe) from the slot budget",
    select=choose_policy,
)
