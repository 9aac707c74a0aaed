"""Check a model step against float64 reference attention, independently of the runtime.

``ReferenceRunner`` runs the same ``model_step`` on its own KV caches, with metadata built
straight from the Step (not through the runtime's staging) and attention from
``graphrt.kernels.reference``. Feed it the steps you feed the runtime and compare outputs.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from graphrt.config import RuntimeConfig
from graphrt.kernels import reference
from graphrt.runtime import merge_embeds
from graphrt.step import Step, build_metadata


class _ReferenceContext:
    """A ``graphrt.context.ModelContext`` over the runner's own caches: metadata built from the
    Step, float64 attention and sampling."""

    def __init__(self, runner: "ReferenceRunner", step: Step, input_ids, embeds, embed_rows, positions, sampling):
        self.meta, self.positions = build_metadata(step, runner.cfg, runner.device)   # [T]
        rows = runner.cfg.position_rows
        if positions is not None:
            self.positions = torch.as_tensor(np.asarray(positions), dtype=torch.int64,
                                             device=runner.device).reshape(rows, -1)
            self.positions = self.positions[0] if rows == 1 else self.positions
        elif rows > 1:
            self.positions = self.positions.expand(rows, -1)                         # [P, T]
        self.input_ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.int64, device=runner.device)
        self.last_token_index = (self.meta.query_start_loc[1:] - 1).long()   # [S]
        self.num_tokens, self.num_seqs = step.num_tokens, step.num_seqs
        self.embed_index = self.inputs_embeds = None
        if runner.cfg.embed_dim:
            index = np.full(step.num_tokens, -1, np.int32)
            if embeds is not None and embeds.shape[0]:
                index[np.asarray(embed_rows)] = np.arange(len(embed_rows), dtype=np.int32)
                self.inputs_embeds = embeds.to(runner.device)
            self.embed_index = torch.from_numpy(index).to(runner.device)
        self._runner = runner
        self._sampling = sampling

    def sample(self, logits: torch.Tensor, *, probs: bool = False):
        """[S] int64 drawn by the float64 reference with the runtime's uniforms (the same
        settings and counters, each sequence's length), greedy where ``sampling`` is None;
        ``probs``: with the kept sets' distributions [S, V] (float32, as the runtime's)."""
        from graphrt.buffers import SAMPLING_FIELDS
        from graphrt.sampling import GREEDY

        params = self._sampling or [GREEDY] * self.num_seqs
        lengths = self.meta.seq_lens.cpu()
        cols = [torch.tensor([getattr(p, f) for p in params]) for f in SAMPLING_FIELDS]
        ids = reference.sample(logits.cpu(), *cols, lengths).to(logits.device)
        if not probs:
            return ids
        dists = torch.stack([reference.sampling_keep(row, p.temperature, p.top_k, p.top_p, p.min_p)[1]
                             for row, p in zip(logits.cpu(), params)])
        return ids, dists.float().to(logits.device)

    def merge_embeds(self, x: torch.Tensor) -> torch.Tensor:
        return merge_embeds(x, self.inputs_embeds, self.embed_index)

    def attention(self, layer, q, k, v, *, scale=None, window=None, window_rule="clip", ranges=True, softcap=None):
        r = self._runner
        scales = dict(k_scale=r.k_scales[layer], v_scale=r.v_scales[layer]) if r.k_scales is not None else {}
        reference.write_kv(k, v, r.k_caches[layer], r.v_caches[layer], self.meta.slot_mapping, **scales)
        out = reference.paged_attention(q, r.k_caches[layer], r.v_caches[layer], self.meta, scale=scale,
                                        window=window, window_rule=window_rule, ranges=ranges,
                                        softcap=softcap, **scales)
        return out.to(device=q.device, dtype=q.dtype)


class ReferenceRunner:
    """``model_step`` over its own caches ([num_blocks, block_size, Hkv, D] per layer, in
    cfg's cache dtype), attention computed in float64 by the reference. ``kv_caches`` (k
    list, v list) shares existing caches instead, e.g. a runtime's, to check any single
    step against what the runtime's cache holds (its writes then land in those caches).
    fp8 caches: ``kv_scales`` ([num_layers, Hkv] k and v scales, e.g. a runtime's
    ``(k_scales, v_scales)``), ones by default."""

    def __init__(self, cfg: RuntimeConfig, model_step: Callable[[Any], Any], *, num_layers: int,
                 device: torch.device | str = "cpu", kv_caches: tuple[list, list] | None = None,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.cfg, self.model_step, self.device = cfg, model_step, torch.device(device)
        self.k_scales = self.v_scales = None
        if cfg.fp8_cache:
            ones = torch.ones(num_layers, cfg.num_kv_heads, dtype=torch.float32, device=device)
            self.k_scales, self.v_scales = kv_scales if kv_scales is not None else (ones, ones.clone())
        if kv_caches is not None:
            self.k_caches, self.v_caches = list(kv_caches[0]), list(kv_caches[1])
            return
        self.k_caches = [torch.zeros(shape, dtype=cfg.cache_dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=cfg.cache_dtype, device=device) for _ in range(num_layers)]

    def step(self, step: Step, input_ids, *, embeds: torch.Tensor | None = None, embed_rows=None,
             positions=None, sampling=None) -> Any:
        """Run ``model_step`` on ``step`` (input_ids: [num_tokens] ints; embeds, embed_rows,
        positions and sampling as ``Runtime.step`` takes them) with reference attention and
        sampling; returns what the model step returns (unpadded: num_tokens rows)."""
        return self.model_step(_ReferenceContext(self, step, input_ids, embeds, embed_rows, positions, sampling))
