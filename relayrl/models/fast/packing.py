"""Packing plans for the full-sequence passes: which tokens of a right-padded batch to compute, and where they sit.

`PaddedPacking` (`forward.backbone_hidden_states`) keeps every real token and drops the padding. `SharedPacking`
(`forward.selected_hidden_states`) computes each needed token once: the caller names the positions whose final
hidden state it needs (e.g. the positions that predict a loss-carrying token), and the packing keeps exactly the
work that feeds them, with every token's result unchanged:

* Truncation: a causal model's state at position t depends on positions <= t only, so each row is cut after its last
  selected position (a row's last token never predicts anything; neither do loss-free trailing tokens).
* Prefix sharing: two rows whose first t+1 tokens are equal have equal states at positions <= t in every layer (GRPO's
  generations of one prompt share the whole prompt). Such a token is computed once, by the lowest-index row that has
  it, and every row that shares it reads that copy (attention gathers its K/V per row; in backward the gather sums
  the rows' gradients, exactly the sum the repeated computation would have accumulated).
* Last-layer queries: the last decoder layer needs K/V for every kept token but attention output, MLP and final norm
  only at the tokens the caller selected (`query_index`).

Tensors move between the packed layout [N, ...] (the N distinct kept tokens, row-major by owner position) and the
padded per-row layout [B, S', ...] (S' = the longest kept row) that attention uses. Padded slots past a row's kept
length read packed token 0: with right padding a causal mask keeps every real query off them, and the outputs of
those slots are never packed back, so their values (and zero gradients) never reach a kept token.

`RowGroups` is the attention layout of a *packed* micro-batch (sequence packing: a bin of rows of very different
lengths): per-sequence attention, rows sorted by length and grouped so that each group, padded only to its own
longest row, wastes little; one causal attention call per group instead of one over [B, S'].
"""

from __future__ import annotations

import torch


class PaddedPacking:
    """Where the N real tokens of a right-padded [B, S] batch sit, to move tensors between [N, ...] and [B, S, ...]."""

    def __init__(self, input_lengths: torch.Tensor, batch: int, seq: int, device: torch.device) -> None:
        self.batch, self.seq = batch, seq
        lengths = input_lengths.to(device).clamp(1, seq)  # [B]
        cols = torch.arange(seq, device=device)  # [S]
        valid = cols[None, :] < lengths[:, None]  # [B, S]
        self.index: torch.Tensor | None = None  # [N] flat b*S+t of the real tokens; None when nothing is padding
        if bool(valid.all()):
            self.positions = cols.repeat(batch)  # [N] position id of each packed token
        else:
            self.index = valid.view(-1).nonzero().squeeze(1)
            self.positions = self.index % seq
        self.num_tokens = int(self.positions.shape[0])
        self.lengths = lengths

    def row_groups(self) -> RowGroups:
        """The per-sequence attention layout of these rows (packed micro-batches)."""
        flat = torch.arange(self.batch * self.seq, device=self.positions.device)  # [B*S]
        index = flat if self.index is None else self.index  # [N]
        packed_of_flat = torch.zeros_like(flat).index_copy_(0, index, torch.arange(self.num_tokens, device=flat.device))
        return RowGroups(self.lengths, packed_of_flat, index, self.seq)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [N, ...]."""
        flat = x.reshape(self.batch * self.seq, *x.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, S, ...] with zeros at padding."""
        if self.index is not None:
            x = x.new_zeros(self.batch * self.seq, *x.shape[1:]).index_copy(0, self.index, x)
        return x.view(self.batch, self.seq, *x.shape[1:])


class SharedPacking:
    """Kept and distinct tokens of right-padded `input_ids` [B, S] for the positions `select` [B, S] (bool)."""

    def __init__(self, input_ids: torch.Tensor, input_lengths: torch.Tensor, select: torch.Tensor) -> None:
        batch, seq = input_ids.shape
        device = input_ids.device
        cols = torch.arange(seq, device=device)  # [S]
        lengths = input_lengths.to(device).clamp(0, seq)  # [B]
        select = select.to(device=device, dtype=torch.bool) & (cols[None, :] < lengths[:, None])  # [B, S]
        # Kept length of each row: through its last selected position (0 when nothing is selected).
        kept = torch.where(select.any(1), seq - select.flip(1).int().argmax(1), 0)  # [B]
        self.batch, self.seq = batch, max(int(kept.max()) if batch else 0, 1)
        s = self.seq
        ids, keep = input_ids[:, :s], cols[None, :s] < kept[:, None]  # [B, S'] each
        owner = prefix_owners(ids, kept)  # [B, S'] lowest row that computes the same token (itself if none lower)
        rows = torch.arange(batch, device=device)
        distinct = keep & (owner == rows[:, None])  # [B, S'] tokens computed here
        flat_distinct = distinct.view(-1)
        self.index = flat_distinct.nonzero().squeeze(1)  # [N] flat b*S'+t of each distinct token
        self.num_tokens = int(self.index.shape[0])
        self.positions = self.index % s  # [N] position id of each packed token
        packed_of_flat = torch.cumsum(flat_distinct.long(), 0) - 1  # [B*S'] packed index where distinct
        source = (owner * s + cols[None, :s]).view(-1)  # [B*S'] flat slot of each slot's owner token
        slot = packed_of_flat.index_select(0, source)  # [B*S'] packed token each slot reads
        self.slot = torch.where(keep.view(-1), slot, torch.zeros_like(slot))  # padding reads token 0
        # Selected positions (row-major) -> their packed token; the last layer computes queries for those only.
        selected_packed = self.slot[select[:, :s].reshape(-1)]  # [M]
        self.query_index, self.output_index = torch.unique(selected_packed, return_inverse=True)  # [Q], [M]
        self.num_selected = int(selected_packed.shape[0])
        # Rows computing at least one distinct token; the others only read tokens other rows compute.
        self._own = torch.where(distinct.any(1), kept, torch.zeros_like(kept))  # [B]

    def row_groups(self) -> RowGroups:
        """The per-sequence attention layout (packed micro-batches); rows without a distinct token are left out."""
        return RowGroups(self._own, self.slot, self.index, self.seq)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S', ...] -> [N, ...]: the distinct tokens."""
        return x.reshape(self.batch * self.seq, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, S', ...]: every row's view of its tokens (padding slots hold token 0's values)."""
        return x.index_select(0, self.slot).view(self.batch, self.seq, *x.shape[1:])


#: A separate attention call pays for itself once it saves about this many padded query-key pairs per row and head
#: (the dispatch and gathers of one CPU attention call cost about as much as 64 x 64 pairs of head size 32).
GROUP_CALL_PAIRS = 64 * 64


class RowGroups:
    """Per-sequence causal attention over rows of different lengths, as a few padded attention calls.

    `lengths` [B]: tokens of each row that take part (0: the row is left out); `slot` [B*S]: the packed token each
    padded slot (b, t) reads; `index` [N]: the flat slot b*S+t whose attention output each packed token takes.
    Rows are sorted by length (longest first) and a row joins the current group while padding it to the group's
    longest row costs fewer query-key pairs than a call of its own (`GROUP_CALL_PAIRS`). Each group is attended as
    [rows, heads, longest, D] with a causal mask: right padding keeps every real query off padding keys, as in the
    one-call layout, so each sequence attends to exactly its own earlier tokens.
    """

    def __init__(self, lengths: torch.Tensor, slot: torch.Tensor, index: torch.Tensor, seq: int) -> None:
        device = slot.device
        lens = [int(x) for x in lengths.tolist()]
        order = sorted((b for b in range(len(lens)) if lens[b] > 0), key=lambda b: -lens[b])
        groups: list[list[int]] = []
        for b in order:
            if groups and lens[groups[-1][0]] ** 2 - lens[b] ** 2 <= GROUP_CALL_PAIRS:
                groups[-1].append(b)
            else:
                groups.append([b])
        row_start = torch.zeros(len(lens), dtype=torch.long, device=device)  # [B] grouped offset of (b, 0)
        slots = slot.view(len(lens), seq)  # [B, S]
        self.parts: list[tuple[torch.Tensor, int, int]] = []  # (gathered packed tokens [n*m], rows n, width m)
        offset = 0
        for rows in groups:
            width = lens[rows[0]]
            ids = torch.tensor(rows, dtype=torch.long, device=device)  # [n]
            self.parts.append((slots.index_select(0, ids)[:, :width].reshape(-1), len(rows), width))
            row_start[ids] = offset + torch.arange(len(rows), device=device) * width
            offset += len(rows) * width
        self.pack_index = row_start[index // seq] + index % seq  # [N] grouped position of each packed token


#: Elements of one [rows, B, S'] comparison block when finding shared prefixes (bounds the memory of a big batch).
COMPARE_BLOCK_ELEMENTS = 1 << 24


def prefix_owners(ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """owner[b, t] = the lowest row o with ids[o, :t+1] == ids[b, :t+1] and kept[o] > t (b itself when t < kept[b]).

    ids [B, S'], kept [B]. Row o can serve row b at position t exactly when r[b, o] = min(lcp(b, o), kept[o]) > t,
    so the owner is the first o whose running maximum of r[b, :o+1] exceeds t: a sorted search per row. Memory is
    O(B^2) plus one comparison block; values at t >= kept[b] are unspecified (in range).
    """
    batch, seq = ids.shape
    lcp = torch.empty((batch, batch), dtype=torch.long, device=ids.device)  # [B, B] common prefix length
    block = max(1, COMPARE_BLOCK_ELEMENTS // max(1, batch * seq))
    for a in range(0, batch, block):
        differ = ids[a : a + block, None, :] != ids[None, :, :]  # [blk, B, S']
        first = differ.int().argmax(2)  # [blk, B] first differing position (0 when none differs)
        lcp[a : a + block] = torch.where(differ.any(2), first, seq)
    reach = torch.minimum(lcp, kept[None, :]).cummax(1).values  # [B, B] non-decreasing along o
    t = torch.arange(seq, device=ids.device).expand(batch, seq).contiguous()  # [B, S']
    return torch.searchsorted(reach, t, right=True).clamp(max=batch - 1)  # [B, S']
