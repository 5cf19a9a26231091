"""The serving engine's device token history (moeflow.engine.token_history) against a rebuild from the tokens.

A pass's history is what the engine rebuilt from its sequences' Python lists before: each row's tokens up to its
furthest real position, zeros after, and a validity mask. Chunked prefills with right padding, decode passes
with padding copies of a row, and a row handed to a new sequence all give the rebuilt history.
"""

from __future__ import annotations

import torch

from moeflow.engine.token_history import TokenHistory


def rebuilt(tokens: list[list[int]], pos: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The history as the engine built it every pass: tokens [B] lists, pos int64 [B, T], mask bool [B, T]."""
    ends = [int(p[m].max()) + 1 for p, m in zip(pos, mask, strict=True)]
    ids = torch.zeros((len(tokens), max(ends)), dtype=torch.long)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for i, (t, end) in enumerate(zip(tokens, ends, strict=True)):
        ids[i, :end] = torch.tensor(t[:end])
        valid[i, :end] = True
    return ids, valid


def check(history: TokenHistory, rows: list[int], tokens: list[list[int]], starts: list[int], takes: list[int]):
    """One pass: row i feeds tokens[i][starts[i]:starts[i] + takes[i]], right-padded to the longest."""
    width = max(takes)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (t, s, n) in enumerate(zip(tokens, starts, takes, strict=True)):
        ids[i, :n] = torch.tensor(t[s:s + n])
        pos[i, :n] = torch.arange(s, s + n)
        mask[i, :n] = True
    got = history.feed(rows, ids, pos, mask)
    want = rebuilt(tokens, pos, mask)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_feeding_passes_gives_the_rebuilt_history():
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 500, (n,), generator=gen).tolist() for n in (20, 10, 30, 12)]
    history = TokenHistory(rows=3, max_len=32, device="cpu")
    for row in range(3):
        history.clear(row)
    # chunked prefills, right-padded: rows 0, 1, 2 read 5, 7, 3 tokens, then 6, -, 9
    check(history, [0, 1, 2], seqs[:3], [0, 0, 0], [5, 7, 3])
    check(history, [0, 2], [seqs[0], seqs[2]], [5, 3], [6, 9])
    # decode passes of one token each, rows in any order, a row repeated (a captured pass's padding copy)
    check(history, [2, 0, 1, 2], [seqs[2], seqs[0], seqs[1], seqs[2]], [12, 11, 7, 12], [1, 1, 1, 1])
    check(history, [1, 0], [seqs[1], seqs[0]], [7, 12], [1, 1])
    # row 1 goes to a new, shorter sequence: cleared, its old tokens gone from the history
    history.clear(1)
    check(history, [1, 2], [seqs[3], seqs[2]], [0, 13], [4, 1])
    assert torch.equal(history.ids[1, 4:], torch.zeros(28, dtype=torch.long))
