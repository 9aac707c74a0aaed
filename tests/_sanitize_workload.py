"""A GPU workload for CUDA's compute-sanitizer (run by tests/test_sanitizer.py; see
docs/sanitizer.md): every kernel variant on valid steps, on hand-built metadata holding
arbitrary values, and a captured runtime replaying steps.

    python tests/_sanitize_workload.py kernels   # launchers only (run with PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    python tests/_sanitize_workload.py kernels-small   # the bf16 variants only (for racecheck)
    python tests/_sanitize_workload.py kernels --part I/N   # the I-th of N shares of the launches: N
        # processes side by side compile every variant into Triton's disk cache in a fraction of
        # the time, before the sanitized run (h200_checks.sh sanitizer-each)
    python tests/_sanitize_workload.py runtime   # capture + replay (graphs need the caching allocator)

Exits 0 after printing what it ran; the sanitizer's own summary says whether any access
went wrong.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _cases import Seq, build_meta  # noqa: E402
from graphrt import Runtime, RuntimeConfig, SeqStep, Step  # noqa: E402
from graphrt.kernels import AttentionMetadata, paged_attention, split_workspace, write_kv  # noqa: E402
from graphrt.toy import ToyModel  # noqa: E402


def kernels(small: bool = False, part: tuple[int, int] = (0, 1)) -> int:
    """Each variant once (small: the bf16 ones a model runs), then 24 launches on metadata
    holding arbitrary values. ``part`` (I, N): only the jobs (a dtype's options, the fp8
    cache, the arbitrary metadata, the linear and the sampling launches) numbered I mod N."""
    jobs = iter(range(1 << 30))

    def mine() -> bool:         # the next job is this part's
        return next(jobs) % part[1] == part[0]
    rng = np.random.default_rng(0)
    dev = torch.device("cuda")
    launches = 0
    seqs = [Seq(1, 70, ((3, 40),)), Seq(40, 8, ((2, 30),)), Seq(17, 15), Seq(1, 0), Seq(130, 0, ((10, 60),))]
    total = sum(s.q_len for s in seqs)
    variants = [(torch.bfloat16, 128, (4, 1))] if small else [
        (torch.bfloat16, 128, (4, 1)), (torch.bfloat16, 256, (2, 1)), (torch.float16, 80, (6, 2)),
        (torch.float32, 64, (8, 2))]
    options = ([dict(), dict(window=9, window_rule="ranges_unclipped", softcap=30.0)] if small else
               [dict(), dict(window=24, window_rule="two_sided"), dict(window=9, window_rule="ranges_unclipped",
                                                                       softcap=30.0), dict(ranges=False)])
    for dtype, head_dim, heads in variants:
        meta, _ = build_meta(seqs, block_size=16, num_blocks=40, max_ranges=2, rng=rng, device=dev, num_seqs=7,
                             num_tokens=total + 5)
        hq, hkv = heads
        kc = torch.randn(40, 16, hkv, head_dim, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        q = torch.randn(total + 5, hq, head_dim, device=dev, dtype=dtype)
        k = torch.randn(total + 5, hkv, head_dim, device=dev, dtype=dtype)
        out = torch.empty_like(q)
        write_kv(k, k, kc, vc, meta)
        launches += 1
        for opts in options:
            if not mine():
                continue
            for splits, mql in ((1, None), (3, None), (4, 1)):
                if mql == 1:          # a decode-only launch: one token per sequence
                    dmeta, _ = build_meta([Seq(1, 100), Seq(1, 5), Seq(1, 300)], block_size=16, num_blocks=40,
                                          rng=rng, max_ranges=2, device=dev, num_seqs=4, num_tokens=4)
                    paged_attention(q[:4], kc, vc, out[:4], dmeta, num_splits=splits, max_query_len=1, **opts)
                    if not opts:      # and writing the new K/V itself
                        paged_attention(q[:4], kc, vc, out[:4], dmeta, num_splits=splits, max_query_len=1,
                                        new_kv=(k[:4], k[:4]))
                        # and rotating q and k as it loads them (the rotary pass's launch)
                        cs = torch.randn(4, head_dim, device=dev, dtype=dtype)
                        paged_attention(q[:4], kc, vc, out[:4], dmeta, num_splits=splits, max_query_len=1,
                                        new_kv=(k[:4], k[:4]), rope=(cs, cs))
                        launches += 2
                else:
                    paged_attention(q, kc, vc, out, meta, num_splits=splits, **opts)
                    # and given the new K/V: written in the launch, new keys read from k (descriptors)
                    paged_attention(q, kc, vc, out, meta, num_splits=splits, new_kv=(k, k), **opts)
                    launches += 1
                launches += 1
    if mine():
        launches += fp8_cache(rng, seqs, total)
    if mine():
        launches += arbitrary_metadata(rng)
    if mine():
        launches += linear(small)
    if mine():
        launches += sampling_and_placement(small)
    torch.cuda.synchronize()
    return launches


def fp8_cache(rng, seqs, total: int) -> int:
    """An fp8 cache: quantizing write, dequantizing attention (bf16 queries)."""
    dev = torch.device("cuda")
    meta, _ = build_meta(seqs, block_size=16, num_blocks=40, max_ranges=2, rng=rng, device=dev, num_seqs=7,
                         num_tokens=total + 5)
    kc = torch.zeros(40, 16, 2, 128, device=dev, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    scale = torch.full((2,), 0.01, device=dev)
    q = torch.randn(total + 5, 8, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(total + 5, 2, 128, device=dev, dtype=torch.bfloat16)
    write_kv(k, k, kc, vc, meta, k_scale=scale, v_scale=scale)
    for splits in (1, 3):
        paged_attention(q, kc, vc, torch.empty_like(q), meta, num_splits=splits, k_scale=scale, v_scale=scale)
        paged_attention(q, kc, vc, torch.empty_like(q), meta, num_splits=splits, k_scale=scale, v_scale=scale,
                        new_kv=(k, k))
    dmeta, _ = build_meta([Seq(1, 100), Seq(1, 5), Seq(1, 300)], block_size=16, num_blocks=40, rng=rng, max_ranges=2,
                          device=dev, num_seqs=4, num_tokens=4)
    paged_attention(q[:4], kc, vc, torch.empty_like(q[:4]), dmeta, num_splits=4, max_query_len=1, k_scale=scale,
                    v_scale=scale, new_kv=(k[:4], k[:4]))
    return 6


def arbitrary_metadata(rng) -> int:
    """Metadata holding arbitrary values: the kernels must stay inside their tensors."""
    dev = torch.device("cuda")
    launches = 0
    for trial in range(24):
        s, t, w, r = (int(rng.integers(1, 5)), int(rng.integers(1, 40)), int(rng.integers(1, 6)),
                      int(rng.integers(0, 3)))
        wild = lambda *shape: torch.from_numpy(rng.choice(  # noqa: E731
            [rng.integers(-2 ** 31, 2 ** 31 - 1), rng.integers(-50, 200), -1, 0, 16, 2 ** 31 - 1, -2 ** 31],
            size=shape).astype(np.int64))
        meta = AttentionMetadata(
            query_start_loc=wild(s + 1).int().to(dev), seq_lens=wild(s).int().to(dev),
            block_table=wild(s, w).int().to(dev), prefix_ranges=wild(s, r, 2).int().contiguous().to(dev),
            slot_mapping=torch.from_numpy(rng.integers(-5, 700, size=t)).to(dev))
        kc = torch.randn(40, 16, 2, 64, device=dev, dtype=torch.bfloat16)
        q = torch.randn(t, 8, 64, device=dev, dtype=torch.bfloat16)
        k = torch.randn(t, 2, 64, device=dev, dtype=torch.bfloat16)
        write_kv(k, k, kc, kc.clone(), meta)
        splits = int(rng.choice([1, 2, 8]))
        paged_attention(q, kc, kc.clone(), torch.empty_like(q), meta, num_splits=splits,
                        workspace=split_workspace(t, 8, 64, splits, dev) if splits > 1 else None,
                        window=int(rng.choice([5, 2 ** 40])) if trial % 2 else None,
                        window_rule=str(rng.choice(["clip", "two_sided", "ranges_unclipped"])))
        launches += 2
        if trial % 3 == 0:        # a launch writing the new K/V itself (decode, or reading them from k)
            paged_attention(q, kc, kc.clone(), torch.empty_like(q), meta, num_splits=splits,
                            workspace=split_workspace(t, 8, 64, splits, dev) if splits > 1 else None,
                            max_query_len=1 if trial % 2 else None, new_kv=(k, k),
                            rope=(torch.randn(t, 32, device=dev, dtype=torch.bfloat16),) * 2 if trial % 4 else None)
            launches += 1
    return launches


def sampling_and_placement(small: bool = False) -> int:
    """sample (every pass: greedy, temperature, top-k, top-p, min-p; odd vocabularies, a
    row stride past the vocabulary), kept_lowest (the same passes without the draw) and
    place_tokens on valid and arbitrary metadata."""
    from graphrt.kernels.sampling import kept_lowest, sample
    from graphrt.kernels.speculative import place_tokens

    dev = torch.device("cuda")
    rng = np.random.default_rng(5)
    launches = 0
    for vocab in (1, 37, 3000) if not small else (3000,):
        logits = torch.randn(5, vocab + 3, device=dev, dtype=torch.bfloat16)[:, :vocab]
        f32 = lambda *v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
        sample(logits, f32(0, 1, 0.7, 1.3, 2), torch.tensor([0, 0, 5, 0, vocab], dtype=torch.int32, device=dev),
               f32(1, 1, 1, 0.5, 0.9), f32(0, 0, 0, 0.1, 0), torch.arange(5, device=dev), torch.arange(5, device=dev),
               lowest=torch.empty(5, device=dev))
        kept_lowest(logits, f32(0, 1, 0.7, 1.3, 2), torch.tensor([0, 0, 5, 0, vocab], dtype=torch.int32, device=dev),
                    f32(1, 1, 1, 0.5, 0.9), f32(0, 0, 0, 0.1, 0))
        launches += 2
    wild = [-2 ** 31, -5, -1, 0, 3, 40, 2 ** 31 - 1]
    for _ in range(4 if small else 16):
        s, t = int(rng.integers(1, 5)), int(rng.integers(1, 20))
        i32 = lambda *shape: torch.from_numpy(rng.choice(wild, size=shape).astype(np.int32)).to(dev)  # noqa: E731
        qsl = torch.from_numpy(np.sort(rng.choice(wild + list(range(25)), size=s + 1)).astype(np.int32)).to(dev)
        place_tokens(i32(s), i32(s), i32(int(rng.integers(1, 4))), query_start_loc=qsl, seq_lens=i32(s),
                     positions=torch.zeros(t, dtype=torch.int64, device=dev),
                     slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev), block_table=i32(s, 3), block_size=4)
        launches += 1
    return launches


def linear(small: bool = False) -> int:
    """small_linear (the compiled step's matmuls of few rows): one row (elementwise) and
    17 / 33 / 64 rows (``tl.dot``), one to three weights of odd sizes, with and without
    biases, x a strided view; small: the bf16 shapes of a decode step."""
    from graphrt.kernels import LinearConfig, small_linear

    dev = torch.device("cuda")
    dtypes = (torch.bfloat16,) if small else (torch.bfloat16, torch.float16, torch.float32)
    launches = 0
    for dtype in dtypes:
        for m in (1, 17) if small else (1, 2, 17, 33, 64):
            for k, ns in ((200, (37,)), (264, (100, 24, 24)), (512, (300, 77))):
                base = torch.randn(m, k + 8, device=dev, dtype=dtype)
                x = base[:, 3:3 + k]                          # rows of stride k + 8
                ws = [torch.randn(n, k, device=dev, dtype=dtype) for n in ns]
                bs = [torch.randn(n, device=dev, dtype=dtype) for n in ns]
                small_linear(x, ws)
                small_linear(x, ws, bs)
                launches += 2
                if m > 1 and not small:                       # a tile wider than every output
                    small_linear(x, ws, config=LinearConfig(block_n=64, block_k=64, num_stages=2))
                    launches += 1
    return launches


def read_new() -> int:
    """Prefill launches given the new K/V (read through tensor descriptors), valid and
    hand-built metadata: a short run for a first look."""
    rng = np.random.default_rng(2)
    dev = torch.device("cuda")
    seqs = [Seq(1, 70, ((3, 40),)), Seq(40, 8, ((2, 30),)), Seq(130, 0, ((10, 60),))]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=40, max_ranges=2, rng=rng, device=dev, num_seqs=4,
                         num_tokens=total + 5)
    kc = torch.randn(40, 16, 1, 128, device=dev, dtype=torch.bfloat16)
    q = torch.randn(total + 5, 4, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(total + 5, 1, 128, device=dev, dtype=torch.bfloat16)
    for splits in (1, 3):
        paged_attention(q, kc, kc.clone(), torch.empty_like(q), meta, num_splits=splits, new_kv=(k, k))
    for trial in range(4):
        s, t, w = int(rng.integers(1, 5)), int(rng.integers(1, 40)), int(rng.integers(1, 6))
        wild = lambda *shape: torch.from_numpy(rng.choice(  # noqa: E731
            [rng.integers(-2 ** 31, 2 ** 31 - 1), rng.integers(-50, 200), -1, 0, 16, 2 ** 31 - 1, -2 ** 31],
            size=shape).astype(np.int64))
        meta = AttentionMetadata(
            query_start_loc=wild(s + 1).int().to(dev), seq_lens=wild(s).int().to(dev),
            block_table=wild(s, w).int().to(dev), prefix_ranges=wild(s, 1, 2).int().contiguous().to(dev),
            slot_mapping=torch.from_numpy(rng.integers(-5, 700, size=t)).to(dev))
        qq = torch.randn(t, 4, 128, device=dev, dtype=torch.bfloat16)
        kk = torch.randn(t, 1, 128, device=dev, dtype=torch.bfloat16)
        paged_attention(qq, kc, kc.clone(), torch.empty_like(qq), meta, new_kv=(kk, kk))
    torch.cuda.synchronize()
    return 6


def runtime() -> int:
    cfg = RuntimeConfig(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=256, max_num_seqs=8,
                        max_num_tokens=128, max_model_len=512, max_prefix_ranges=2, dtype=torch.bfloat16)
    model = ToyModel(cfg, num_layers=2, hidden=128, vocab=64, device="cuda")
    rt = Runtime(cfg, model, num_layers=2, strict=True)
    rt.capture(decode_buckets=[1, 4, 8], mixed_buckets=[32, 128], quiet=True)
    rng = np.random.default_rng(1)
    free = iter(rng.permutation(cfg.num_blocks).tolist())
    blocks = [[next(free) for _ in range(12)] for _ in range(8)]
    steps = 0
    for i in range(12):
        n = int(rng.integers(1, 9))
        q_len = 1 if i % 2 else int(rng.integers(1, 16))
        contexts = rng.integers(0, 150, n).tolist()
        step = Step([SeqStep(q_len=q_len, context_len=c, block_ids=blocks[j], prefix_ranges=[(0, 3)] if c >= 3 else [])
                     for j, c in enumerate(contexts)])
        rt.step(step, rng.integers(0, 64, step.num_tokens))
        steps += rt.last.mode == "replay"
    torch.cuda.synchronize()
    return steps


if __name__ == "__main__":
    what = sys.argv[1]
    share = tuple(int(x) for x in sys.argv[3].split("/")) if sys.argv[2:3] == ["--part"] else (0, 1)
    ran = (runtime() if what == "runtime" else read_new() if what == "read-new"
           else kernels(small=what == "kernels-small", part=share))
    print(f"graphrt sanitize workload {what}: {ran} {'replayed steps' if what == 'runtime' else 'launches'}")
