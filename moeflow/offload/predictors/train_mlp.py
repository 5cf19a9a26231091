"""Training of the learned predictors' MLPs (DuoServe's ExpertMLP, ProMoE's per-layer MLPs): minibatch Adam on
BCE-with-logits."""

from __future__ import annotations

import time

import torch
from torch import nn

from moeflow.offload.predictors.base import PredictorError


def train_bce(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, lr: float,
              seed: int, max_seconds: float | None) -> list[float]:
    """Minibatch Adam on BCE-with-logits (x [M, in], y [M, E] in {0, 1}); returns the mean loss per epoch."""
    if x.shape[0] == 0:
        raise PredictorError("no training samples: the trace is empty or has too few layers for this distance")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    start = time.perf_counter()
    losses = []
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(x.shape[0], generator=gen)
        total, count = 0.0, 0
        for i in range(0, x.shape[0], batch_size):
            idx = perm[i : i + batch_size]
            if idx.numel() < 2 and any(isinstance(m, nn.BatchNorm1d) for m in model.modules()):
                continue  # BatchNorm cannot normalise one sample
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
            count += idx.numel()
        losses.append(total / max(count, 1))
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    model.eval()
    return losses
