"""Host-side description of one step: what each sequence brings, checked and packed.

Prefix ranges are half-open ``[start, end)`` in 0-based sequence positions, as Python
slices. A convention with inclusive ends (``[first, last]``) converts as
``(first, last + 1)``; one that stores ``(start, length)`` as ``(start, start + length)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from graphrt.config import RuntimeConfig
from graphrt.kernels.metadata import AttentionMetadata

try:        # the same checks and writes in one C pass each (setup.py builds it where it can)
    from graphrt import _fast
except ImportError:
    _fast = None


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


class Step:
    """A batch of sequences' shares of one step, held as dense numpy arrays (built once)
    for vectorised checks and packing.

    ``Step(seqs)`` takes SeqSteps; ``Step.from_arrays(...)`` takes the columns directly,
    for loops that already keep their block tables in numpy.
    """

    __slots__ = ("q_lens", "context_lens", "block_table", "block_counts", "ranges", "range_counts",
                 "num_tokens", "_seq_lens", "is_decode", "block_columns", "_decode_slots")

    def __init__(self, seqs: Sequence[SeqStep]):
        seqs = tuple(seqs)
        for i, s in enumerate(seqs):
            if not isinstance(s, SeqStep):
                raise TypeError(f"Step.seqs[{i}] must be a SeqStep, got {type(s).__name__}")
            if not _is_int(s.q_len) or not _is_int(s.context_len):
                raise TypeError(f"seq {i}: q_len and context_len must be ints, got "
                                f"{type(s.q_len).__name__} and {type(s.context_len).__name__}")
        n = len(seqs)
        block_table, block_counts = _padded([s.block_ids for s in seqs], (), "block_ids")
        ranges, range_counts = _padded([s.prefix_ranges for s in seqs], (2,), "prefix_ranges")
        self._set(np.fromiter((s.q_len for s in seqs), np.int64, n),
                  np.fromiter((s.context_len for s in seqs), np.int64, n),
                  block_table, block_counts, ranges, range_counts)

    @classmethod
    def from_arrays(cls, *, q_lens, context_lens, block_table, block_counts=None, prefix_ranges=None,
                    range_counts=None) -> "Step":
        """q_lens, context_lens: [n] ints. block_table: [n, W] ints, row i holding sequence
        i's blocks in order (block_counts: [n] valid entries per row, default
        ceil(seq_len / block_size) at validation, i.e. the row's needed blocks).
        prefix_ranges: [n, R, 2] half-open ranges, the first range_counts[i] of row i used
        (default: the rows' non-empty ranges, which must then come first)."""
        q = np.asarray(q_lens)
        c = np.asarray(context_lens)
        table = np.asarray(block_table)
        if not (q.ndim == 1 and c.ndim == 1 and table.ndim == 2 and q.dtype.kind in "iu" and c.dtype.kind in "iu"
                and table.dtype.kind in "iu"):
            for name, a, dim in (("q_lens", q, 1), ("context_lens", c, 1), ("block_table", table, 2)):
                if a.dtype.kind not in "iu" or a.ndim != dim:
                    raise TypeError(f"Step.from_arrays: {name} must be a {dim}-d integer array, got {a.dtype} "
                                    f"{a.shape}")
        n = q.shape[0]
        if c.shape != (n,) or table.shape[0] != n:
            raise ValueError(f"Step.from_arrays: q_lens {q.shape}, context_lens {c.shape} and block_table "
                             f"{table.shape} must agree on the number of sequences")
        counts = None if block_counts is None else np.asarray(block_counts, dtype=np.int64).reshape(n)
        if prefix_ranges is None:
            ranges, rcounts = np.zeros((n, 0, 2), np.int64), None
        else:
            ranges = np.asarray(prefix_ranges, dtype=np.int64).reshape(n, -1, 2)
            if range_counts is None:      # None: the non-empty ranges, counted at validation (first in each row,
                rcounts = None            # or validate refuses)
            else:                         # slots past the counts may hold anything: make them empty
                rcounts = np.asarray(range_counts, dtype=np.int64).reshape(n)
                ranges = np.where((np.arange(ranges.shape[1]) < rcounts[:, None])[:, :, None], ranges, 0)
        step = cls.__new__(cls)
        step._set(q.astype(np.int64), c.astype(np.int64), table.astype(np.int64, copy=False), counts, ranges, rcounts)
        return step

    def _set(self, q_lens, context_lens, block_table, block_counts, ranges, range_counts) -> None:
        self.q_lens = q_lens                  # [n] new tokens
        self.context_lens = context_lens      # [n] cached tokens
        self.block_table = block_table        # [n, W] blocks, rows padded with 0
        self.block_counts = block_counts      # [n] valid entries per row (None: the needed ones, derived)
        self.ranges = ranges                  # [n, R, 2] half-open, rows padded with (0, 0)
        self.range_counts = range_counts      # [n] ranges per sequence (None: the non-empty ones, derived)
        self._seq_lens = None                 # context_lens + q_lens, when first asked for
        n = q_lens.shape[0]
        # a short Python sum beats numpy's reduction on a few items
        self.num_tokens = sum(q_lens.tolist()) if n <= _SMALL_STEP else int(q_lens.sum())
        # one new token each: once validate has checked every q_len >= 1, a total of n tokens
        # means exactly that (before validate it may be wrong for an invalid step)
        self.is_decode = self.num_tokens == n
        # block-table columns in use (what the runtime copies); validate() narrows it when
        # from_arrays left the counts to be derived
        self.block_columns = int(block_counts.max(initial=0)) if block_counts is not None else block_table.shape[1]
        self._decode_slots: tuple[int, list | np.ndarray] | None = None   # (block_size, [n] slots), set by validate

    def _derive_counts(self, block_size: int) -> None:
        """Fill in the counts from_arrays left to be derived: each row's needed blocks
        (ceil(seq_len / block_size)) and its non-empty ranges."""
        if self.block_counts is None:
            self.block_counts = -(-self.seq_lens // block_size)
        self._derive_range_counts()

    def _derive_range_counts(self) -> None:
        if self.range_counts is None:
            r = self.ranges
            self.range_counts = (np.count_nonzero(r[:, :, 1] > r[:, :, 0], axis=1) if r.shape[1]
                                 else np.zeros(r.shape[0], np.int64))

    @property
    def seq_lens(self) -> np.ndarray:
        """[n] context_len + q_len (computed once, when first asked for: the C check and
        pack do without it)."""
        if self._seq_lens is None:
            self._seq_lens = self.context_lens + self.q_lens
        return self._seq_lens

    @property
    def num_seqs(self) -> int:
        return self.q_lens.shape[0]

    def validate(self, cfg: RuntimeConfig) -> None:
        """Raise ValueError naming the sequence (and range) that breaks a limit of ``cfg``.
        One pass of cheap checks (in Python for a few sequences, as array reductions for
        many); the messages come from ``_diagnose`` on failure."""
        n = self.num_seqs
        if not 1 <= n <= cfg.max_num_seqs:
            raise ValueError(f"Step has {n} sequences; allowed 1..max_num_seqs={cfg.max_num_seqs}")
        if _fast is not None:
            columns = _fast.check(self.q_lens, self.context_lens, self.block_table, self.block_counts, self.ranges,
                                  self.range_counts, cfg.block_size, cfg.max_num_tokens, cfg.max_model_len,
                                  cfg.max_blocks_per_seq, cfg.num_blocks, cfg.max_prefix_ranges)
            if columns is not None:
                self.block_columns = columns
                return
            # broken somewhere: the checks below find where, and say it
        if n <= _SMALL_STEP:
            counts = self._checks_small(cfg)
            if counts is None:
                self._diagnose(cfg)     # raises, unless the fast checks were only conservative
                counts = self.block_counts.tolist()
            if not self._written_blocks_distinct_small(cfg.block_size):
                self._check_written_blocks(cfg.block_size)      # raises, naming the block
            self.block_columns = max(counts)
            return
        if not self._checks_numpy(cfg):         # sets block_columns
            self._diagnose(cfg)
        self._check_written_blocks(cfg.block_size)

    def _written_blocks_distinct_small(self, block_size: int) -> bool:
        """``_check_written_blocks``'s test in Python for a few sequences: True when the
        blocks that the new tokens write are distinct; for a decode it keeps each token's
        cache slot for ``pack``."""
        table, c = self.block_table, self.context_lens.tolist()
        n = len(c)
        if self.is_decode:
            blocks = [table.item(i, ci // block_size) for i, ci in enumerate(c)]
            self._decode_slots = (block_size, [b * block_size + ci % block_size for b, ci in zip(blocks, c)])
            return n == 1 or len(set(blocks)) == n
        blocks = []
        for i, (ci, si) in enumerate(zip(c, self.seq_lens.tolist())):
            blocks += table[i, ci // block_size: (si - 1) // block_size + 1].tolist()
        return len(set(blocks)) == len(blocks)

    def _check_written_blocks(self, block_size: int) -> None:
        """Raise ValueError unless the cache blocks that this step's new tokens write are all
        distinct. A block written by two of them (a block listed twice, or two sequences
        writing into one block) would have one token's K/V overwrite another's, or a
        sequence's context, whatever the offsets. Blocks only read (a shared prefix) may
        appear in any number of sequences; they are not looked at here."""
        n, table = self.num_seqs, self.block_table
        if self.is_decode:              # one block each: the one holding position context_len
            owner = _arange(n)
            cols, offsets = np.divmod(self.context_lens, block_size)
            blocks = table[owner, cols]
            self._decode_slots = (block_size, blocks * block_size + offsets)   # for pack
            if n == 1:
                return
        else:
            first = self.context_lens // block_size
            counts = (self.seq_lens - 1) // block_size - first + 1
            owner = np.repeat(np.arange(n), counts)
            cols = np.arange(owner.shape[0]) - np.repeat(np.cumsum(counts) - counts - first, counts)
            blocks = table[owner, cols]
        if blocks.shape[0] <= _SMALL_STEP:
            if len(set(blocks.tolist())) == blocks.shape[0]:
                return
        else:
            if np.diff(np.sort(blocks)).all():       # sorted: a zero step is a repeat
                return
        order = np.argsort(blocks, kind="stable")
        k = int(np.flatnonzero(blocks[order][1:] == blocks[order][:-1])[0])
        a, b = order[k], order[k + 1]
        i, j = int(owner[a]), int(owner[b])
        where = (f"seq {i} lists it twice (block_ids[{cols[a]}] and [{cols[b]}])" if i == j else
                 f"seqs {i} (block_ids[{cols[a]}]) and {j} (block_ids[{cols[b]}]) both write into it")
        raise ValueError(f"block {blocks[a]} would be written twice by this step's new tokens: {where}. Each new "
                         f"token needs a cache slot of its own; a block may be shared only for reading (a common "
                         f"prefix: copy a partly filled shared block before writing into it)")

    def _checks_numpy(self, cfg: RuntimeConfig) -> bool:
        """Every limit at once, as array reductions (cheapest for many sequences). Sets
        ``block_columns``; derived block counts stay underived (each row then has exactly
        the blocks its seq_len needs: the widest row is the longest sequence's)."""
        self._derive_range_counts()
        table, counts, bs = self.block_table, self.block_counts, cfg.block_size
        seq_max = int(self.seq_lens.max())
        self.block_columns = -(-seq_max // bs) if counts is None else int(counts.max())
        ok = (self.q_lens.min() >= 1 and self.context_lens.min() >= 0 and self.num_tokens <= cfg.max_num_tokens
              and seq_max <= cfg.max_model_len
              and self.q_lens.max() <= cfg.max_model_len and self.context_lens.max() <= cfg.max_model_len
              and (counts is None or (counts * bs >= self.seq_lens).all())
              and self.block_columns <= min(cfg.max_blocks_per_seq, table.shape[1])
              and (table.size == 0 or table.view(np.uint64).max() < cfg.num_blocks)
              and self.range_counts.max() <= cfg.max_prefix_ranges)
        r = self.ranges
        if ok and r.shape[1]:
            # a used range (the first range_counts of its row) must satisfy
            # previous end (0 for the first) <= start < end <= seq_len
            s, e = r[:, :, 0], r[:, :, 1]
            prev = np.zeros_like(e)
            prev[:, 1:] = e[:, :-1]
            bad = (s < prev) | (e <= s) | (e > self.seq_lens[:, None])
            used = _arange(r.shape[1]) < self.range_counts[:, None]
            ok = not (bad & used).any()
        return bool(ok)

    def _checks_small(self, cfg: RuntimeConfig) -> list[int] | None:
        """The same limits as ``_checks_numpy``, in Python over a few sequences (each numpy
        call costs ~1 us, more than a short loop); the block table stays with numpy.
        Returns the block counts (derived ones included) when every check passes, else None."""
        q, c, sl = self.q_lens.tolist(), self.context_lens.tolist(), self.seq_lens.tolist()
        bs = cfg.block_size
        counts = self.block_counts.tolist() if self.block_counts is not None else [-(-s // bs) for s in sl]
        table, ranges = self.block_table, self.ranges
        rows = ranges.tolist() if ranges.shape[1] else None
        if self.range_counts is not None:
            rcounts = self.range_counts.tolist()
        elif rows is None:
            rcounts = [0] * len(q)
        else:                         # the non-empty ranges, as from_arrays documents
            rcounts = [sum(e > s for s, e in row) for row in rows]
        if (min(q) < 1 or min(c) < 0 or self.num_tokens > cfg.max_num_tokens or max(sl) > cfg.max_model_len
                or max(c) > cfg.max_model_len or max(q) > cfg.max_model_len    # (seq_len may have wrapped)
                or max(rcounts) > cfg.max_prefix_ranges):
            return None
        limit = min(cfg.max_blocks_per_seq, table.shape[1])
        if any(b * bs < s or b > limit for b, s in zip(counts, sl)):
            return None
        if table.size and table.view(np.uint64).max() >= cfg.num_blocks:     # negatives wrap past any limit
            return None
        if rows is not None and max(rcounts) > 0:
            for row, k, seq_len in zip(rows, rcounts, sl):
                prev_end = 0                  # a range starts at >= 0 and at >= the previous one's end
                for start, end in row[:k]:
                    if not prev_end <= start < end <= seq_len:
                        return None
                    prev_end = end
        return counts

    def _diagnose(self, cfg: RuntimeConfig) -> None:
        self._derive_counts(cfg.block_size)
        _first_bad(self.q_lens < 1, "q_len must be >= 1, got {}", self.q_lens)
        _first_bad(self.context_lens < 0, "context_len must be >= 0, got {}", self.context_lens)
        # each alone first: their int64 sum (seq_len) wraps for huge values
        _first_bad(self.q_lens > cfg.max_model_len, f"q_len {{}} exceeds max_model_len={cfg.max_model_len}",
                   self.q_lens)
        _first_bad(self.context_lens > cfg.max_model_len,
                   f"context_len {{}} exceeds max_model_len={cfg.max_model_len}", self.context_lens)
        if self.num_tokens > cfg.max_num_tokens:
            raise ValueError(f"Step has {self.num_tokens} new tokens, more than max_num_tokens={cfg.max_num_tokens}")
        seq_lens = self.seq_lens
        _first_bad(seq_lens > cfg.max_model_len, f"context_len + q_len = {{}} exceeds max_model_len={cfg.max_model_len}",
                   seq_lens)
        # (the upper limit first: a huge count times the block size wraps)
        _first_bad(self.block_counts > min(cfg.max_blocks_per_seq, self.block_table.shape[1]),
                   f"has {{}} block_ids, more than max_blocks_per_seq={cfg.max_blocks_per_seq} (or its row)",
                   self.block_counts)
        _first_bad(self.block_counts * cfg.block_size < seq_lens,
                   f"has {{}} block_ids, fewer than the ceil(seq_len / {cfg.block_size}) its seq_len needs",
                   self.block_counts)
        used = np.arange(self.block_table.shape[1]) < self.block_counts[:, None]
        bad = used & ((self.block_table < 0) | (self.block_table >= cfg.num_blocks))
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(f"seq {i}: block id {self.block_table[i, j]} is outside [0, num_blocks={cfg.num_blocks})")
        _first_bad(self.range_counts > cfg.max_prefix_ranges,
                   f"has {{}} prefix ranges, more than max_prefix_ranges={cfg.max_prefix_ranges}", self.range_counts)
        r_used = np.arange(self.ranges.shape[1]) < self.range_counts[:, None]
        validate_ranges(self.ranges[r_used], self.range_counts, seq_lens)

    def pack(self, block_size: int, *, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
             prefix_ranges: np.ndarray, slot_mapping: np.ndarray, positions: np.ndarray | None = None) -> None:
        """Write this (validated) step into host arrays sized for a bucket, padding it.

        Padded sequences get no tokens (query_start_loc repeats the total) and seq_len 0;
        padded tokens get slot -1. Only what the kernels read is written: block-table
        entries past the step's columns and rows of padded sequences keep old values.
        """
        if _fast is not None:
            _fast.pack(self.q_lens, self.context_lens, self.block_table, self.ranges, block_size, self.block_columns,
                       query_start_loc, seq_lens, block_table, prefix_ranges, slot_mapping, positions)
            return
        n, total = self.num_seqs, self.num_tokens
        qsl = query_start_loc
        if self.is_decode:            # 0, 1, ..., n (np.cumsum costs several us on a few items)
            qsl[: n + 1] = _arange(n + 1)
        else:
            qsl[0] = 0
            np.cumsum(self.q_lens, out=qsl[1 : n + 1])
        # padding (each assignment is skipped where the step fills the bucket: ~0.3 us each)
        if qsl.shape[0] > n + 1:
            qsl[n + 1 :] = total
        seq_lens[:n] = self.seq_lens
        if seq_lens.shape[0] > n:
            seq_lens[n:] = 0
        w = self.block_columns
        block_table[:n, :w] = self.block_table[:, :w]
        ranges = self.ranges
        if ranges.shape[1] == prefix_ranges.shape[1]:
            prefix_ranges[:n] = ranges
        else:
            prefix_ranges[:n] = 0
            r = min(ranges.shape[1], prefix_ranges.shape[1])      # slots past the counts are empty
            if r:
                prefix_ranges[:n, :r] = ranges[:, :r]
        if self.is_decode and self._decode_slots is not None and self._decode_slots[0] == block_size:
            pos = self.context_lens
            slot_mapping[:total] = self._decode_slots[1]          # computed by validate's block check
        else:
            tok_seq = np.repeat(np.arange(n), self.q_lens)                        # [total]
            pos = self.context_lens[tok_seq] + np.arange(total) - qsl[tok_seq]
            slot_mapping[:total] = self.block_table[tok_seq, pos // block_size] * block_size + pos % block_size
        if slot_mapping.shape[0] > total:
            slot_mapping[total:] = -1
        if positions is not None:
            positions[:total] = pos
            if positions.shape[0] > total:
                positions[total:] = 0


_SMALL_STEP = 32      # sequences up to which Step.validate checks in Python rather than numpy (measured)
_ARANGE = np.arange(4097)


def _arange(k: int) -> np.ndarray:
    """0, 1, ..., k - 1 (a view of a kept array where it is long enough: np.arange costs ~0.5 us)."""
    return _ARANGE[:k] if k <= _ARANGE.shape[0] else np.arange(k)


def _padded(rows: list, item_shape: tuple, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows of ints (or of pairs) as a zero-padded int64 array and the row lengths.
    Padding Python lists and converting once is the cheapest route from lists (~30 ns an
    int); callers with numpy block tables should use ``Step.from_arrays``."""
    counts = np.fromiter(map(len, rows), np.int64, len(rows))
    width = int(counts.max(initial=0))
    pad = [0] if not item_shape else [(0,) * item_shape[0]]
    try:
        out = np.array([list(r) + pad * (width - len(r)) for r in rows])
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Step: {name} must be lists of ints{' pairs' if item_shape else ''} ({exc})") from None
    if width == 0:
        return np.zeros((len(rows), 0, *item_shape), np.int64), counts
    if out.dtype.kind not in "iu" or out.shape[2:] != item_shape:
        raise TypeError(f"Step: {name} must hold ints{' as (start, end) pairs' if item_shape else ''}, "
                        f"got {out.dtype} items of shape {out.shape[2:]}")
    return out.astype(np.int64, copy=False), counts


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
