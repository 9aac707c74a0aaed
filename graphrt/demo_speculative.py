"""``graphrt demo --speculative``: greedy speculative decoding of a tiny random-weight Llama
(the target) with a draft whose weights are the target's moved by a tenth of their size
(so it agrees some of the time), each through the transformers adapter on its own
runtimes, every acceptance decided on the device (``graphrt.speculative``). The tokens
are checked against the target's plain greedy decoding. Needs the transformers extra.

``--sample`` (``sample=True``): sampled speculative decoding instead (each request's
``SamplingParams``: temperature 0.8, top-k 20, top-p 0.95, its own seed; rejection
sampling against the draft's kept distributions). Its checks: every emitted token lies in
the target's kept set at its place (the target's logits of the emitted sequence, one
step, against the float64 reference filters; on a GPU in bf16 a token at the set's edge
within 2e-2 of the largest logit counts), and a second run with the same seeds emits the
same tokens.
"""

from __future__ import annotations

import time

import numpy as np
import torch


SETTINGS = dict(temperature=0.8, top_k=20, top_p=0.95)     # --sample's, with a seed per request


def run_speculative_demo(*, device: str, drafts: int = 3, iterations: int = 6, seed: int = 0,
                         sample: bool = False) -> int:
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
                                max_num_tokens=64, max_model_len=256, speculative=True, sampling=sample)
    n, kw = target.num_layers, dict(device=device, strict=on_gpu)
    state = SpecState(requests, drafts, device, vocab=target.hf.config.vocab_size if sample else None)
    runtimes = speculative_runtimes(cfg, state, target, draft, **kw)
    plain = Runtime(cfg, target.all_logits if sample else target, num_layers=n, **kw)
    if on_gpu:
        for rt in (*runtimes, plain):   # the verify runtime (second) with a verify bucket of 4 sequences
            rt.capture(decode_buckets=[4], mixed_buckets=[16, 64], quiet=True,
                       **(dict(verify_buckets=[4], drafts=drafts) if rt is runtimes[1] else {}))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 64, int(m)) for m in rng.integers(6, 14, requests)]
    blocks = [list(range(per_request * r, per_request * (r + 1))) for r in range(requests)]
    print(f"graphrt demo --speculative{' --sample' if sample else ''}: {'cuda (' + torch.cuda.get_device_name() + '), graph replay' if on_gpu else 'cpu, eager through the Triton interpreter'}; "
          f"tiny Llama target ({n} layers) and a draft near it, {drafts} drafts a step, {requests} requests"
          + (f"; sampled ({', '.join(f'{k} {v}' for k, v in SETTINGS.items())}, a seed per request)" if sample else ""))

    loop = SpeculativeLoop(state, *runtimes)
    settings = None
    if sample:
        from graphrt.sampling import SamplingParams

        settings = [SamplingParams(**SETTINGS, seed=1000 * seed + r) for r in range(requests)]

    def generate() -> tuple[list[list[int]], list[int]]:
        loop.prefill(prompts, blocks, sampling=settings)
        outputs = [loop.iterate() for _ in range(iterations)]
        got, accepted = [[] for _ in prompts], []
        for emitted, counts in outputs:                    # read once, after the loop
            for r, (row, c) in enumerate(zip(emitted.tolist(), counts.tolist())):
                got[r] += row[:c]
                accepted.append(c - 1)
        return got, accepted
    t0 = time.perf_counter()
    got, accepted = generate()
    spec_s = time.perf_counter() - t0
    if sample:
        return _check_sampled(plain, prompts, blocks, got, accepted, generate, drafts, iterations, on_gpu)

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
    _report(prompts, got, accepted, drafts, iterations)
    print(f"  host-side time: speculative {spec_s:.2f} s, plain greedy {plain_s:.2f} s for the same tokens "
          f"({'GPU, unprofiled' if on_gpu else 'interpreter: not a speed figure'})")
    print(f"  tokens equal the target's greedy decoding: {'yes' if same else 'NO'}")
    return 0 if same else 1


def _check_sampled(plain, prompts, blocks, got, accepted, generate, drafts: int, iterations: int,
                   on_gpu: bool) -> int:
    """--sample's checks (module doc): the emitted tokens inside the target's kept sets, and
    the same tokens from a second run with the same seeds."""
    from graphrt import SeqStep, Step
    from graphrt.kernels.reference import sampling_keep

    inside = edge = total = 0
    for p, b, g in zip(prompts, blocks, got):      # the target's logits after each token of prompt + emitted
        seq = np.concatenate([np.asarray(p), np.asarray(g[:-1], dtype=np.int64)])
        logits = plain.step(Step([SeqStep(q_len=len(seq), context_len=0, block_ids=b)]), seq).float().cpu()
        for i, token in enumerate(g):
            row = logits[len(p) - 1 + i]
            keep, _ = sampling_keep(row, SETTINGS["temperature"], SETTINGS["top_k"], SETTINGS["top_p"], 0.0)
            total += 1
            if keep[token]:
                inside += 1
            elif on_gpu and row[keep].min() - row[token] <= 2e-2 * row.abs().max():
                edge += 1                           # bf16: a token at the set's edge
    again, _ = generate()
    _report(prompts, got, accepted, drafts, iterations)
    print(f"  tokens inside the target's kept set at their place: {inside} of {total}"
          + (f" (and {edge} at its edge, within bf16's rounding)" if on_gpu else ""))
    print(f"  a second run with the same seeds emits the same tokens: {'yes' if again == got else 'NO'}")
    return 0 if inside + edge == total and again == got else 1


def _report(prompts, got, accepted, drafts: int, iterations: int) -> None:
    """The loop's tokens and acceptance, as both forms of the demo print them."""
    print(f"  {iterations} iterations: {sum(len(g) for g in got)} tokens, drafts accepted per step: mean "
          f"{np.mean(accepted):.2f} of {drafts} (each: {accepted})")
    for r, g in enumerate(got):
        print(f"  request {r}: prompt {len(prompts[r])} tokens, generated {g}")
