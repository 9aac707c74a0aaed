"""The sampling stage's cost per step: ``graphrt.kernels.sampling.sample`` in a CUDA graph
(what a captured step with ``ctx.sample`` runs) against the same draw written in eager
torch after the replay, the usual way (a sort of each row, a cumulative softmax for top-p,
masks for top-k and min-p, an exponential race), at Llama-3's and Gemma-3's vocabularies
(128256, 262208) and batch 1 to 256, bf16 logits.

Settings: greedy (temperature 0: graphrt reads the row once; torch an argmax), temperature
only (0.8), and filtered (temperature 0.8, top-k 50, top-p 0.9, min-p 0.05). Each figure
is a median over 50 timed runs (``graphrt.bench.common.time_ms``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphrt.bench.common import progress, quick_out_main, time_ms, write

SETTINGS = {"greedy": (0.0, 0, 1.0, 0.0), "temperature": (0.8, 0, 1.0, 0.0), "filtered": (0.8, 50, 0.9, 0.05)}


def torch_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Per-row temperature / top-k / top-p / min-p in eager torch (rows of temperature 0
    take the argmax): what an inference loop does with the logits a replay returns."""
    x = logits.float() / temperature.clamp_min(1e-5)[:, None]
    values, order = x.sort(dim=-1, descending=True)                               # [S, V]
    probs = values.softmax(dim=-1)
    ranks = torch.arange(x.shape[1], device=x.device)[None, :]
    drop = (ranks >= torch.where(top_k > 0, top_k, x.shape[1])[:, None])           # top-k
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]                      # top-p (mass above >= p)
    drop |= probs < (min_p[:, None] * probs[:, :1])                                # min-p
    probs = probs.masked_fill(drop, 0.0)
    race = probs / torch.empty_like(probs).exponential_()                          # an exponential race
    drawn = order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    from graphrt.kernels.sampling import sample

    cuda = torch.cuda.is_available()
    small = quick or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    vocabs, batches = ((96,), (1, 4)) if small else ((128256, 262208), (1, 8, 64, 256))
    cells = [(v, b, name) for v in vocabs for b in batches for name in SETTINGS]
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab, batch, name in progress(cells, "sampling", quiet):
        t, k, p, mp = SETTINGS[name]
        logits = (torch.randn(batch, vocab, generator=gen, device=device) * 3).to(dtype)
        args = dict(temperature=torch.full((batch,), t, device=device), top_k=torch.full((batch,), k, device=device,
                                                                                         dtype=torch.int32),
                    top_p=torch.full((batch,), p, device=device), min_p=torch.full((batch,), mp, device=device))
        seed = torch.arange(batch, device=device)
        counter = torch.full((batch,), 100, device=device, dtype=torch.int64)
        out_ids = torch.empty(batch, dtype=torch.int64, device=device)
        graphrt_ms = time_ms(lambda: sample(logits, **args, seed=seed, counter=counter, out=out_ids))
        torch_ms = time_ms(lambda: torch_sample(logits, **args), graph=False)
        row = dict(bench="sampling", vocab=vocab, batch=batch, setting=name, logits_bytes=logits.numel() * 2)
        rows.append(dict(row, impl="graphrt", ms=graphrt_ms))
        rows.append(dict(row, impl="torch_eager", ms=torch_ms, over_graphrt=torch_ms / graphrt_ms))
        if not quiet:
            print(f"V={vocab} B={batch} {name}: graphrt {graphrt_ms * 1e3:.1f} us, torch eager {torch_ms * 1e3:.1f} us "
                  f"({torch_ms / graphrt_ms:.2f}x)", flush=True)
    path = write(out, "sampling_quick" if small else "sampling", rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
