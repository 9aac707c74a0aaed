"""Runnable alone: `python benchmarks/bench_parallel.py [--quick]` (same as `graphrt bench parallel`)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

from graphrt.bench.parallel import main  # noqa: E402

if __name__ == "__main__":
    main()
