"""A tiny random-weight transformer that runs on graphrt: the demo's model and the tests'.

Embedding (or the step's given input embeddings, with ``cfg.embed_dim == hidden``) +
learned positions, then per layer a fused qkv projection, graphrt attention
(KV write + paged attention; even layers use a sliding window) and an output projection
with a residual. No MLP or norm: the attention path is what is exercised.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.config import RuntimeConfig


class ToyModel(nn.Module):
    def __init__(self, cfg: RuntimeConfig, *, num_layers: int, hidden: int = 256, vocab: int = 512,
                 window: int | None = 32, window_rule: str = "clip", softcap: float | None = None, seed: int = 0,
                 device: torch.device | str = "cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim

        def w(*shape: int) -> nn.Parameter:
            t = torch.randn(*shape, generator=g) / shape[-2] ** 0.5
            return nn.Parameter(t.to(device=device, dtype=cfg.dtype), requires_grad=False)

        self.cfg, self.num_layers = cfg, num_layers
        self.embed = w(vocab, hidden)
        self.pos_embed = w(cfg.max_model_len, hidden)
        self.w_qkv = w(num_layers, hidden, (hq + 2 * hkv) * d)
        self.w_o = w(num_layers, hq * d, hidden)
        self.windows = [window if i % 2 == 0 else None for i in range(num_layers)]
        self.window_rule, self.softcap = window_rule, softcap

    def forward(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx: a graphrt StepContext (or anything with input_ids, positions,
        last_token_index and attention). Returns hidden [T, hidden] and the logits of each
        sequence's last token [S, vocab]."""
        hq, hkv, d = self.cfg.num_q_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        x = self.embed[ctx.input_ids]                                               # [T, hidden]
        if self.cfg.embed_dim:          # tokens that brought an input embedding take it instead
            x = ctx.merge_embeds(x)
        x = x + self.pos_embed[ctx.positions]
        for i in range(self.num_layers):
            qkv = x @ self.w_qkv[i]                                                 # [T, (hq + 2 hkv) d]
            q = qkv[:, : hq * d].view(-1, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(-1, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
            out = ctx.attention(i, q, k, v, window=self.windows[i], window_rule=self.window_rule,
                                softcap=self.softcap)
            x = x + self.reduce(out.flatten(1) @ self.w_o[i])
        return x, x[ctx.last_token_index] @ self.embed.T

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of the output projection over the ranks that hold a share of the heads
        (identity here; ``graphrt.parallel.ParallelToyModel`` all-reduces)."""
        return partial
