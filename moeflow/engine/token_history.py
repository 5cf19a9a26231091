"""Every token fed to each row of the serving engine's slotted cache, kept on the device as it is fed.

Path predictors (the expertflow policy: ``ExpertBackend.needs_history``) read each sequence's tokens so far with
every pass (``StepInfo.history_ids`` / ``history_mask``). Rebuilding them from the sequences' Python lists each
pass costs O(batch x context) host work (65k ints at 16 rows of 4k tokens); here a pass writes only its own
tokens into a persistent [rows, max_len] buffer and gathers its rows from it.
"""

from __future__ import annotations

import torch


class TokenHistory:
    """ids int64 [rows, max_len] on ``device``: row r holds, at each position, the token its sequence fed there.

    Positions a row has not been fed since :meth:`clear` hold 0, so a gathered row is its tokens so far followed by
    zeros (what a rebuilt history holds): a sequence is fed in order from position 0, so the positions a pass has
    fed are exactly [0, end) and the validity of a gathered row is ``position < end``.
    """

    def __init__(self, rows: int, max_len: int, device: torch.device | str) -> None:
        self.ids = torch.zeros((rows, max_len), dtype=torch.long, device=device)
        self.max_len = max_len

    def clear(self, row: int, prefix: list[int] | None = None) -> None:
        """A row handed to a new sequence: nothing fed yet, or only ``prefix`` (positions [0, len(prefix)): the
        tokens whose keys the prefix cache gave it)."""
        self.ids[row] = 0
        if prefix:
            self.ids[row, : len(prefix)] = torch.tensor(prefix, dtype=torch.long).to(self.ids.device)

    def feed(self, rows: list[int], ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a pass's real tokens and return its rows' histories.

        rows: each pass row's cache row [B]; ids/pos int64 [B, T] and mask bool [B, T] on the host (the pass's
        tokens, positions and real tokens). Returns (ids int64 [B, S], mask bool [B, S]) on the device: each row's
        tokens up to its furthest real position, S the furthest over the pass. A row may appear more than once
        (the captured passes' padding copies) when its copies feed the same tokens.
        """
        B = len(rows)
        row_t = torch.tensor(rows, dtype=torch.long)
        flat = (row_t[:, None] * self.max_len + pos)[mask]  # [N] real tokens only: padding writes nothing
        ends = pos.masked_fill(~mask, -1).amax(dim=1) + 1  # [B]
        # one host->device copy for the pass: written indices, written values, rows, ends
        packed = torch.cat([flat, ids[mask], row_t, ends]).to(self.ids.device)
        n = flat.numel()
        self.ids.view(-1).index_copy_(0, packed[:n], packed[n:2 * n])
        dev_rows, dev_ends = packed[2 * n:2 * n + B], packed[2 * n + B:]
        width = int(ends.max())
        hist = self.ids[:, :width].index_select(0, dev_rows)
        valid = torch.arange(width, device=self.ids.device) < dev_ends[:, None]
        return hist, valid
