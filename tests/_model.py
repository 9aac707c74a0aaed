"""Runtime test helpers: random steps over a paged cache, and the same model run with
float64 reference attention on metadata built independently of the runtime's staging."""

from __future__ import annotations

import numpy as np
import torch

from _cases import random_ranges
from graphrt import RuntimeConfig, SeqStep, Step, build_metadata
from graphrt.kernels import reference


def random_step(rng: np.random.Generator, cfg: RuntimeConfig, *, num_seqs: int, decode: bool,
                max_tokens: int | None = None, max_ctx: int | None = None) -> Step:
    """``num_seqs`` sequences with random contexts, disjoint random blocks and random image
    ranges; all decodes, or a mix whose tokens stay within ``max_tokens``."""
    max_tokens = max_tokens or cfg.max_num_tokens
    max_ctx = max_ctx or cfg.max_model_len - 64
    free = iter(rng.permutation(cfg.num_blocks).tolist())
    budget = max_tokens - num_seqs
    seqs = []
    for _ in range(num_seqs):
        q = 1
        if not decode and budget > 0 and rng.random() < 0.5:
            q += int(rng.integers(0, min(budget, 64) + 1))
            budget -= q - 1
        ctx = int(rng.integers(0, max_ctx + 1))
        n_blocks = -(-(ctx + q) // cfg.block_size)
        ranges = random_ranges(rng, ctx + q, int(rng.integers(0, cfg.max_prefix_ranges + 1)))
        seqs.append(SeqStep(q_len=q, context_len=ctx, block_ids=[next(free) for _ in range(n_blocks)],
                            prefix_ranges=ranges))
    return Step(seqs)


class _RefContext:
    def __init__(self, run: "ReferenceRun", step: Step, input_ids, device):
        self.meta, self.positions = build_metadata(step, run.cfg, device)
        self.input_ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.int64, device=device)
        self.last_token_index = (self.meta.query_start_loc[1:] - 1).long()
        self._run = run

    def attention(self, layer, q, k, v, *, scale=None, window=None, composition="gemma3", softcap=None):
        run = self._run
        reference.write_kv(k, v, run.k_caches[layer], run.v_caches[layer], self.meta.slot_mapping)
        out = reference.paged_attention(q, run.k_caches[layer], run.v_caches[layer], self.meta, scale=scale,
                                        window=window, composition=composition, softcap=softcap)
        return out.to(device=q.device, dtype=q.dtype)


class ReferenceRun:
    """The model over its own KV caches, attention from ``graphrt.kernels.reference``."""

    def __init__(self, cfg: RuntimeConfig, model, num_layers: int, device):
        shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.cfg, self.model, self.device = cfg, model, device
        self.k_caches = [torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(num_layers)]

    def __call__(self, step: Step, input_ids):
        return self.model(_RefContext(self, step, input_ids, self.device))
