"""LoRA on a projection for a batch mixing adapters: the base GEMM runs once for every row,
then each resident adapter's low-rank update is added to its own rows, all adapters in one
batched (bmm) shrink and one expand."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraGroups:
    """One step's rows grouped by adapter slot (Punica's segments, padded to one length).

    `token_rows[g, j]` is the j-th batch row of group g (0 past the group's end, where
    `is_row[g, j]` is 0); group g runs the adapter in slot `slots[g]`. `all_rows_slot` is set
    when one adapter covers every row, which needs no gather.
    """

    slots: torch.Tensor | None = None  # [num_groups] int64
    token_rows: torch.Tensor | None = None  # [num_groups, max_group_rows] int64
    is_row: torch.Tensor | None = None  # [num_groups, max_group_rows, 1] model dtype
    all_rows_slot: int | None = None
    slot_range: tuple[int, int] | None = None  # (start, stop) when the slots are consecutive


@dataclass
class LoraBatch:
    """What every LoraLinear of a model reads in a step: None when no row has an adapter."""

    groups: LoraGroups | None = None


class LoraLinear:
    """The adapter slots of one projection: `a[s]` [in_features, width] and `b[s]`
    [width, out_features] hold slot s's pieces side by side (piece k in columns / rows
    `k * rank_width : k * rank_width + rank`), B pre-scaled; unused entries are zero, so they
    add nothing. `add_to(out, x)` adds each row's adapter update to `out` in place."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        max_pieces: int,
        num_slots: int,
        batch: LoraBatch,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.max_pieces = max_pieces
        self.num_slots = num_slots
        self.batch = batch
        self.device = device
        self.dtype = dtype
        self.rank_width = 0
        self.a = torch.zeros(num_slots, in_features, 0, device=device, dtype=dtype)
        self.b = torch.zeros(num_slots, 0, out_features, device=device, dtype=dtype)

    def resize(self, rank_width: int) -> None:
        """Room for pieces of up to `rank_width`; clears every slot."""
        self.rank_width = rank_width
        width = self.max_pieces * rank_width
        shape_a = (self.num_slots, self.in_features, width)
        shape_b = (self.num_slots, width, self.out_features)
        self.a = torch.zeros(shape_a, device=self.device, dtype=self.dtype)
        self.b = torch.zeros(shape_b, device=self.device, dtype=self.dtype)

    def set_slot(self, slot: int, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these (row_start, a [rank, in], scaled_b [rows, rank]) pieces."""
        assert len(pieces) <= self.max_pieces
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        for k, (row_start, piece_a, piece_b) in enumerate(pieces):
            col, rank = k * self.rank_width, piece_a.shape[0]
            a[:, col : col + rank].copy_(piece_a.t())
            b[col : col + rank, row_start : row_start + piece_b.shape[0]].copy_(piece_b.t())

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [num_tokens, out_features] += each row's adapter update of x [num_tokens, in]."""
        groups = self.batch.groups
        if groups is None:
            return
        if groups.all_rows_slot is not None:
            slot = groups.all_rows_slot
            out.add_(torch.mm(torch.mm(x, self.a[slot]), self.b[slot]))
            return
        assert groups.slots is not None and groups.token_rows is not None
        assert groups.is_row is not None
        if groups.slot_range is not None:
            a = self.a[groups.slot_range[0] : groups.slot_range[1]]
            b = self.b[groups.slot_range[0] : groups.slot_range[1]]
        else:
            a, b = self.a.index_select(0, groups.slots), self.b.index_select(0, groups.slots)
        num_groups, max_rows = groups.token_rows.shape
        rows = groups.token_rows.view(-1)
        # [num_groups, max_group_rows, in_features]
        grouped = x.index_select(0, rows).view(num_groups, max_rows, -1)
        # NOTE: zeroing the padding rows' shrink makes their update zero, so adding it to row 0
        # changes nothing.
        shrunk = torch.bmm(grouped, a).mul_(groups.is_row)
        update = torch.bmm(shrunk, b)
        out.index_add_(0, rows, update.view(num_groups * max_rows, -1))
