"""Host-side description of one step: what each sequence brings, checked and packed.

Prefix ranges are half-open ``[start, end)`` in 0-based sequence positions, as Python
slices. A convention with inclusive ends (``[first, last]``) converts as
``(first, last + 1)``; one that stores ``(start, length)`` as ``(start, start + length)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from graphrt.config import RuntimeConfig
from graphrt.kernels.metadata import AttentionMetadata


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True, kw_only=True)
class SeqStep:
    """One sequence's share of a step.

    q_len:         new tokens this step (>= 1): a decode has 1, a prefill chunk more.
    context_len:   tokens of this sequence already in the KV cache.
    block_ids:     cache blocks of the sequence in order, covering context_len + q_len.
    prefix_ranges: half-open (start, end) position ranges whose tokens attend to each
                   other bidirectionally (one per image); sorted, non-overlapping.
    """

    q_len: int
    context_len: int
    block_ids: Sequence[int]
    prefix_ranges: Sequence[tuple[int, int]] = ()

    @property
    def seq_len(self) -> int:
        return self.context_len + self.q_len


@dataclass(frozen=True)
class Step:
    """A batch of SeqSteps, held as columns (numpy int64) for vectorised checks and packing."""

    seqs: Sequence[SeqStep]
    q_lens: np.ndarray = field(init=False, repr=False)          # [n]
    context_lens: np.ndarray = field(init=False, repr=False)    # [n]
    block_counts: np.ndarray = field(init=False, repr=False)    # [n]
    block_ids: np.ndarray = field(init=False, repr=False)       # [sum(block_counts)]
    range_counts: np.ndarray = field(init=False, repr=False)    # [n]
    ranges: np.ndarray = field(init=False, repr=False)          # [sum(range_counts), 2]

    def __post_init__(self) -> None:
        seqs = tuple(self.seqs)
        for i, s in enumerate(seqs):
            if not isinstance(s, SeqStep):
                raise TypeError(f"Step.seqs[{i}] must be a SeqStep, got {type(s).__name__}")
            if not _is_int(s.q_len) or not _is_int(s.context_len):
                raise TypeError(f"seq {i}: q_len and context_len must be ints, got "
                                f"{type(s.q_len).__name__} and {type(s.context_len).__name__}")
        try:
            block_counts = np.fromiter((len(s.block_ids) for s in seqs), np.int64, len(seqs))
            block_ids = np.concatenate([np.asarray(s.block_ids, dtype=np.int64).reshape(-1) for s in seqs]
                                       or [np.zeros(0, np.int64)])
            range_arrays = [np.asarray(s.prefix_ranges, dtype=np.int64).reshape(-1, 2) for s in seqs]
        except (TypeError, ValueError) as exc:
            raise TypeError(f"Step: block_ids must be ints and prefix_ranges (start, end) pairs of ints ({exc})") from None
        for name, value in (
            ("seqs", seqs),
            ("q_lens", np.fromiter((s.q_len for s in seqs), np.int64, len(seqs))),
            ("context_lens", np.fromiter((s.context_len for s in seqs), np.int64, len(seqs))),
            ("block_counts", block_counts),
            ("block_ids", block_ids),
            ("range_counts", np.fromiter((len(r) for r in range_arrays), np.int64, len(seqs))),
            ("ranges", np.concatenate(range_arrays or [np.zeros((0, 2), np.int64)])),
        ):
            object.__setattr__(self, name, value)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.q_lens.sum())

    @property
    def seq_lens(self) -> np.ndarray:
        return self.context_lens + self.q_lens

    @property
    def is_decode(self) -> bool:
        return bool((self.q_lens == 1).all())

    def validate(self, cfg: RuntimeConfig) -> None:
        """Raise ValueError naming the sequence (and range) that breaks a limit of ``cfg``."""
        n = self.num_seqs
        if not 1 <= n <= cfg.max_num_seqs:
            raise ValueError(f"Step has {n} sequences; allowed 1..max_num_seqs={cfg.max_num_seqs}")
        _first_bad(self.q_lens < 1, "q_len must be >= 1, got {}", self.q_lens)
        _first_bad(self.context_lens < 0, "context_len must be >= 0, got {}", self.context_lens)
        if self.num_tokens > cfg.max_num_tokens:
            raise ValueError(f"Step has {self.num_tokens} new tokens, more than max_num_tokens={cfg.max_num_tokens}")
        seq_lens = self.seq_lens
        _first_bad(seq_lens > cfg.max_model_len, f"context_len + q_len = {{}} exceeds max_model_len={cfg.max_model_len}",
                   seq_lens)
        needed = -(-seq_lens // cfg.block_size)
        _first_bad(self.block_counts < needed,
                   f"has {{}} block_ids, fewer than the ceil(seq_len / {cfg.block_size}) its seq_len needs",
                   self.block_counts)
        _first_bad(self.block_counts > cfg.max_blocks_per_seq,
                   f"has {{}} block_ids, more than max_blocks_per_seq={cfg.max_blocks_per_seq}", self.block_counts)
        owner = np.repeat(np.arange(n), self.block_counts)
        bad = (self.block_ids < 0) | (self.block_ids >= cfg.num_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"seq {owner[j]}: block id {self.block_ids[j]} is outside [0, num_blocks={cfg.num_blocks})")
        _first_bad(self.range_counts > cfg.max_prefix_ranges,
                   f"has {{}} prefix ranges, more than max_prefix_ranges={cfg.max_prefix_ranges}", self.range_counts)
        validate_ranges(self.ranges, self.range_counts, seq_lens)

    def pack(self, block_size: int, *, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
             prefix_ranges: np.ndarray, slot_mapping: np.ndarray, positions: np.ndarray | None = None) -> None:
        """Write this (validated) step into host arrays sized for a bucket, padding it.

        Padded sequences get no tokens (query_start_loc repeats the total) and seq_len 0;
        padded tokens get slot -1. Only what the kernels read is written: block-table
        entries past a sequence's blocks and rows of padded sequences keep old values.
        """
        n, total = self.num_seqs, self.num_tokens
        qsl = query_start_loc
        qsl[0] = 0
        np.cumsum(self.q_lens, out=qsl[1 : n + 1])
        qsl[n + 1 :] = total
        seq_lens[:n] = self.seq_lens
        seq_lens[n:] = 0
        owner = np.repeat(np.arange(n), self.block_counts)
        col = np.arange(self.block_ids.shape[0]) - np.repeat(np.cumsum(self.block_counts) - self.block_counts,
                                                               self.block_counts)
        block_table[owner, col] = self.block_ids
        prefix_ranges[:n] = 0
        r_owner = np.repeat(np.arange(n), self.range_counts)
        r_col = np.arange(self.ranges.shape[0]) - np.repeat(np.cumsum(self.range_counts) - self.range_counts,
                                                             self.range_counts)
        prefix_ranges[r_owner, r_col] = self.ranges
        tok_seq = np.repeat(np.arange(n), self.q_lens)                          # [total]
        pos = self.context_lens[tok_seq] + np.arange(total) - qsl[tok_seq]
        slot_mapping[:total] = block_table[tok_seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
        slot_mapping[total:] = -1
        if positions is not None:
            positions[:total] = pos
            positions[total:] = 0


def _first_bad(bad: np.ndarray, message: str, values: np.ndarray) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"seq {i}: " + message.format(values[i]))


def validate_ranges(ranges: np.ndarray, counts: np.ndarray, seq_lens: np.ndarray) -> None:
    """Check prefix ranges of many sequences at once.

    ranges: [m, 2] half-open (start, end), grouped by sequence; counts: [n] ranges per
    sequence; seq_lens: [n] lengths after the step. Each range must be non-empty, start at
    >= 0, end at or before its sequence's seq_len (keys not yet cached cannot be seen),
    and start at or after the previous range's end (sorted, non-overlapping).
    """
    if ranges.shape[0] == 0:
        return
    owner = np.repeat(np.arange(counts.shape[0]), counts)
    index = np.arange(ranges.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    start, end = ranges[:, 0], ranges[:, 1]
    prev_end = np.where(index > 0, np.roll(end, 1), 0)
    checks = (
        (start < 0, "starts before position 0"),
        (end <= start, "is empty or reversed (ranges are half-open [start, end))"),
        (end > seq_lens[owner], "ends past the sequence's length after this step ({seq_len}): "
                                "its keys are not in the cache"),
        (start < prev_end, "starts before the previous range ends (ranges must be sorted and non-overlapping)"),
    )
    for bad, what in checks:
        if bad.any():
            j = int(np.argmax(bad))
            what = what.format(seq_len=int(seq_lens[owner[j]]))
            raise ValueError(f"seq {owner[j]}: prefix range {index[j]} [{start[j]}, {end[j]}) {what}")


def build_metadata(step: Step, cfg: RuntimeConfig, device: torch.device | str, *, num_seqs: int | None = None,
                   num_tokens: int | None = None) -> tuple[AttentionMetadata, torch.Tensor]:
    """Validate ``step`` and build fresh device metadata and positions for it, padded to
    ``num_seqs`` sequences and ``num_tokens`` tokens (default: the step's own sizes).

    For eager use and tests: it allocates and copies every call. The runtime instead packs
    into its fixed pinned staging buffer and copies once.
    """
    step.validate(cfg)
    num_seqs = step.num_seqs if num_seqs is None else num_seqs
    num_tokens = step.num_tokens if num_tokens is None else num_tokens
    if num_seqs < step.num_seqs or num_tokens < step.num_tokens:
        raise ValueError(f"num_seqs={num_seqs}, num_tokens={num_tokens} cannot hold a step of "
                         f"{step.num_seqs} sequences and {step.num_tokens} tokens")
    host = dict(
        query_start_loc=np.zeros(num_seqs + 1, np.int32),
        seq_lens=np.zeros(num_seqs, np.int32),
        block_table=np.zeros((num_seqs, cfg.max_blocks_per_seq), np.int32),
        prefix_ranges=np.zeros((num_seqs, cfg.max_prefix_ranges, 2), np.int32),
        slot_mapping=np.zeros(num_tokens, np.int64),
    )
    positions = np.zeros(num_tokens, np.int64)
    step.pack(cfg.block_size, positions=positions, **host)
    meta = AttentionMetadata(**{k: torch.from_numpy(v).to(device) for k, v in host.items()})
    return meta, torch.from_numpy(positions).to(device)
