"""``expertflow`` (ExpertFlow §3-4): routing paths predicted from the token ids before each pass (``predictor.py``),
PLEC's whole-budget prefetch and real-time correction (``runtime.py``), the token scheduler (``scheduler.py``) and,
with micro-batches, the dual-batch decode pipeline (``pipeline.py``) as the policy's decode strategy."""

from __future__ import annotations

from moeflow.offload.policies.expertflow.pipeline import DualBatchPipeline
from moeflow.offload.policies.expertflow.runtime import PLECEviction, PLECPredictor, PLECState
from moeflow.offload.policies.files import load_policy_predictor
from moeflow.offload.policies.spec import Mechanisms, PolicyContext, PolicySpec


def make_plec_predictor(ctx: PolicyContext) -> PLECPredictor:
    """The expertflow predictor from ``OffloadConfig.predictor_path`` or ``<checkpoint>/predictors/expertflow.pt``."""
    pred = load_policy_predictor(ctx, "expertflow")
    return PLECPredictor(pred, PLECState(ctx.num_layers, ctx.num_experts), ctx.mechanisms.keep_contiguous,
                         ctx.mechanisms.prefill_regroup)


def make_plec_eviction(ctx: PolicyContext) -> PLECEviction:
    """PLEC's correction order over the predictor's plan (``ctx.predictor``, made first)."""
    pred = ctx.predictor
    state = pred.state if isinstance(pred, PLECPredictor) else PLECState(ctx.num_layers, ctx.num_experts)
    return PLECEviction(state)


EXPERTFLOW = PolicySpec(
    "expertflow", "ExpertFlow PLEC: routing paths predicted from the token ids before each pass, prefetched across "
                  "the whole slot budget; misses replace mis-prefetched experts first, then idle and finished ones",
    eviction=make_plec_eviction, predictor=make_plec_predictor, decode=DualBatchPipeline,
    # the token scheduler keeps the contiguous split where its clustering activates no fewer pairs (measured no
    # worse on recorded routing, docs/papers.md); policy_options={"keep_contiguous": False}: the paper's
    mechanisms=Mechanisms(keep_contiguous=True),
)
