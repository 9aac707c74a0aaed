"""``graphrt demo --speculative``: greedy speculative decoding of a tiny random-weight Llama
(the target) with a draft whose weights are the target's moved by a tenth of their size
(so it agrees some of the time), each through the transformers adapter on its own
runtimes, every acceptance decided on the device (``graphrt.speculative``). The tokens
are checked against the target's plain greedy decoding. Needs the transformers extra.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def run_speculative_demo(*, device: str, drafts: int = 3, iterations: int = 6, seed: int = 0) -> int:
    from graphrt import Runtime, SeqStep, Step
    from graphrt.integrations.tiny import nudge, tiny_model
    from graphrt.integrations.transformers import TransformersModel
    from graphrt.speculative import SpeculativeLoop, SpecState, speculative_runtimes

    on_gpu = device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    target = TransformersModel(tiny_model("llama", seed).to(device=device, dtype=dtype))
    draft = TransformersModel(nudge(tiny_model("llama", seed), 0.1, seed + 1).to(device=device, dtype=dtype))
    requests, per_request = 3, 16                      # blocks of 16: room for 256 tokens each
    cfg = target.runtime_config(block_size=16, num_blocks=requests * per_request + 8, max_num_seqs=4,
                                max_num_tokens=64, max_model_len=256, speculative=True)
    n, kw = target.num_layers, dict(device=device, strict=on_gpu)
    state = SpecState(requests, drafts, device)
    runtimes = speculative_runtimes(cfg, state, target, draft, **kw)
    plain = Runtime(cfg, target, num_layers=n, **kw)
    if on_gpu:
        for rt in (*runtimes, plain):   # the verify runtime (second) with a verify bucket of 4 sequences
            rt.capture(decode_buckets=[4], mixed_buckets=[16, 64], quiet=True,
                       **(dict(verify_buckets=[4], drafts=drafts) if rt is runtimes[1] else {}))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 64, int(m)) for m in rng.integers(6, 14, requests)]
    blocks = [list(range(per_request * r, per_request * (r + 1))) for r in range(requests)]
    print(f"graphrt demo --speculative: {'cuda (' + torch.cuda.get_device_name() + '), graph replay' if on_gpu else 'cpu, eager through the Triton interpreter'}; "
          f"tiny Llama target ({n} layers) and a draft near it, {drafts} drafts a step, {requests} requests")

    loop = SpeculativeLoop(state, *runtimes)
    t0 = time.perf_counter()
    loop.prefill(prompts, blocks)
    outputs = [loop.iterate() for _ in range(iterations)]
    got = [[] for _ in prompts]
    accepted = []
    for emitted, counts in outputs:                    # read once, after the loop
        for r, (row, c) in enumerate(zip(emitted.tolist(), counts.tolist())):
            got[r] += row[:c]
            accepted.append(c - 1)
    spec_s = time.perf_counter() - t0

    # the target's plain greedy decoding, one token a step
    t0 = time.perf_counter()
    logits = plain.step(Step([SeqStep(q_len=len(p), context_len=0, block_ids=b) for p, b in zip(prompts, blocks)]),
                        np.concatenate(prompts))
    want = [[t] for t in logits[:requests].argmax(-1).tolist()]
    for j in range(max(len(g) for g in got) - 1):
        logits = plain.step(Step([SeqStep(q_len=1, context_len=len(p) + j, block_ids=b)
                                  for p, b in zip(prompts, blocks)]), [w[-1] for w in want])
        for w, t in zip(want, logits[:requests].argmax(-1).tolist()):
            w.append(t)
    plain_s = time.perf_counter() - t0
    same = all(g == w[: len(g)] for g, w in zip(got, want))
    tokens = sum(len(g) for g in got)
    print(f"  {iterations} iterations: {tokens} tokens, drafts accepted per step: mean {np.mean(accepted):.2f} of "
          f"{drafts} (each: {accepted})")
    print(f"  host-side time: speculative {spec_s:.2f} s, plain greedy {plain_s:.2f} s for the same tokens "
          f"({'GPU, unprofiled' if on_gpu else 'interpreter: not a speed figure'})")
    for r, g in enumerate(got):
        print(f"  request {r}: prompt {len(prompts[r])} tokens, generated {g}")
    print(f"  tokens equal the target's greedy decoding: {'yes' if same else 'NO'}")
    return 0 if same else 1
