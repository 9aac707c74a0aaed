"""A tiny multimodal serving loop on graphrt's kernels.

Synthetic requests whose prompts hold an image (a prefix range of bidirectional tokens)
arrive at different steps; the scheduler mixes chunked prefill with decode (continuous
batching) and never cuts an image across chunks, since a range may only use keys that are
in the cache after the step. A small random-weight transformer (GQA, every other layer
with a sliding window) runs each step eagerly; the last layer's attention of every step
is checked against the float64 reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from graphrt.config import RuntimeConfig
from graphrt.step import SeqStep, Step, build_metadata


@dataclass
class Request:
    rid: int
    arrival: int                 # step at which it joins
    prompt: list[int]
    image: tuple[int, int]       # half-open positions of its image tokens
    new_tokens: int
    blocks: list[int] = field(default_factory=list)
    cached: int = 0              # tokens already in the KV cache
    generated: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.new_tokens

    def next_chunk(self, budget: int) -> int:
        """Prompt tokens to prefill now (0 when decoding): at most ``budget``, never
        ending inside the image."""
        left = len(self.prompt) - self.cached
        if left <= 0:
            return 0
        n = min(left, budget)
        start, end = self.image
        if start < self.cached + n < end:      # would split the image: stop before it, or take it whole
            n = start - self.cached if start > self.cached else end - self.cached
        return n


class TinyModel:
    """Embedding, L attention layers (qkv and output projections, residual), tied head."""

    def __init__(self, cfg: RuntimeConfig, layers: int, hidden: int, vocab: int, window: int, device: str,
                 seed: int):
        g = torch.Generator().manual_seed(seed)
        qkv = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim

        def w(*shape):
            return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(device=device, dtype=cfg.dtype)

        self.cfg, self.device = cfg, device
        self.embed = w(vocab, hidden)
        self.w_qkv = [w(hidden, qkv) for _ in range(layers)]
        self.w_o = [w(cfg.num_q_heads * cfg.head_dim, hidden) for _ in range(layers)]
        self.windows = [window if i % 2 == 0 else None for i in range(layers)]
        cache_shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = [torch.zeros(cache_shape, device=device, dtype=cfg.dtype) for _ in range(layers)]
        self.v_cache = [torch.zeros(cache_shape, device=device, dtype=cfg.dtype) for _ in range(layers)]

    def forward(self, tokens: torch.Tensor, meta) -> tuple[torch.Tensor, tuple]:
        from graphrt.kernels import paged_attention, write_kv

        cfg = self.cfg
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.embed[tokens]                                            # [T, hidden]
        for i, window in enumerate(self.windows):
            qkv = x @ self.w_qkv[i]                                       # [T, (hq + 2 hkv) d]
            q = qkv[:, : hq * d].view(-1, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(-1, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
            write_kv(k, v, self.k_cache[i], self.v_cache[i], meta)
            out = torch.empty_like(q)
            paged_attention(q, self.k_cache[i], self.v_cache[i], out, meta, window=window)
            x = x + out.flatten(1) @ self.w_o[i]
            last = (q, i, window, out)
        return x @ self.embed.T, last                                      # logits [T, vocab]


def _make_requests(rng: np.random.Generator, n: int, prompt_len: tuple[int, int], image_len: int, vocab: int,
                   new_tokens: int) -> list[Request]:
    reqs = []
    for rid in range(n):
        length = int(rng.integers(*prompt_len))
        start = int(rng.integers(1, length - image_len))
        reqs.append(Request(rid=rid, arrival=2 * rid, prompt=rng.integers(0, vocab, length).tolist(),
                            image=(start, start + image_len), new_tokens=new_tokens))
    return reqs


def run_demo(*, device: str, layers: int, requests: int, new_tokens: int, chunk: int, seed: int) -> int:
    from graphrt.kernels import reference

    on_gpu = device == "cuda"
    prompt_len, image_len = ((400, 900), 256) if on_gpu else ((28, 56), 12)
    cfg = RuntimeConfig(num_q_heads=32 if on_gpu else 4, num_kv_heads=8 if on_gpu else 2,
                        head_dim=128 if on_gpu else 64, block_size=16, num_blocks=4096 if on_gpu else 64,
                        max_num_seqs=max(requests, 1), max_num_tokens=chunk + image_len + requests, max_model_len=2048,
                        max_prefix_ranges=2, dtype=torch.bfloat16 if on_gpu else torch.float32)
    rng = np.random.default_rng(seed)
    vocab = 512
    model = TinyModel(cfg, layers, hidden=1024 if on_gpu else 128, vocab=vocab, window=32, device=device, seed=seed)
    reqs = _make_requests(rng, requests, prompt_len, image_len, vocab, new_tokens)
    free_blocks = list(rng.permutation(cfg.num_blocks))
    mode = f"cuda ({torch.cuda.get_device_name()}), eager launches" if on_gpu else \
        "cpu, Triton interpreter, eager launches"
    print(f"graphrt demo: {mode}; {layers} layers, {requests} requests, heads {cfg.num_q_heads}/{cfg.num_kv_heads}, "
          f"head_dim {cfg.head_dim}, {cfg.dtype}")

    step_no, prefill_tok, decode_tok, max_err, step_times = 0, 0, 0, 0.0, []
    while not all(r.done for r in reqs):
        running = [r for r in reqs if r.arrival <= step_no and not r.done]
        budget, seqs, tokens, owners = chunk, [], [], []
        for r in running:
            n = r.next_chunk(budget)
            if n == 0 and r.cached < len(r.prompt):
                continue                          # no prefill budget left this step
            q_len = n or 1
            new = r.prompt[r.cached: r.cached + n] if n else [r.generated[-1]]
            budget = max(budget - n, 0)
            while len(r.blocks) * cfg.block_size < r.cached + q_len:
                r.blocks.append(int(free_blocks.pop()))
            ranges = [r.image] if r.image[1] <= r.cached + q_len else []
            seqs.append(SeqStep(q_len=q_len, context_len=r.cached, block_ids=r.blocks, prefix_ranges=ranges))
            tokens += new
            owners.append(r)
        step_no += 1
        if not seqs:
            continue
        step = Step(seqs)
        t0 = time.perf_counter()
        meta, _ = build_metadata(step, cfg, device)
        logits, (q, layer, window, out) = model.forward(torch.tensor(tokens, device=device), meta)
        next_tok = logits[torch.from_numpy(np.cumsum(step.q_lens) - 1).to(device)].argmax(-1).tolist()
        step_times.append(time.perf_counter() - t0)
        ref = reference.paged_attention(q, model.k_cache[layer], model.v_cache[layer], meta, window=window)
        max_err = max(max_err, (out.double().cpu() - ref).abs().max().item())
        for r, q_len, tok in zip(owners, step.q_lens.tolist(), next_tok):
            was_prefill = r.cached < len(r.prompt)
            r.cached += q_len
            prefill_tok += q_len if was_prefill else 0
            decode_tok += 0 if was_prefill else 1
            if r.cached >= len(r.prompt):
                r.generated.append(int(tok))
        kinds = "".join("P" if q > 1 else "D" for q in step.q_lens)
        print(f"  step {step_no:3d}: {step.num_seqs} seqs [{kinds}], {step.num_tokens:4d} tokens, "
              f"{1e3 * step_times[-1]:8.1f} ms")

    total = sum(step_times)
    tol = 3e-2 if cfg.dtype == torch.bfloat16 else 1e-4
    print(f"done: {len(step_times)} steps, {prefill_tok} prefill + {decode_tok} decode tokens in {total:.2f} s "
          f"({(prefill_tok + decode_tok) / total:.0f} tokens/s, median {1e3 * np.median(step_times):.1f} ms/step)")
    print(f"last-layer attention vs float64 reference, worst |error| over all steps: {max_err:.2e} "
          f"({'ok' if max_err < tol else 'TOO LARGE'}, tolerance {tol:g})")
    for r in reqs:
        print(f"  request {r.rid}: prompt {len(r.prompt)} tokens (image at {list(r.image)}), generated {r.generated}")
    return 0 if max_err < tol else 1
