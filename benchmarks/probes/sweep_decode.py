"""Small-batch decode, variant by variant in one run: what each change to the decode launch
is worth, as time per launch inside a graph of launches (as ``sweep_splits.py``).

    python benchmarks/probes/sweep_decode.py [--out DIR] [--heads HQ,HKV,D] [--shapes B:CTX,...]
                                             [--variants "V1;V2;..."]

Variants (bf16 cache, 32/8 heads, head_dim 128 unless ``--heads`` says otherwise, e.g.
``32,8,64`` for Llama-3.2-1B; KV block 16, random block placement):

    search         the prefill launch's program mapping (a binary search over
                   query_start_loc per program) with the decode tile
    map            the decode launch's mapping (program p takes sequence p): the default
    pdl            ... launched as programmatic dependents (GRAPHRT_PDL=1)
    map n64        ... with 64-key tiles instead of 128
    map sN         ... with N pipeline stages instead of 2
    map rN         ... with at most N registers per thread (``KernelConfig.maxnreg``)
    map xN         ... with N splits instead of ``decode_splits``' pick
    ... launch     ... with the split-KV merge as a second launch (``fuse_merge=False``)
    ... fused      ... with the merge inside the attention launch (``fuse_merge=True``)
    ... uN         ... its partials loaded N splits at a time (default 4 for 16-row tiles)
    ... rope       ... given the new K/V and cos/sin tables (``new_kv`` and ``rope``: the
                   launch rotates q and k, as a compiled decoder's decode buckets do)

and a layer-like graph, ``layer-off`` (``layer-pdl`` with PDL on; ``launch`` / ``fused``
words as above): a torch kernel (standing for the projections), the KV write, then
attention (+ merge), per call; with ``kvin`` the attention launch writes the K/V itself
(``new_kv``, as the runtime's decode buckets do). The run measures the variants in
``main``; the words combine freely. Writes ``sweep_decode.json``: per row ms, TB/s read
and ``of_copy``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from pathlib import Path

import torch

import graphrt.bench.kernels as bk
from graphrt.bench.common import time_ms, write
from graphrt.bench.kernels import DEV, DT, _caches, calls_per_graph, ceilings, kv_bytes, make_meta

SHAPES = [(1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (64, 8192)]


def launch_ms(batch: int, ctx: int, variant: str, *, iters: int, layer: bool = False) -> tuple[float, int]:
    """(ms per call, splits) of one variant at (batch, context)."""
    from graphrt.kernels import decode_splits, default_config, paged_attention, split_workspace, write_kv
    pa = importlib.import_module("graphrt.kernels.paged_attention")

    HQ, HKV, D = bk.HQ, bk.HKV, bk.D
    meta, nblk = make_meta([1] * batch, [ctx - 1] * batch, [[]] * batch)
    cfg = default_config(D, DT, HQ // HKV, max_query_len=1)
    splits = None
    max_query_len = 1
    words = variant.split()
    pdl = words[0] in ("pdl", "layer-pdl")
    cfg = dataclasses.replace(cfg, pdl=pdl)
    merge_rows = pa._MERGE_ROWS
    rope = "rope" in words
    kv_in_launch = "kvin" in words or rope
    if words[0] == "search":
        max_query_len = None
    for w in words[1:]:
        if w == "launch":
            cfg = dataclasses.replace(cfg, fuse_merge=False)
        elif w == "fused":
            cfg = dataclasses.replace(cfg, fuse_merge=True)
        elif w in ("kvin", "rope"):
            pass
        elif w.startswith("u"):
            merge_rows = 16 * int(w[1:])
        elif w.startswith("n"):
            cfg = dataclasses.replace(cfg, block_n=int(w[1:]))
        elif w.startswith("r"):
            cfg = dataclasses.replace(cfg, maxnreg=int(w[1:]))
        elif w.startswith("s"):
            cfg = dataclasses.replace(cfg, num_stages=int(w[1:]))
        elif w.startswith("x"):
            splits = int(w[1:])
    if splits is None:      # decode_splits' pick, its key tiles counted for this context
        splits = decode_splits(batch, HKV, DEV, max_key_tiles=-(-ctx // cfg.block_n))
    calls = calls_per_graph(kv_bytes(batch, ctx))
    layers = []
    for _ in range(calls):
        kc, vc = _caches(nblk)
        q = torch.randn(batch, HQ, D, device=DEV, dtype=DT)
        kv = torch.randn(batch, HKV, D, device=DEV, dtype=DT)
        ws = split_workspace(batch, HQ, D, splits, DEV) if splits > 1 else None
        layers.append((q, kc, vc, kv, torch.empty_like(q), ws))
    angle = torch.rand(batch, D // 2, device=DEV) * 6.28
    tables = (torch.cat([angle.cos()] * 2, -1).to(DT), torch.cat([angle.sin()] * 2, -1).to(DT)) if rope else None

    def run():
        for q, kc, vc, kv, out, ws in layers:
            if layer:
                q.mul_(1.0)                       # a torch kernel before the layer's own
                if not kv_in_launch:
                    write_kv(kv, kv, kc, vc, meta)    # PDL as GRAPHRT_PDL says
            paged_attention(q, kc, vc, out, meta, num_splits=splits, workspace=ws, max_query_len=max_query_len,
                            config=cfg, new_kv=(kv, kv) if kv_in_launch else None, rope=tables)

    previous = os.environ.get("GRAPHRT_PDL")
    os.environ["GRAPHRT_PDL"] = "1" if pdl else "0"
    rows_before, pa._MERGE_ROWS = pa._MERGE_ROWS, merge_rows
    try:
        return time_ms(run, iters=iters) / calls, splits
    finally:
        pa._MERGE_ROWS = rows_before
        if previous is None:
            del os.environ["GRAPHRT_PDL"]
        else:
            os.environ["GRAPHRT_PDL"] = previous


def merge(folder: Path, labels: list[str], out: Path) -> Path:
    """``ab_decode_<a>_vs_<b>.json``: per cell the median µs over rounds of the sweeps run
    on the new tree (``new_*``) and the old one (``old_*``), and their ratio new / old."""
    import json
    import statistics

    runs: dict[str, dict[tuple, list[float]]] = {"new": {}, "old": {}}
    env = None
    for path in sorted(folder.glob("*_*/sweep_decode.json")):
        tree = path.parent.name.split("_")[0]
        data = json.loads(path.read_text())
        env = env or data["env"]
        for row in data["rows"]:
            key = (row["variant"], row["batch"], row["context"], row["splits"])
            runs[tree].setdefault(key, []).append(1000 * row["ms"])
    rows = []
    for key in runs["new"]:
        if key not in runs["old"]:
            continue
        a, b = statistics.median(runs["new"][key]), statistics.median(runs["old"][key])
        rows.append(dict(zip(("variant", "batch", "context", "splits"), key), **{
            f"{labels[0]}_us": a, f"{labels[1]}_us": b, "ratio": a / b,
            "rounds": [len(runs["new"][key]), len(runs["old"][key])]}))
        print(f"batch {key[1]:3d} ctx {key[2]:6d} {key[0]:24s} {a:8.2f} against {b:8.2f} us: {a / b:.3f}")
    return write(out, f"ab_decode_{labels[0]}_vs_{labels[1]}", rows, dict(env or {}, labels=labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument("--heads", default=None, help="HQ,HKV,D: query heads, KV heads, head_dim")
    parser.add_argument("--shapes", default=None, help="batch:context pairs, comma-separated")
    parser.add_argument("--variants", default=None, help="';'-separated variants instead of the default set")
    parser.add_argument("--merge", type=Path, default=None,
                        help="no run: merge DIR/new_<round>/ and DIR/old_<round>/ sweeps (h200_checks.sh ab-decode)")
    parser.add_argument("--labels", default="new,old", help="with --merge: the two trees' names")
    args = parser.parse_args()
    if args.merge is not None:
        print(f"wrote {merge(args.merge, args.labels.split(','), args.out)}")
        return
    quick = not torch.cuda.is_available()
    if args.heads:
        bk.HQ, bk.HKV, bk.D = (int(x) for x in args.heads.split(","))
    shapes = [(1, 64), (2, 64)] if quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in pair.split(":")) for pair in args.shapes.split(",")]
    iters = 3 if quick else 50
    env = ceilings(quick)
    env["heads"] = [bk.HQ, bk.HKV, bk.D]
    rows = []
    for batch, ctx in shapes:
        variants = ["map", "map launch", "map fused"]
        if batch == 1:
            variants += ["map x8 launch", "map x16 launch", "map x48 launch", "map x64", "map x64 fused",
                         "map n64 r128", "map x64 n64 r128", "map x64 launch n64 r128", "map x48 launch n64 r128"]
        if batch == 8:
            variants += ["map x2", "map x8 fused", "map x6 launch", "map n64 r128", "map x8 fused n64 r128",
                         "map x8 launch n64 r128"]
        cells = [(v, False) for v in variants] + [("layer-off", True), ("layer-off launch", True),
                                                  ("layer-off fused", True), ("layer-off launch kvin", True),
                                                  ("layer-off fused kvin", True)]
        if args.variants:
            cells = [(v.strip(), v.strip().startswith("layer")) for v in args.variants.split(";") if v.strip()]
        for name, layer in cells:
            ms, splits = launch_ms(batch, ctx, name, iters=iters, layer=layer)
            tbps = kv_bytes(batch, ctx) / ms / 1e9
            rows.append(dict(variant=name, batch=batch, context=ctx, splits=splits, ms=ms, tbps=tbps,
                             of_copy=tbps / env["copy_tbps"], calls_per_graph=calls_per_graph(kv_bytes(batch, ctx))))
            print(f"batch {batch:3d} ctx {ctx:6d} {name:24s} splits {splits:2d}: {1000 * ms:8.2f} us "
                  f"{tbps:5.2f} TB/s = {tbps / env['copy_tbps']:.2f} x copy", flush=True)
    print(f"wrote {write(args.out, 'sweep_decode' if not quick else 'sweep_decode_quick', rows, env)}")


if __name__ == "__main__":
    main()
