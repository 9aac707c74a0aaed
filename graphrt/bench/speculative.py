"""Speculative decoding's tokens per second against plain greedy decoding of the target,
at acceptance rates from about 0 to 1 (``graphrt.speculative``: every acceptance decided
on the device, the host never waits for a count).

The target is a Llama-3.2-1B-shaped decoder (16 layers, hidden 2048, 32/8 heads of 64,
vocabulary 128256, tied head), random bf16 weights drawn wide (``integrations.tiny.widen``:
greedy tokens far from ties). Its layers past the second have their attention output
and MLP down projections set to zero: every matmul of all 16 layers still runs (the cost
of a real 1B step), but those layers add nothing to the residual stream, so a 2-layer
draft holding the target's first two layers, embeddings and head computes the target's
own logits. That draft accepts (nearly) every draft token; the same draft with its
weights moved by a share of their spread (``integrations.tiny.nudge``) accepts fewer;
an independent random draft accepts about none. The draft reads the first two layers
and the 0.5 GB head: about a third of the target's bytes a token.

Per cell (batch, K drafts a step, draft): plain greedy decoding (one captured decode step
a token, the argmax inside the graph, the next ids fed device-to-device) and the
speculative loop (K draft steps and one verify step an iteration, all captured), each
timed over the same number of iterations after a warm-up: ``plain_tok_s``,
``spec_tok_s`` (the tokens the verify steps emitted, summed over the batch, over the
loop's wall time), ``speedup``, ``acceptance`` (accepted drafts / K, mean over
iterations and requests) and ``tokens_equal`` (the share of each request's emitted
tokens, from its first, that equal plain greedy decoding's). Prompts of 128 tokens.

``--sampled``: every request samples (temperature 1, top-p 0.95, its own seed) in both
loops, the speculative one by rejection sampling (``SpecState(vocab=)``); tokens_equal is
then not reported (the two loops draw from the same distributions with different
randomness).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import default_out, progress, sync, write

TARGET = dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)
QUICK = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=96, tie_word_embeddings=True)
DRAFT_LAYERS = 2
# the draft: its weights moved by this share of their spread (0: the target's own first layers), or None:
# independent random weights
DRAFTS = {"same": 0.0, "nudge-0.05": 0.05, "nudge-0.15": 0.15, "nudge-0.3": 0.3, "independent": None}


def _llama(spec: dict, layers: int, device, dtype):
    import transformers

    cfg = transformers.LlamaConfig(**dict(spec, num_hidden_layers=layers), max_position_embeddings=4096)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


@torch.no_grad()
def build(spec: dict, device, dtype) -> tuple:
    """(target, {draft name: draft}) as transformers models on ``device``."""
    from graphrt.integrations.tiny import nudge, widen

    target = widen(_llama(spec, spec["num_hidden_layers"], device, dtype), 0)
    for layer in target.model.layers[DRAFT_LAYERS:]:      # computed, but add nothing to the residual stream
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    drafts = {}
    for name, share in DRAFTS.items():
        draft = _llama(spec, DRAFT_LAYERS, device, dtype)
        if share is None:
            widen(draft, 1)
        else:
            own = dict(target.named_parameters())
            for n, p in draft.named_parameters():
                p.copy_(own[n])
            if share:
                nudge(draft, share, 7)
        drafts[name] = draft.to(dtype).eval()
    return target.to(dtype).eval(), drafts



def run(*, quick: bool, out: Path, batches: list[int] | None = None, drafts_k: list[int] | None = None,
        iterations: int | None = None, sampled: bool = False, quiet: bool = False) -> list[dict]:
    from graphrt import Runtime, SamplingParams, SeqStep, Step
    from graphrt.integrations.transformers import TransformersModel
    from graphrt.kernels.ops import greedy as greedy_op
    from graphrt.speculative import SpeculativeLoop, SpecState, speculative_runtimes

    cuda = torch.cuda.is_available()
    small = quick or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    spec = QUICK if small else TARGET
    batches = batches or ([2] if small else [1, 8])
    drafts_k = drafts_k or ([2] if small else [3, 5])
    iterations = iterations or (2 if small else 24)
    warm = 1 if small else 3
    prompt = 8 if small else 128
    hf_target, hf_drafts = build(spec, device, dtype)
    target = TransformersModel(hf_target)
    block = 16
    rows = []
    cells = [(b, k, name) for b in batches for k in drafts_k for name in (["same", "independent"] if small else DRAFTS)]
    built: dict = {}
    for batch, k, name in progress(cells, "speculative", quiet):
        tokens_per_req = prompt + (warm + iterations + SpeculativeLoop.RING + 2) * (k + 1)
        per_req = -(-tokens_per_req // block)
        key = (batch, k)
        if key not in built:      # the plain runtime and the prompts of this batch and K
            cfg = target.runtime_config(block_size=block, num_blocks=batch * per_req + 1, max_num_seqs=batch,
                                        max_num_tokens=max(batch * prompt, batch * (k + 1)),
                                        max_model_len=per_req * block, speculative=True, sampling=sampled)
            pick = (lambda ctx: ctx.sample(target(ctx))) if sampled else (lambda ctx: greedy_op(target(ctx)))
            plain = Runtime(cfg, pick, num_layers=target.num_layers, device=device, strict=False)
            if cuda:
                plain.capture(decode_buckets=[batch], mixed_buckets=[], quiet=True)
            rng = np.random.default_rng(batch * 100 + k)
            prompts = [rng.integers(0, spec["vocab_size"], prompt) for _ in range(batch)]
            blocks = [list(range(per_req * r, per_req * (r + 1))) for r in range(batch)]
            built = {key: (cfg, plain, prompts, blocks)}
        cfg, plain, prompts, blocks = built[key]
        total = warm + iterations
        settings = tuple(SamplingParams(temperature=1.0, top_p=0.95, seed=r) for r in range(batch)) if sampled else None

        # plain greedy decoding: (k + 1) * total steps, the ids fed device to device
        ids = plain.step(Step([SeqStep(q_len=prompt, context_len=0, block_ids=b) for b in blocks]),
                         np.concatenate(prompts), sampling=settings)[:batch]
        plain_tokens = [ids]
        table = np.asarray(blocks)
        ones = np.ones(batch, np.int64)
        steps = (k + 1) * total

        def decode(i: int, ids: torch.Tensor) -> torch.Tensor:
            step = Step.from_arrays(q_lens=ones, context_lens=np.full(batch, prompt + i, np.int64), block_table=table)
            return plain.step(step, ids, sampling=settings)[:batch].clone()
        for i in range(steps):
            if i == warm * (k + 1):
                sync(device)
                t0 = time.perf_counter()
            ids = decode(i, ids)
            plain_tokens.append(ids)
        sync(device)
        plain_s = time.perf_counter() - t0
        plain_tok_s = batch * iterations * (k + 1) / plain_s
        want = torch.stack(plain_tokens, 1).tolist()                         # [batch, steps + 1]

        # speculative: a state and four runtimes for this draft (the target's own shared)
        draft = TransformersModel(hf_drafts[name])
        state = SpecState(batch, k, device, vocab=spec["vocab_size"] if sampled else None)
        runtimes = speculative_runtimes(cfg, state, target, draft, device=device)
        if cuda:
            t_pre, t_ver, d_pre, d_dec = runtimes
            t_ver.capture(decode_buckets=[], mixed_buckets=[], verify_buckets=[batch], drafts=k, quiet=True)
            d_dec.capture(decode_buckets=[batch], mixed_buckets=[2 * batch], quiet=True)
        loop = SpeculativeLoop(state, *runtimes)
        loop.prefill(prompts, blocks, sampling=settings)
        outputs = []
        for i in range(total):
            if i == warm:
                sync(device)
                t0 = time.perf_counter()
            outputs.append(loop.iterate())
        sync(device)
        spec_s = time.perf_counter() - t0
        emitted = torch.stack([e for e, _ in outputs]).tolist()             # [total, batch, k + 1]
        counts = torch.stack([c for _, c in outputs]).tolist()              # [total, batch]
        spec_tokens = sum(sum(c) for c in counts[warm:])
        got = [[t for it in range(total) for t in emitted[it][r][: counts[it][r]]] for r in range(batch)]
        equal = []
        for g, w in zip(got, want):
            n = 0
            while n < min(len(g), len(w)) and g[n] == w[n]:
                n += 1
            equal.append(n / min(len(g), len(w)))
        acceptance = float(np.mean([c - 1 for it in counts[warm:] for c in it])) / k
        spec_tok_s = spec_tokens / spec_s
        row = dict(bench="speculative", batch=batch, drafts=k, draft=name, draft_layers=DRAFT_LAYERS,
                   target_layers=spec["num_hidden_layers"], prompt=prompt, iterations=iterations,
                   acceptance=acceptance, plain_tok_s=plain_tok_s, spec_tok_s=spec_tok_s,
                   speedup=spec_tok_s / plain_tok_s, plain_ms_per_step=plain_s / (iterations * (k + 1)) * 1e3,
                   spec_ms_per_iteration=spec_s / iterations * 1e3, sampled=sampled,
                   tokens_equal=None if sampled else float(np.mean(equal)))
        rows.append(row)
        if not quiet:
            print(f"B={batch} K={k} draft={name}: acceptance {acceptance:.2f}, plain {plain_tok_s:.0f} tok/s, "
                  f"speculative {spec_tok_s:.0f} tok/s ({row['speedup']:.2f}x)"
                  + ("" if sampled else f", tokens equal {row['tokens_equal']:.2f}"),
                  flush=True)
        del loop, runtimes, state, draft
    path = write(out, ("speculative_quick" if small else "speculative") + ("_sampled" if sampled else ""), rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (what the CPU test runs)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--drafts", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="K, drafts a step (default 3,5)")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--sampled", action="store_true", help="every request samples (module doc)")
    args = parser.parse_args(argv)
    run(quick=args.quick, out=args.out or default_out(), batches=args.batches, drafts_k=args.drafts,
        iterations=args.iterations, sampled=args.sampled)


if __name__ == "__main__":
    main()
