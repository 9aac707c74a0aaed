"""``graphrt`` command line: ``graphrt demo``, ``graphrt bench``, ``graphrt profile`` and ``graphrt info``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _pick_device(name: str) -> str:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("graphrt: --device cuda asked for, but torch sees no CUDA device")
    if name == "cpu":
        # Must precede the first kernel import: Triton fixes the mode when kernels are defined.
        os.environ["TRITON_INTERPRET"] = "1"
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a few synthetic multimodal requests with a tiny model")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--requests", type=int, default=3)
    demo.add_argument("--new-tokens", type=int, default=4, help="tokens generated per request")
    demo.add_argument("--chunk", type=int, default=None,
                      help="prefill tokens per step (chunked prefill; default 32, 12 with --model)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--speculative", action="store_true",
                      help="greedy speculative decoding of a tiny Llama with a draft model, acceptance on the "
                           "device (needs the transformers extra); with --sample, sampled (rejection sampling)")
    demo.add_argument("--sample", action="store_true",
                      help="draw tokens inside the step (temperature 0.8, top-k 50, top-p 0.95, a seed per "
                           "request; with --speculative top-k 20) instead of the loop's argmax: the toy "
                           "model or --speculative")
    demo.add_argument("--model", default="toy",
                      help="toy (graphrt's own), or a tiny random transformers model through the adapter, "
                           "one of graphrt.integrations.tiny.KINDS: llama, qwen3, granite, gpt-neox, gemma3 "
                           "(images), paligemma (prefix-LM), qwen2-vl (multimodal RoPE), ... (needs the "
                           "transformers extra)")
    bench = sub.add_parser("bench", help="benchmarks: JSON and PNG under benchmarks/results/<gpu or cpu>/")
    bench.add_argument("which", nargs="*", default=[], help="step, kernels, runtime, host, capture, soak, parallel, model, sampling (default: all)")
    bench.add_argument("--quick", action="store_true", help="tiny sizes; on CPU always")
    bench.add_argument("--no-flex", action="store_true", help="skip compiled flex_attention in kernels")
    bench.add_argument("--only", default=None, help="kernels: a comma-separated subset of decode,prefill,mixed")
    bench.add_argument("--out", type=Path, default=None)
    prof = sub.add_parser("profile", help="profile decode steps of the toy model: trace + per-step GPU figures")
    prof.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    prof.add_argument("--layers", type=int, default=8)
    prof.add_argument("--batch", type=int, default=8)
    prof.add_argument("--context", type=int, default=1024)
    prof.add_argument("--prefill", type=int, default=0,
                      help="one more sequence prefilling this many tokens beside the decodes (a mixed step)")
    prof.add_argument("--steps", type=int, default=20)
    prof.add_argument("--warmup", type=int, default=5)
    prof.add_argument("--trace", type=Path, default=Path("graphrt_trace.json"), help="Chrome/Perfetto trace to write")
    prof.add_argument("--nsys", action="store_true",
                      help="no torch profiler: mark the steps with cudaProfilerStart/Stop and NVTX for Nsight Systems")
    sub.add_parser("info", help="versions, GPU, whether the C helper graphrt._fast was built, where 'kernels' resolves")
    args = parser.parse_args(argv)
    if args.command == "demo" and args.sample and args.model != "toy" and not args.speculative:
        parser.error(f"--sample runs with the toy model or with --speculative, not with --model {args.model}")

    if args.command == "info":
        from graphrt.info import run

        return run()
    if args.command == "bench":
        return _bench(args)
    device = _pick_device(args.device)
    if args.command == "profile":
        from graphrt.profile import run_profile

        return run_profile(device=device, layers=args.layers, batch=args.batch, context=args.context,
                           steps=args.steps, warmup=args.warmup, trace=args.trace, nsys=args.nsys,
                           prefill=args.prefill)
    if args.speculative:
        from graphrt.demo_speculative import run_speculative_demo

        return run_speculative_demo(device=device, seed=args.seed, sample=args.sample)
    if args.model != "toy":
        from graphrt.demo_transformers import run_transformers_demo

        return run_transformers_demo(kind=args.model, device=device, chunk=args.chunk or 12,
                                     seed=args.seed)
    from graphrt.demo import run_demo

    return run_demo(device=device, layers=args.layers, requests=args.requests, new_tokens=args.new_tokens,
                    chunk=args.chunk or 32, seed=args.seed, sample=args.sample)


def _bench(args) -> int:
    import importlib

    from graphrt.bench import BENCHES

    which = args.which or list(BENCHES)
    unknown = sorted(set(which) - set(BENCHES))
    if unknown:
        raise SystemExit(f"graphrt bench: unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    _pick_device("auto")
    from graphrt.bench.common import default_out

    out = args.out or default_out()
    for name in which:
        module = importlib.import_module(f"graphrt.bench.{name}")
        print(f"== {name}", flush=True)
        kwargs = {}
        if name == "kernels":
            kwargs = dict(flex=not args.no_flex, only=set(args.only.split(",")) if args.only else None)
        module.run(quick=args.quick, out=out, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
