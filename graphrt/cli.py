"""``graphrt`` command line: ``graphrt demo``."""

from __future__ import annotations

import argparse
import os
import sys


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
    demo.add_argument("--chunk", type=int, default=32, help="prefill tokens per step (chunked prefill)")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = _pick_device(args.device)
    from graphrt.demo import run_demo

    return run_demo(device=device, layers=args.layers, requests=args.requests, new_tokens=args.new_tokens,
                    chunk=args.chunk, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
