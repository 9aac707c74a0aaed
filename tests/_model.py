"""Runtime test helpers: random steps over a paged cache."""

from __future__ import annotations

import numpy as np

from _cases import random_ranges
from graphrt import RuntimeConfig, SeqStep, Step


def random_step(rng: np.random.Generator, cfg: RuntimeConfig, *, num_seqs: int, decode: bool,
                max_tokens: int | None = None, max_ctx: int | None = None) -> Step:
    """``num_seqs`` sequences with random contexts, disjoint random blocks and random image
    ranges; all decodes, or a mix whose tokens stay within ``max_tokens`` (its first
    sequence brings two or more, so that a mix is never all decodes)."""
    max_tokens = max_tokens or cfg.max_num_tokens
    max_ctx = max_ctx or cfg.max_model_len - 64
    free = iter(rng.permutation(cfg.num_blocks).tolist())
    budget = max_tokens - num_seqs
    seqs = []
    for i in range(num_seqs):
        q = 1
        if not decode and budget > 0 and (i == 0 or rng.random() < 0.5):
            q += int(rng.integers(1 if i == 0 else 0, min(budget, 64) + 1))
            budget -= q - 1
        ctx = int(rng.integers(0, max_ctx + 1))
        n_blocks = -(-(ctx + q) // cfg.block_size)
        ranges = random_ranges(rng, ctx + q, int(rng.integers(0, cfg.max_prefix_ranges + 1)))
        seqs.append(SeqStep(q_len=q, context_len=ctx, block_ids=[next(free) for _ in range(n_blocks)],
                            prefix_ranges=ranges))
    return Step(seqs)
