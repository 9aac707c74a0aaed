"""Where the sampling stage's time goes: ``graphrt.kernels.sampling.sample`` captured in a
CUDA graph, timed (replay median) and profiled by kernel (µs per replay of each pass's
launches), per vocabulary, batch and setting, for a few tiles of the radix passes.

    python benchmarks/probes/probe_sampling.py [--out DIR] [--batches 1,8,64,256] [--vocabs 128256]
        [--settings filtered,top_k] [--tiles default,256x4] [--paths short,radix]

The question: ``graphrt bench sampling`` (H100, f267cd3) has the filtered setting (top-k
50, top-p 0.9, min-p 0.05) at 0.30-0.40x of eager torch from batch 64 on (3.4 ms at
batch 64, 128k vocabulary), and greedy at batch 256 at 1.0 ms for 66 MB of logits, where
a read at the copy rate takes ~20 µs. Which launches hold it (the twenty passes' idle
programs, or the radix levels' reads), and do the radix levels' tiles matter (at 1024
logits a tile they take 168-203 registers, sm_90a, Triton 3.9's ptxas: two programs an
SM)? Each row gives the replay's median and each kernel's µs per replay (and
``greedy``'s two launches beside them, setting ``greedy_op``). ``--paths``: ``short`` is
the default (rows with top-k at most the chunk count take the short path), ``radix``
sends every filtered row to the radix selects (a list of two), the two side by side in
one run. Writes ``probe_sampling.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from graphrt.bench.common import captured, default_out, kernel_us, time_ms, write
from graphrt.bench.sampling import SETTINGS

SETTINGS = {**SETTINGS, "top_k": (0.8, 50, 1.0, 0.0), "top_p": (0.8, 0, 0.9, 0.0)}


def main() -> None:
    from graphrt.kernels import sampling as ks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<card>")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--vocabs", default="128256")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--tiles", default="default,512x4,256x4,1024x8",
                        help="the radix levels' (logits a tile)x(warps), or default")
    parser.add_argument("--paths", default="short,radix", help="short (the default list), radix (a list of two)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batches = [int(b) for b in args.batches.split(",")] if cuda else [2]
    vocabs = [int(v) for v in args.vocabs.split(",")] if cuda else [96]
    tiles = [None if t == "default" else tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    tiles = tiles if cuda else tiles[:2]
    paths = {"short": ks.CANDIDATES, "radix": 2}
    paths = {name: paths[name] for name in args.paths.split(",")}
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for vocab in vocabs:
        for batch in batches:
            logits = (torch.randn(batch, vocab, generator=gen, device=device) * 3).to(
                torch.bfloat16 if cuda else torch.float32)
            seed = torch.arange(batch, device=device)
            counter = torch.full((batch,), 100, device=device, dtype=torch.int64)
            out = torch.empty(batch, dtype=torch.int64, device=device)
            # graphrt.kernels.greedy beside them: the two launches a greedy-only loop makes
            ms = time_ms(lambda: ks.greedy(logits, out=out))
            kernels = kernel_us(captured(lambda: ks.greedy(logits, out=out))) if cuda else {}
            rows.append(dict(vocab=vocab, batch=batch, setting="greedy_op", radix=None, ms=ms,
                             logits_mb=logits.numel() * logits.element_size() / 1e6, kernels_us=kernels))
            print(f"V={vocab} B={batch} greedy_op: {ms * 1e3:.1f} us", flush=True)
            for name in args.settings.split(","):
                t, k, p, mp = SETTINGS[name]
                st = dict(temperature=torch.full((batch,), t, device=device),
                          top_k=torch.full((batch,), k, device=device, dtype=torch.int32),
                          top_p=torch.full((batch,), p, device=device), min_p=torch.full((batch,), mp, device=device))
                want = None
                for tile, (path, candidates) in [(t, p) for t in tiles for p in paths.items()]:
                    def run(tile=tile, candidates=candidates):
                        ks._passes(logits, st["temperature"], st["top_k"], st["top_p"], st["min_p"], seed, counter,
                                   out, None, None, radix=tile, candidates=candidates)
                    try:
                        ms = time_ms(run)
                        ids = out.clone()
                        kernels = kernel_us(captured(run)) if cuda else {}
                    except Exception as exc:      # a tile that does not compile or fit: recorded, not fatal
                        print(f"V={vocab} B={batch} {name} {tile} {path}: {type(exc).__name__}: {exc}"[:300],
                              flush=True)
                        rows.append(dict(vocab=vocab, batch=batch, setting=name, radix=tile, path=path,
                                         error=str(exc)[:300]))
                        continue
                    want = ids if want is None else want
                    row = dict(vocab=vocab, batch=batch, setting=name, radix=tile, path=path, ms=ms,
                               logits_mb=logits.numel() * logits.element_size() / 1e6,
                               same_ids_as_default=bool(torch.equal(ids, want)), kernels_us=kernels)
                    rows.append(row)
                    top = ", ".join(f"{k.split('_kernel')[0]}_kernel {v}" for k, v in list(kernels.items())[:4])
                    print(f"V={vocab} B={batch} {name} radix={tile} {path}: {ms * 1e3:.1f} us  [{top}]", flush=True)
    path = write(args.out or default_out(), "probe_sampling" if cuda else "probe_sampling_cpu", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
