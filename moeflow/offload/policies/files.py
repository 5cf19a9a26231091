"""Predictor files of the learned policies: ``OffloadConfig.predictor_path``, else
``<checkpoint dir>/predictors/<kind>.pt``; a learned policy without either raises
:class:`~moeflow.errors.SchedulingError` saying how to train one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeflow.errors import SchedulingError
from moeflow.offload.policies.spec import PolicyContext

PREDICTOR_DIR = "predictors"  # inside a checkpoint directory: <kind>.pt


# ------------------------------------------------------------------------------------------ predictor files
def default_predictor_path(ctx: PolicyContext, kind: str) -> Path | None:
    """``<checkpoint dir>/predictors/<kind>.pt`` (None without a checkpoint directory)."""
    if ctx.checkpoint_dir is None:
        return None
    return Path(ctx.checkpoint_dir) / PREDICTOR_DIR / f"{kind}.pt"


def find_predictor_file(ctx: PolicyContext, kind: str) -> Path | None:
    """The predictor file for ``kind``: ``config.predictor_path`` (must exist), else the checkpoint's own."""
    given = ctx.config.predictor_path
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise SchedulingError(f"OffloadConfig.predictor_path={given!r}: no such file")
        return path
    path = default_predictor_path(ctx, kind)
    return path if path is not None and path.is_file() else None


def _train_hint(ctx: PolicyContext, kind: str) -> str:
    model = ctx.checkpoint_dir or "PATH"
    out = default_predictor_path(ctx, kind) or f"{kind}.pt"
    return (f"train one with `moeflow trace --model {model} --prompts prompts.jsonl --out trace.safetensors "
            f"--hidden` then `moeflow train-predictor --kind {kind} --trace trace.safetensors --out {out}`, "
            f"and pass OffloadConfig(predictor_path=...) unless it sits at <checkpoint>/{PREDICTOR_DIR}/{kind}.pt")


def load_policy_predictor(ctx: PolicyContext, kind: str) -> Any:
    """The ``kind`` predictor for the model of ``ctx``, checked against its shape (layers, experts, top-k,
    hidden size), on ``ctx.device``. FineMoE without a file starts with an empty store."""
    from moeflow.offload.predictors import PredictorError, read_predictor_blob
    from moeflow.offload.predictors.runtime import build_predictor

    path = find_predictor_file(ctx, kind)
    if path is None and kind != "finemoe":
        where = default_predictor_path(ctx, kind)
        looked = f"no predictor file at {where}" if where is not None else "no predictor file given"
        raise SchedulingError(f"policy {ctx.config.policy!r} needs a trained {kind} predictor: {looked}; "
                              + _train_hint(ctx, kind))
    try:
        if path is not None:
            found = str(read_predictor_blob(path)["kind"])
            if found != kind:
                raise SchedulingError(f"policy {ctx.config.policy!r} needs a {kind} predictor, but {path} holds a "
                                      f"{found!r} predictor")
        return build_predictor(kind, ctx, path)
    except PredictorError as e:
        raise SchedulingError(f"policy {ctx.config.policy!r}: {e}") from e


def has_predictor_file(ctx: PolicyContext, kind: str) -> bool:
    """Whether a ``kind`` predictor file is at hand (the given one holds that kind, or the checkpoint's exists)."""
    given = ctx.config.predictor_path
    if given is not None:
        from moeflow.offload.predictors import PredictorError, read_predictor_blob

        try:
            return str(read_predictor_blob(given)["kind"]) == kind
        except PredictorError:
            return False
    path = default_predictor_path(ctx, kind)
    return path is not None and path.is_file()
