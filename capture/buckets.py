"""Size buckets: one captured graph each. Decode buckets count sequences (one token each);
mixed buckets count tokens (prefill chunks and decodes together)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

DECODE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIXED_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_seqs: int
    kind: str            # "decode" (every sequence brings one token) or "mixed"

    @property
    def max_query_len(self) -> int | None:
        """The kernels' tile-shape hint: 1 for decode buckets."""
        return 1 if self.kind == "decode" else None

    def __str__(self) -> str:
        return f"{self.kind}[seqs={self.num_seqs},tokens={self.num_tokens}]"


def default_buckets(max_num_seqs: int, max_num_tokens: int) -> tuple[list[int], list[int]]:
    """Decode sizes up to max_num_seqs and mixed sizes up to max_num_tokens, each list
    ending with its capacity so that every step that fits has a graph."""
    decode = [s for s in DECODE_SIZES if s < max_num_seqs] + [max_num_seqs]
    mixed = [t for t in MIXED_SIZES if t < max_num_tokens] + [max_num_tokens]
    return decode, mixed


def make_buckets(decode: list[int], mixed: list[int], max_num_seqs: int, max_num_tokens: int) -> list[Bucket]:
    """Buckets from sizes: decode sizes count sequences (one token each), mixed sizes
    count tokens (with room for min(max_num_seqs, tokens) sequences). ValueError for a
    size outside [1, capacity]."""
    for name, sizes, limit in (("decode_buckets", decode, max_num_seqs), ("mixed_buckets", mixed, max_num_tokens)):
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= limit:
                raise ValueError(f"{name} entries must be ints in [1, {limit}], got {size!r}")
    buckets = [Bucket(s, s, "decode") for s in sorted(set(decode))]
    buckets += [Bucket(t, min(max_num_seqs, t), "mixed") for t in sorted(set(mixed))]
    return buckets


class BucketIndex:
    """Smallest bucket that fits a step, found by bisection."""

    def __init__(self, buckets: list[Bucket]):
        self.decode = sorted(b for b in buckets if b.kind == "decode")
        self.mixed = sorted(b for b in buckets if b.kind == "mixed")
        self._decode_keys = [b.num_seqs for b in self.decode]
        self._mixed_keys = [b.num_tokens for b in self.mixed]

    def pick(self, num_seqs: int, num_tokens: int, is_decode: bool) -> Bucket | None:
        """The smallest bucket holding the step: for a decode step the smallest decode
        bucket of >= num_seqs sequences; otherwise (or when none is that large) the
        smallest mixed bucket of >= num_tokens tokens and >= num_seqs sequences; None when
        none fits (the step runs eagerly)."""
        if is_decode:
            i = bisect.bisect_left(self._decode_keys, num_seqs)
            if i < len(self.decode):
                return self.decode[i]
        i = bisect.bisect_left(self._mixed_keys, num_tokens)
        for b in self.mixed[i:]:
            if b.num_seqs >= num_seqs:
                return b
        return None
