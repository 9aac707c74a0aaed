"""``graphrt demo --model KIND``: a tiny random-weight transformers model (one of
``graphrt.integrations.tiny.KINDS``) served through the adapter: its own layers, weights
and head, graphrt attention and paged cache, requests joining at different steps, chunked
prefill that never cuts a prefix range, and where the family takes images (gemma3,
paligemma, qwen2-vl) their vision-tower embeddings entering the steps through
``Runtime.step(embeds=, embed_rows=)``, with multimodal-RoPE positions in the step's one
copy for qwen2-vl. Every sampled position's logits are checked against transformers' own
forward over the whole sequence."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch


def run_transformers_demo(*, kind: str, device: str, chunk: int, seed: int) -> int:
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from graphrt.integrations.tiny import BOI, EOI, FAMILIES, IMAGE, KINDS, VIDEO, logit_error, make_requests, tiny_model
    from graphrt.integrations.transformers import TransformersModel
    from graphrt.profiling import count_transfers
    from graphrt.runtime import Runtime
    from graphrt.serve import serve

    if kind not in FAMILIES:
        raise SystemExit(f"graphrt demo: --model must be toy or one of {', '.join(KINDS)}; got {kind!r}")
    on_gpu = device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    rng = np.random.default_rng(seed)
    hf = tiny_model(kind, seed).to(device=device, dtype=dtype)
    model = TransformersModel(hf)
    # a prefix-LM's whole prompt (image included) is one range: prefilled in one chunk
    cfg = model.runtime_config(block_size=16, num_blocks=64, max_num_seqs=4, max_num_tokens=max(chunk, 32) + 4,
                               max_model_len=128, max_prefix_ranges=2)
    rt = Runtime(cfg, model, num_layers=model.num_layers, device=device, strict=on_gpu)
    family = FAMILIES[kind]
    print(f"graphrt demo --model {kind}: transformers {transformers.__version__} {type(hf).__name__} "
          f"({family.exercises}), {model.num_layers} layers, {dtype}, on {device}")
    for line in model.describe().splitlines():
        print(f"  {line}")
    if on_gpu:
        t0 = time.perf_counter()
        graphs = rt.capture(quiet=True)
        print(f"  {len(graphs)} graphs captured in {time.perf_counter() - t0:.1f} s")
    reqs = make_requests(rng, model, kind=kind, device=device)
    never = torch.tensor([BOI, EOI, IMAGE, VIDEO], device=device)
    buckets: dict[str, int] = {}

    def show(step_no, step, owners, ids, out):
        label = str(rt.last.bucket) if rt.last.bucket else "eager"
        buckets[label] = buckets.get(label, 0) + 1
        kinds = "".join("P" if q > 1 else "D" for q in step.q_lens)
        print(f"  step {step_no:3d}: {step.num_seqs} seqs [{kinds}] {step.num_tokens:3d} tokens -> {label}")

    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if on_gpu else contextlib.nullcontext()
    with profiler as prof:
        steps = serve(rt, reqs, chunk=chunk, free_blocks=rng.permutation(cfg.num_blocks).tolist(), never=never,
                      on_step=show)
    worst = logit_error(hf, reqs, device)
    tol = 5e-2 if on_gpu else 1e-4
    print(f"done: {steps} steps; buckets {', '.join(f'{k} x{v}' for k, v in sorted(buckets.items()))}")
    ok = worst < tol
    if on_gpu:
        seen = count_transfers(prof, "graphrt_step")
        print(f"  H2D copies: {seen.h2d_pinned} pinned, {seen.h2d_pageable} pageable over {steps} steps; "
              f"host syncs inside rt.step: {seen.syncs}")
        ok = ok and seen.h2d_pinned == steps and seen.h2d_pageable == 0 and seen.syncs == 0
    print(f"  logits vs transformers' own forward, worst error / max |logit|: {worst:.2e} "
          f"({'ok' if worst < tol else 'TOO LARGE'}, tolerance {tol:g})")
    for r in reqs:
        images = f", images at {r.images}" if r.features is not None else ""
        print(f"  request {r.rid}: prompt {len(r.prompt)} tokens{images}, ranges {r.ranges}, "
              f"generated {r.generated}")
    return 0 if ok else 1
