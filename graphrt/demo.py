"""A tiny multimodal serving loop on the graphrt runtime.

Synthetic requests whose prompts hold an image (a prefix range of bidirectional tokens)
arrive at different steps; the scheduler mixes chunked prefill with decode (continuous
batching) and never cuts an image across chunks, since a range may only use keys that are
in the cache after the step. A small random-weight transformer (GQA, every other layer
with a sliding window) runs each step through ``Runtime.step``: captured graphs replayed on
a GPU, eager Triton-interpreter launches on a CPU. Every step's logits are checked against
the same model run on the CPU with float64 reference attention.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from graphrt.config import RuntimeConfig
from graphrt.sampling import SamplingParams
from graphrt.serve import Request, serve
from graphrt.step import SeqStep, Step


def _make_requests(rng: np.random.Generator, n: int, prompt_len: tuple[int, int], image_len: int, vocab: int,
                   new_tokens: int) -> list[Request]:
    reqs = []
    for rid in range(n):
        length = int(rng.integers(*prompt_len))
        start = int(rng.integers(1, length - image_len))
        reqs.append(Request(rid=rid, arrival=2 * rid, prompt=rng.integers(0, vocab, length).tolist(),
                            new_tokens=new_tokens, ranges=[(start, start + image_len)]))
    return reqs


class _Sampled(torch.nn.Module):
    """The model step with its next tokens drawn inside it (``ctx.sample``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ctx):
        hidden, logits = self.model(ctx)
        return hidden, logits, ctx.sample(logits)


def run_demo(*, device: str, layers: int, requests: int, new_tokens: int, chunk: int, seed: int,
             sample: bool = False) -> int:
    from torch.profiler import ProfilerActivity, profile

    from graphrt.checking import ReferenceRunner
    from graphrt.profiling import count_transfers
    from graphrt.runtime import Runtime
    from graphrt.toy import ToyModel

    on_gpu = device == "cuda"
    prompt_len, image_len = ((400, 900), 256) if on_gpu else ((28, 56), 12)
    shape = dict(num_q_heads=32 if on_gpu else 4, num_kv_heads=8 if on_gpu else 2, head_dim=128 if on_gpu else 64,
                 block_size=16, num_blocks=4096 if on_gpu else 64, max_num_seqs=max(requests, 1),
                 max_num_tokens=chunk + image_len + requests, max_model_len=2048, max_prefix_ranges=2,
                 sampling=sample)
    cfg = RuntimeConfig(**shape, dtype=torch.bfloat16 if on_gpu else torch.float32)
    hidden, vocab = (1024 if on_gpu else 128), 512
    model = ToyModel(cfg, num_layers=layers, hidden=hidden, vocab=vocab, window=32, seed=seed, device=device)
    rt = Runtime(cfg, _Sampled(model) if sample else model, num_layers=layers, device=device, strict=on_gpu)
    # The check runs on the CPU in float32 with float64 attention, apart from the GPU run.
    ref_cfg = RuntimeConfig(**shape, dtype=torch.float32)
    ref_model = ToyModel(ref_cfg, num_layers=layers, hidden=hidden, vocab=vocab, window=32, seed=seed)
    checker = ReferenceRunner(ref_cfg, _Sampled(ref_model) if sample else ref_model, num_layers=layers)

    rng = np.random.default_rng(seed)
    reqs = _make_requests(rng, requests, prompt_len, image_len, vocab, new_tokens)
    settings = {r.rid: SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=seed * 1000 + r.rid) for r in reqs}
    free_blocks = rng.permutation(cfg.num_blocks).tolist()
    if on_gpu:
        t0 = time.perf_counter()
        graphs = rt.capture()
        mode = (f"cuda ({torch.cuda.get_device_name()}), graph replay: {len(graphs)} buckets captured in "
                f"{time.perf_counter() - t0:.1f} s, pool {sum(g.pool_bytes for g in graphs) / 2**20:.0f} MiB")
    else:
        mode = "cpu, eager through the Triton interpreter (no CUDA device)"
    print(f"graphrt demo: {mode}\n  model: {layers} layers, heads {cfg.num_q_heads}/{cfg.num_kv_heads}, "
          f"head_dim {cfg.head_dim}, {cfg.dtype}; {requests} requests with one image each"
          + ("; tokens drawn in the step (temperature 0.8, top-k 50, top-p 0.95)" if sample else ""))

    stats = dict(prefill=0, decode=0, worst=0.0, drawn=0, agreed=0)
    host_s: list[float] = []
    buckets: dict[str, int] = {}

    def check(step_no, step, owners, ids, out):
        """Each step against the reference runner, which runs it on the CPU."""
        checked = checker.step(step, ids, sampling=[settings[r.rid] for r in owners] if sample else None)
        want = checked[1]
        if sample:          # the reference's draws from its own logits (a near tie may differ in bf16)
            stats["drawn"] += step.num_seqs
            stats["agreed"] += sum(int(a == b) for a, b in zip(out[2][: step.num_seqs].tolist(), checked[2].tolist()))
        scale = want.abs().max().item()
        err = (out[1][: step.num_seqs].float().cpu() - want).abs().max().item() / scale
        stats["worst"] = max(stats["worst"], err)
        label = str(rt.last.bucket) if rt.last.bucket else "eager"
        buckets[label] = buckets.get(label, 0) + 1
        for r, q_len in zip(owners, step.q_lens.tolist()):
            stats["prefill" if r.cached - q_len < len(r.prompt) else "decode"] += q_len
        kinds = "".join("P" if q > 1 else "D" for q in step.q_lens)
        print(f"  step {step_no:3d}: {step.num_seqs} seqs [{kinds}] {step.num_tokens:4d} tokens -> {label}, "
              f"{rt.last.copy_bytes} B copied")

    # On a GPU the torch profiler counts the copies and syncs that the summary reports.
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if on_gpu else contextlib.nullcontext()
    t_start = time.perf_counter()
    with profiler as prof:
        serve(rt, reqs, chunk=chunk, free_blocks=free_blocks, sampling=settings if sample else None, on_step=check,
              host_times=host_s)
    total = time.perf_counter() - t_start
    seen = count_transfers(prof, "graphrt_step") if on_gpu else None
    tol = 5e-2 if cfg.dtype == torch.bfloat16 else 1e-3
    steps = len(host_s)
    worst, agreed, drawn = stats["worst"], stats["agreed"], stats["drawn"]
    print(f"done: {steps} steps, {stats['prefill']} prefill + {stats['decode']} decode tokens in {total:.2f} s "
          f"(with the reference check and profiler running alongside)")
    print(f"  host time in rt.step: median {1e6 * np.median(host_s):.0f} us/step"
          f"{' (under the torch profiler)' if on_gpu else ''}")
    if on_gpu:
        print(f"  H2D copies: {seen.h2d_pinned} pinned, {seen.h2d_pageable} pageable over {steps} steps; "
              f"host syncs inside rt.step: {seen.syncs} (strict mode on), "
              f"waits for a free staging slot: {seen.ring_waits}")
    print(f"  buckets used: {', '.join(f'{k} x{v}' for k, v in sorted(buckets.items()))}")
    if sample:
        print(f"  tokens drawn in the step equal to the reference's draws: {agreed} of {drawn}")
    print(f"  logits vs float64-attention reference, worst error / max |logit|: {worst:.2e} "
          f"({'ok' if worst < tol else 'TOO LARGE'}, tolerance {tol:g})")
    for r in reqs:
        print(f"  request {r.rid}: prompt {len(r.prompt)} tokens (image at {list(r.ranges[0])}), "
              f"generated {r.generated}")
    ok = worst < tol and (seen is None or (seen.h2d_pinned == steps and seen.h2d_pageable == 0 and seen.syncs == 0))
    ok = ok and (on_gpu or agreed == drawn)     # fp32 on both sides: the same draws (bf16 logits may tip a near tie)
    return 0 if ok else 1
