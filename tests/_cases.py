"""Shared test helpers: seeds, dtype tolerances, comparison with worst-index reports, and
a metadata builder written with plain loops (independent of graphrt's vectorised packing)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import settings

from graphrt.kernels import AttentionMetadata

# dtype and its (atol, rtol) travel together. bf16 runs on CPU too: under the interpreter
# the kernel takes its dots in fp32 (the interpreter's bf16 tl.dot is wrong).
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def examples(n: int) -> int:
    """A hypothesis test's example count: n in CI's profile, 10n in the "random" one
    (conftest.py)."""
    return 10 * n if settings.get_current_profile_name() == "random" else n


def fresh_seed() -> int:
    return int(os.environ.get("GRAPHRT_TEST_SEED") or secrets.randbits(31))


def rngs(seed: int) -> tuple[np.random.Generator, torch.Generator]:
    return np.random.default_rng(seed), torch.Generator().manual_seed(seed)


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, seed: int) -> None:
    got64, ref64 = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got64.shape == ref64.shape, f"{name}: shape {tuple(got64.shape)} != reference {tuple(ref64.shape)}"
    excess = (got64 - ref64).abs() - (atol + rtol * ref64.abs())
    excess = torch.where(torch.isnan(excess), torch.full_like(excess, float("inf")), excess)
    bad = excess > 0
    if bad.any():
        idx = np.unravel_index(int(excess.argmax()), tuple(excess.shape))
        idx = tuple(int(i) for i in idx)
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} elements off (atol={atol}, rtol={rtol}, "
                             f"seed={seed}); worst at {idx}: got {got64[idx].item():.6g}, "
                             f"want {ref64[idx].item():.6g}")


@dataclass(frozen=True)
class Seq:
    q_len: int
    ctx: int
    ranges: tuple = ()

    @property
    def seq_len(self) -> int:
        return self.ctx + self.q_len


def random_ranges(rng: np.random.Generator, seq_len: int, count: int) -> tuple:
    """``count`` sorted, non-empty, non-overlapping half-open ranges inside [0, seq_len)."""
    count = min(count, seq_len // 2)
    cuts = np.sort(rng.choice(seq_len + 1, size=2 * count, replace=False))
    return tuple((int(cuts[2 * i]), int(cuts[2 * i + 1])) for i in range(count))


def random_seqs(rng: np.random.Generator, n: int, *, max_q: int, max_ctx: int, max_ranges: int) -> list[Seq]:
    seqs = []
    for _ in range(n):
        q = int(rng.integers(1, max_q + 1)) if rng.random() < 0.5 else 1
        ctx = int(rng.integers(0, max_ctx + 1))
        seqs.append(Seq(q, ctx, random_ranges(rng, q + ctx, int(rng.integers(0, max_ranges + 1)))))
    return seqs


def build_meta(seqs: list[Seq], *, block_size: int, num_blocks: int, max_ranges: int, rng: np.random.Generator,
               device, num_seqs: int | None = None, num_tokens: int | None = None):
    """Metadata for ``seqs`` padded to ``num_seqs``/``num_tokens``, with every sequence's
    blocks drawn at random (non-contiguous, disjoint) from the cache. Sequences with
    q_len 0 are allowed anywhere. Returns (meta, block lists)."""
    num_seqs = num_seqs or len(seqs)
    total = sum(s.q_len for s in seqs)
    num_tokens = num_tokens or total
    max_blocks = max(-(-s.seq_len // block_size) for s in seqs) + 1
    perm = iter(rng.permutation(num_blocks).tolist())
    qsl = [0]
    seq_lens, table, ranges, slots, blocks_of = [], [], [], [], []
    for s in seqs:
        blocks = [next(perm) for _ in range(-(-s.seq_len // block_size))]
        blocks_of.append(blocks)
        qsl.append(qsl[-1] + s.q_len)
        seq_lens.append(s.seq_len)
        table.append(blocks + [int(rng.integers(0, num_blocks))] * (max_blocks - len(blocks)))  # stale tail
        ranges.append(list(s.ranges) + [(0, 0)] * (max_ranges - len(s.ranges)))
        for p in range(s.ctx, s.seq_len):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    for _ in range(num_seqs - len(seqs)):
        qsl.append(total)
        seq_lens.append(0)
        table.append([0] * max_blocks)
        ranges.append([(0, 0)] * max_ranges)
    slots += [-1] * (num_tokens - total)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        prefix_ranges=torch.tensor(ranges, dtype=torch.int32, device=device).reshape(num_seqs, max_ranges, 2),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    return meta, blocks_of
