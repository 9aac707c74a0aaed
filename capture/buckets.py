"""Size buckets: one captured graph each, of one of three step kinds. Decode buckets count
sequences (one token each); verify buckets count sequences of q_len tokens each (a
speculative verify step: k drafts after a sequence's last token, q_len = k + 1); mixed
buckets count tokens (prefill chunks and decodes together)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

DECODE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIXED_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


KINDS = ("decode", "verify", "mixed")


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_seqs: int
    kind: str            # "decode" (every sequence brings one token), "verify" (q_len each) or "mixed"
    q_len: int = 0       # a verify bucket's tokens per sequence (0 for the other kinds)

    @property
    def max_query_len(self) -> int | None:
        """The kernels' hint of a launch's longest query: 1 for decode buckets (their tile
        shape and the fused KV write), q_len for verify buckets, None (any) for mixed."""
        return 1 if self.kind == "decode" else self.q_len if self.kind == "verify" else None

    @property
    def splits_kv(self) -> bool:
        """Whether the bucket's attention splits each sequence's keys over several programs
        (few queries a sequence, so that a long context still fills the GPU)."""
        return self.kind in ("decode", "verify")

    def __str__(self) -> str:
        q = f",q_len={self.q_len}" if self.kind == "verify" else ""
        return f"{self.kind}[seqs={self.num_seqs}{q},tokens={self.num_tokens}]"


def default_buckets(max_num_seqs: int, max_num_tokens: int) -> tuple[list[int], list[int]]:
    """Decode sizes up to max_num_seqs and mixed sizes up to max_num_tokens, each list
    ending with its capacity so that every step that fits has a graph."""
    decode = [s for s in DECODE_SIZES if s < max_num_seqs] + [max_num_seqs]
    mixed = [t for t in MIXED_SIZES if t < max_num_tokens] + [max_num_tokens]
    return decode, mixed


def make_buckets(decode: list[int], mixed: list[int], max_num_seqs: int, max_num_tokens: int, *,
                 verify: Sequence[int] = (), verify_q_len: int | None = None) -> list[Bucket]:
    """Buckets from sizes: decode sizes count sequences (one token each), mixed sizes
    count tokens (with room for min(max_num_seqs, tokens) sequences), verify sizes count
    sequences of ``verify_q_len`` tokens each (>= 2; their tokens within max_num_tokens).
    ValueError for a size outside its range, checked before any bucket is made."""
    if verify:
        q = verify_q_len
        if isinstance(q, bool) or not isinstance(q, int) or not 2 <= q <= max_num_tokens:
            raise ValueError(f"verify_q_len (drafts + 1) must be an int in [2, {max_num_tokens}] with verify "
                             f"buckets, got {verify_q_len!r}")
    verify_limit = min(max_num_seqs, max_num_tokens // verify_q_len) if verify else 0
    for name, sizes, limit in (("decode_buckets", decode, max_num_seqs), ("mixed_buckets", mixed, max_num_tokens),
                               ("verify_buckets", verify, verify_limit)):
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= limit:
                raise ValueError(f"{name} entries must be ints in [1, {limit}], got {size!r}")
    buckets = [Bucket(s, s, "decode") for s in sorted(set(decode))]
    buckets += [Bucket(s * verify_q_len, s, "verify", verify_q_len) for s in sorted(set(verify))]
    buckets += [Bucket(t, min(max_num_seqs, t), "mixed") for t in sorted(set(mixed))]
    return buckets


class BucketIndex:
    """Smallest bucket that fits a step, found by bisection."""

    def __init__(self, buckets: list[Bucket]):
        self.decode = sorted(b for b in buckets if b.kind == "decode")
        self.mixed = sorted(b for b in buckets if b.kind == "mixed")
        self.verify = {q: sorted(b for b in buckets if b.kind == "verify" and b.q_len == q)
                       for q in sorted({b.q_len for b in buckets if b.kind == "verify"})}
        self._decode_keys = [b.num_seqs for b in self.decode]
        self._mixed_keys = [b.num_tokens for b in self.mixed]
        self._verify_keys = {q: [b.num_seqs for b in bs] for q, bs in self.verify.items()}

    def pick(self, num_seqs: int, num_tokens: int, is_decode: bool, q_len: int | None = None) -> Bucket | None:
        """The smallest bucket holding the step: for a decode step the smallest decode
        bucket of >= num_seqs sequences; for a step whose sequences all bring ``q_len``
        tokens, the smallest verify bucket of that q_len and >= num_seqs sequences;
        otherwise (or when none is that large) the smallest mixed bucket of >= num_tokens
        tokens and >= num_seqs sequences; None when none fits (the step runs eagerly)."""
        if is_decode:
            i = bisect.bisect_left(self._decode_keys, num_seqs)
            if i < len(self.decode):
                return self.decode[i]
        elif q_len is not None and q_len in self.verify:
            i = bisect.bisect_left(self._verify_keys[q_len], num_seqs)
            if i < len(self.verify[q_len]):
                return self.verify[q_len][i]
        i = bisect.bisect_left(self._mixed_keys, num_tokens)
        for b in self.mixed[i:]:
            if b.num_seqs >= num_seqs:
                return b
        return None
