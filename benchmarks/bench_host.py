"""Runnable alone: `python benchmarks/bench_host.py [--quick]` (same as `graphrt bench host`)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

from graphrt.bench.host import main  # noqa: E402

if __name__ == "__main__":
    main()
