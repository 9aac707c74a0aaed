"""The per-step values every graphrt kernel reads, as device tensors.

In the runtime these are views of one device arena that a single pinned copy fills per
step; used on their own (eager), any tensors with these shapes and dtypes will do.
Capacities are the tensors' sizes: a launch sized from them stays valid for any step that
fits, which is what lets one captured graph serve every step of a bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Device-side description of one step (S = sequence capacity, T = token capacity).

    query_start_loc: [S + 1] int32. Cumulative new-token counts; sequence i owns query
        rows ``query_start_loc[i] : query_start_loc[i + 1]``. Padded sequences have no new
        tokens, so the last entry is the step's token count.
    seq_lens:        [S] int32. Context already cached plus the new tokens.
    block_table:     [S, max_blocks_per_seq] int32. Cache block of each block_size keys;
        any strides (the runtime's is column-major).
    prefix_ranges:   [S, R, 2] int32. Half-open ``[start, end)`` positions of tokens that
        attend to each other bidirectionally; sorted, non-overlapping; unused slots are
        empty (start == end) and change nothing.
    slot_mapping:    [T] int64. Cache slot (block * block_size + offset) of each new
        token; -1 means "do not write" (padding).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    prefix_ranges: torch.Tensor
    slot_mapping: torch.Tensor

    def __post_init__(self) -> None:
        s = self.seq_lens.shape[0] if self.seq_lens.dim() == 1 else -1
        expect = {
            "query_start_loc": (self.query_start_loc, torch.int32, 1),
            "seq_lens": (self.seq_lens, torch.int32, 1),
            "block_table": (self.block_table, torch.int32, 2),
            "prefix_ranges": (self.prefix_ranges, torch.int32, 3),
            "slot_mapping": (self.slot_mapping, torch.int64, 1),
        }
        device = self.seq_lens.device
        for name, (t, dtype, dim) in expect.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"AttentionMetadata.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"AttentionMetadata.{name} must be {dtype}, got {t.dtype}")
            if t.dim() != dim:
                raise ValueError(f"AttentionMetadata.{name} must have {dim} dims, got shape {tuple(t.shape)}")
            if t.device != device:
                raise ValueError(f"AttentionMetadata.{name} is on {t.device}, seq_lens on {device}")
            if t.numel() and t.stride(-1) != 1 and name != "block_table":
                raise ValueError(f"AttentionMetadata.{name} needs a contiguous last dim, strides {t.stride()}")
        if self.query_start_loc.shape[0] != s + 1:
            raise ValueError(f"AttentionMetadata.query_start_loc has {self.query_start_loc.shape[0]} entries, "
                             f"seq_lens has {s}: need seq_lens + 1")
        if self.block_table.shape[0] != s or self.prefix_ranges.shape[0] != s:
            raise ValueError(f"AttentionMetadata.block_table {tuple(self.block_table.shape)} and prefix_ranges "
                             f"{tuple(self.prefix_ranges.shape)} must have seq_lens' {s} rows")
        if self.prefix_ranges.shape[2] != 2 or not self.prefix_ranges.is_contiguous():
            raise ValueError(f"AttentionMetadata.prefix_ranges must be a contiguous [S, R, 2] tensor, "
                             f"got shape {tuple(self.prefix_ranges.shape)}")

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def max_num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def max_prefix_ranges(self) -> int:
        return self.prefix_ranges.shape[1]
