"""Which head_dims the attention kernel compiles and computes correctly for, on this GPU:
the evidence behind ``MIN_HEAD_DIM`` / ``MAX_HEAD_DIM`` (kernels/_checks.py). The
launcher's head_dim check is switched off here so that the kernel itself is tried.

    python benchmarks/probes/probe_head_dims.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import graphrt.kernels.paged_attention as pa
from graphrt.kernels import reference
from graphrt.step import SeqStep, Step, build_metadata
from graphrt.config import RuntimeConfig


def probe(head_dim: int, dtype: torch.dtype, mode: str) -> dict:
    cfg = RuntimeConfig(num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64, max_num_seqs=4,
                        max_num_tokens=9000, max_model_len=1024, dtype=dtype)        # head_dim only sizes nothing here
    rng = np.random.default_rng(0)
    blocks = iter(rng.permutation(64).tolist())
    shape = [(1, 200), (1, 37), (1, 5)] if mode == "decode" else [(70, 30), (1, 100), (20, 0)]
    step = Step([SeqStep(q_len=q, context_len=c, block_ids=[next(blocks) for _ in range(-(-(q + c) // 16))])
                 for q, c in shape])
    num_tokens = 8192 if mode == "large" else step.num_tokens
    meta, _ = build_metadata(step, cfg, "cuda", num_tokens=num_tokens)
    kc = torch.randn(64, 16, 2, head_dim, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(num_tokens, 8, head_dim, device="cuda", dtype=dtype)
    out = torch.zeros_like(q)
    row = dict(head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), mode=mode)
    try:
        pa.paged_attention(q, kc, vc, out, meta, max_query_len=1 if mode == "decode" else None, num_splits=1)
        torch.cuda.synchronize()
    except Exception as exc:          # noqa: BLE001 (the probe records any failure)
        return {**row, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    ref = reference.paged_attention(q, kc, vc, meta)
    err = float((out[: step.num_tokens].double().cpu() - ref.cpu()).abs().max())
    return {**row, "ok": err < 5e-2, "max_abs_err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    pa.check_head_dim = lambda *a, **k: None
    rows = []
    for head_dim in (8, 9, 12, 16, 256, 272, 320, 512):
        for dtype in (torch.bfloat16, torch.float32):
            for mode in ("decode", "mixed", "large"):
                rows.append(probe(head_dim, dtype, mode))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
