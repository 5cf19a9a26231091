"""Figures of simulation results (matplotlib, the ``plot`` extra: ``pip install moeflow[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moeflow.errors import MoeflowError
from moeflow.sim.engine import Interval
from moeflow.sim.simulator import SimResult

COLORS = {
    ("compute", "attention"): "#9e9e9e",
    ("compute", "expert"): "#1f77b4",
    ("compute", "head"): "#555555",
    ("compute", "wait"): "#d62728",
    ("copy", "needed"): "#ff7f0e",
    ("copy", "prefetch"): "#2ca02c",
    ("cpu", "expert"): "#9467bd",
}
LABELS = {
    ("compute", "attention"): "attention / router (non-MoE layer)",
    ("compute", "expert"): "expert compute",
    ("compute", "head"): "head",
    ("compute", "wait"): "compute stream waits for a copy",
    ("copy", "needed"): "copy: needed now (high priority)",
    ("copy", "prefetch"): "copy: predicted (low priority)",
    ("cpu", "expert"): "expert computed on the CPU",
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MoeflowError("plotting needs matplotlib: pip install 'moeflow[plot]'") from e
    return plt


def _lanes(ax: Any, intervals: Sequence[Interval], title: str) -> None:
    lanes = {"cpu": 2, "compute": 1, "copy": 0, "disk": -1}
    seen = set()
    for iv in intervals:
        key = (iv.lane, iv.kind)
        y = lanes[iv.lane]
        ax.broken_barh([(iv.start * 1e3, (iv.end - iv.start) * 1e3)], (y - 0.35, 0.7),
                       facecolors=COLORS.get(key, "#999999"), edgecolor="white", linewidth=0.3,
                       label=LABELS.get(key) if key not in seen else None)
        seen.add(key)
    disk = any(iv.lane == "disk" for iv in intervals)
    cpu = any(iv.lane == "cpu" for iv in intervals)
    ax.set_yticks(([-1] if disk else []) + [0, 1] + ([2] if cpu else []),
                  (["disk reads"] if disk else []) + ["copy stream", "compute stream"] + (["CPU"] if cpu else []))
    ax.set_xlabel("ms from the start of the forward pass")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(-1.6 if disk else -0.6, 2.6 if cpu else 1.6)
    end = max((iv.end for iv in intervals), default=0.0) * 1e3
    ax.set_xlim(0, end * 1.01 if end else 1)


def plot_timeline(result: SimResult, path: str | Path) -> Path:
    """Compute and copy lanes of the recorded prefill pass and decode pass of ``result``."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.5))
    ttft = f"{result.ttft_s * 1e3:.2f} ms" if result.ttft_s is not None else "n/a"
    tpot = f"{result.tpot_s * 1e3:.2f} ms/token" if result.tpot_s is not None else "n/a"
    _lanes(axes[0], result.timeline_prefill, f"prefill of the first sequence (TTFT mean {ttft})")
    _lanes(axes[1], result.timeline_decode, f"one decode step of the first sequence (mean {tpot})")
    handles, labels = {}, {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles[lab], labels[lab] = h, lab
    fig.legend(list(handles.values()), list(labels.values()), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"policy {result.policy!r}, {result.slots}/{result.total_experts} expert slots, profile "
                 f"{result.profile!r}", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(rows: Sequence[dict[str, Any]], path: str | Path, title: str, *, bound_s: float | None = None,
               max_slots: int | None = None) -> Path:
    """Time per output token against the slot budget, one line per policy.

    rows: dicts with ``policy``, ``slots``, ``tpot_s`` (e.g. ``SimResult.as_dict()``).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    markers = "osD^v<>ph*"
    for i, pol in enumerate(policies):
        pts = sorted((r["slots"], r["tpot_s"] * 1e3) for r in rows if r["policy"] == pol and r["tpot_s"] is not None)
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        style = "--" if pol in ("oracle", "resident") else "-"
        ax.plot(xs, ys, style, marker=markers[i % len(markers)], markersize=4, label=pol)
    if bound_s is not None:
        ax.axhline(bound_s * 1e3, color="black", linewidth=0.8, linestyle=":", label="compute bound (offloaded)")
    if max_slots is not None:
        ax.axvline(max_slots, color="grey", linewidth=0.8, linestyle="-.",
                   label=f"slots that fit the GPU ({max_slots})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("device expert slots")
    ax.set_ylabel("time per output token (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
