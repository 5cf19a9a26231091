"""Host time of the serving engine's per-pass token history (StepInfo.history_*), before and after, CPU.

Before: every prefill and decode pass rebuilt a [B, S] tensor of every token of every sequence from their
Python lists (``rebuilt``, the engine's old ``_history``), whatever the backend. After: a backend that reads no
history (``needs_history`` False: every policy but expertflow) gets none (0 work); the expertflow policy's gets
it from :class:`~moeflow.engine.token_history.TokenHistory`, which a decode pass writes its B tokens into and
gathers its rows from. One decode pass of B sequences at a context of ``--contexts`` tokens each; medians of
``--repeats`` calls. No GPU: on one, the "after" gather is device work plus one small host->device copy.

    PYTHONPATH=$PWD python -m benchmarks.host.serve_history --out benchmarks/results/serve/history_host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from moeflow.engine.token_history import TokenHistory


def rebuilt(seqs: list[tuple[list[int], list[int]]], pos: torch.Tensor, mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's history before: (prompt, generated) lists [B], pos int64 [B, T], mask bool [B, T]."""
    ends = [int(p[m].max()) + 1 for p, m in zip(pos.cpu(), mask.cpu(), strict=True)]
    ids = torch.zeros((len(seqs), max(ends)), dtype=torch.long)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for i, ((prompt, generated), end) in enumerate(zip(seqs, ends, strict=True)):
        ids[i, :end] = torch.tensor((prompt + generated)[:end], dtype=torch.long)
        valid[i, :end] = True
    return ids, valid


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(batch: int, context: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(context)
    seqs = [(torch.randint(0, 32000, (context - 64,), generator=gen).tolist(),
             torch.randint(0, 32000, (64,), generator=gen).tolist()) for _ in range(batch)]
    ids = torch.tensor([[g[-1]] for _, g in seqs])
    pos = torch.full((batch, 1), context - 1, dtype=torch.long)
    mask = torch.ones_like(ids, dtype=torch.bool)
    history = TokenHistory(batch, context, "cpu")
    rows = list(range(batch))
    for row, (prompt, generated) in enumerate(seqs):  # the tokens fed before this pass
        history.ids[row] = torch.tensor(prompt + generated)
    want = rebuilt(seqs, pos, mask)
    got = history.feed(rows, ids, pos, mask)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    return {"batch": batch, "context": context,
            "before_us": round(median_us(lambda: rebuilt(seqs, pos, mask), repeats), 1),
            "after_expertflow_us": round(median_us(lambda: history.feed(rows, ids, pos, mask), repeats), 1),
            "after_other_policies_us": 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [measure(args.batch, c, args.repeats) for c in args.contexts]
    result = {"what": "host us per decode pass for StepInfo.history (median)", "torch": torch.__version__,
              "loadavg_1m": os.getloadavg()[0], "rows": rows}
    lines = ["| batch | context | before (rebuilt, every policy) us | after, expertflow (device buffer) us | "
             "after, other policies us |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['before_us']} | {r['after_expertflow_us']} | "
              f"{r['after_other_policies_us']} |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(f"{result['what']}; CPU, torch {torch.__version__}, load "
                                               f"{result['loadavg_1m']:.1f}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
