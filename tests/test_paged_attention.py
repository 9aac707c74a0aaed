"""graphrt.kernels.paged_attention against the float64 reference, on fresh random data.

Every case pads the launch past the step (2 extra sequences, 5 extra tokens), poisons the
output with NaN, and checks that every valid element was written and no padded row was.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import pytest
import torch

from _cases import DTYPES, TOL, Seq, assert_close, build_meta, fresh_seed, random_seqs, rngs
from graphrt.kernels import (AttentionMetadata, KernelConfig, default_config, paged_attention, reference,
                             split_workspace, write_kv)

S = Seq
RANGE_EDGES = (
    S(64, 0, ((0, 10), (14, 20), (30, 50), (60, 64))),   # at start, across a block, across q tiles, at the end
    S(1, 90, ((0, 16), (85, 91))),                        # a decode token inside a range
    S(30, 34, ((20, 64),)),                               # range begins in the cached context
    S(40, 60, ((50, 90),)),                               # range across a key tile (64), wider than a window
    S(100, 0, ((10, 90), (95, 100))),                     # early queries see key tiles past their causal span
)

FULL_TILES = (S(30, 100, ((90, 140),)), S(1, 150), S(45, 0, ((5, 20),)), S(3, 77, ((70, 79),)))


@dataclass(frozen=True)
class Case:
    id: str
    seqs: tuple | None = None          # None: random sequences
    heads: tuple[int, int] = (8, 2)    # (query heads, kv heads)
    head_dim: int = 64
    block_size: int = 16
    max_ranges: int = 4
    window: int | None = None
    window_rule: str = "clip"
    ranges: bool = True                # False: this call ignores the prefix ranges
    softcap: float | None = None
    q_scale: float = 1.0               # larger logits, to push the soft-cap into saturation
    splits: int = 1
    column_major: bool = False         # block table stored [blocks, seqs], as the runtime's arena holds it
    config: KernelConfig | None = None # tile shape (None: the launcher's default)
    max_query_len: int | None = None   # 1: a decode launch (its tile, programs mapped to sequences directly)


CASES = [
    Case("decode-block-edges", (S(1, 0), S(1, 15), S(1, 16), S(1, 17), S(1, 47))),
    Case("decode-launch", (S(1, 0), S(1, 15), S(1, 16), S(1, 130, ((3, 100),)), S(1, 47)), max_query_len=1),
    Case("decode-launch-split", (S(1, 200, ((3, 100),)), S(1, 5), S(1, 130), S(1, 0)), splits=3, max_query_len=1),
    # a decode launch given longer query runs (hand-built metadata): each sequence's
    # further tiles come from the programs past max_num_seqs
    Case("decode-launch-longer-queries", (S(1, 20), S(9, 3, ((0, 5),)), S(0, 4), S(17, 30), S(1, 0), S(6, 0),
                                          S(4, 9)), max_query_len=1, splits=2),
    Case("random-decode-launch", window=33, max_query_len=1),
    Case("prefill-odd-mha", (S(17, 0), S(63, 0), S(1, 33)), heads=(2, 2)),
    Case("mixed-mqa", (S(1, 70), S(40, 8), S(1, 0), S(17, 15)), heads=(8, 1)),
    Case("column-major-block-table", (S(1, 70, ((3, 40),)), S(40, 8), S(17, 15)), column_major=True, splits=2),
    Case("zero-q-len-inside", (S(5, 3), S(0, 9), S(1, 20), S(0, 0), S(33, 0))),
    Case("qpk-3", (S(20, 11, ((2, 9),)), S(1, 40)), heads=(6, 2)),
    Case("ranges-edges", RANGE_EDGES),
    Case("ranges-window-clip", RANGE_EDGES, window=8),
    Case("ranges-window-two-sided", RANGE_EDGES, window=8, window_rule="two_sided"),
    Case("ranges-window-unclipped", RANGE_EDGES, window=8, window_rule="ranges_unclipped"),
    Case("ranges-window-alias-gemma3", RANGE_EDGES, window=8, window_rule="gemma3"),
    Case("ranges-off", RANGE_EDGES, ranges=False),
    Case("ranges-off-window", RANGE_EDGES, window=8, ranges=False, window_rule="ranges_unclipped"),
    Case("huge-window", RANGE_EDGES, window=2 ** 63, window_rule="two_sided"),
    Case("window-no-ranges", (S(40, 30), S(1, 100)), window=16),
    Case("softcap", RANGE_EDGES, softcap=2.0, q_scale=4.0),
    Case("softcap-huge-cap", RANGE_EDGES, softcap=1e4, q_scale=4.0),   # logit / cap ~ 1e-4: no cancellation
    Case("softcap-tiny-cap", RANGE_EDGES, softcap=0.05, q_scale=4.0),  # saturated everywhere
    Case("softcap-largest-cap", RANGE_EDGES, softcap=1e6, q_scale=4.0),   # the same as no cap
    Case("no-range-slots", (S(20, 5), S(1, 40)), max_ranges=0),
    Case("block-size-32", (S(33, 31, ((40, 64),)), S(1, 64)), block_size=32),
    # key tiles that do not hold whole blocks (a block's token offsets then follow the tile)
    Case("block-size-32-key-tile-16", (S(33, 31, ((40, 64),)), S(1, 64), S(1, 100)), block_size=32,
         config=KernelConfig(block_q=4, block_n=16)),
    Case("block-size-24", (S(33, 31, ((40, 64),)), S(1, 64), S(1, 100)), block_size=24, splits=2),
    Case("head-dim-128", (S(17, 20, ((5, 30),)), S(1, 33)), heads=(4, 1), head_dim=128),
    Case("head-dim-256", (S(9, 20, ((5, 25),)), S(1, 33)), heads=(2, 1), head_dim=256),
    Case("head-dim-80", (S(17, 3), S(1, 40, ((10, 30),))), head_dim=80),
    Case("split-decode", (S(1, 200, ((3, 100),)), S(1, 5), S(1, 130), S(2, 63, ((60, 65),))), splits=4),
    Case("split-mixed-window-softcap", (S(1, 150), S(24, 40, ((30, 60),))), splits=3, window=32, softcap=5.0),
    Case("split-clip-ranges", (S(1, 90, ((10, 80),)), S(17, 17, ((0, 34),))), splits=2, window=12),
    Case("split-two-sided-ranges", (S(1, 90, ((10, 80),)), S(17, 17, ((0, 34),))), splits=2, window=12,
         window_rule="two_sided"),
    # the merge as a second launch (KernelConfig.fuse_merge=False)
    Case("split-decode-merge-launch", (S(1, 200, ((3, 100),)), S(1, 5), S(1, 130), S(1, 0)), splits=5,
         max_query_len=1, config=KernelConfig(block_q=4, block_n=32, fuse_merge=False)),
    Case("split-mixed-merge-launch", (S(1, 150), S(24, 40, ((30, 60),))), splits=3, window=32,
         config=KernelConfig(block_q=8, block_n=16, short_block_n=32, fuse_merge=False)),
    # the fused merge past the default's split limit: several rounds of loads, the last partial
    Case("split-decode-fused-9", (S(1, 300, ((3, 100),)), S(1, 5), S(1, 130), S(1, 0)), splits=9,
         max_query_len=1, config=KernelConfig(block_q=4, block_n=16, fuse_merge=True)),
    # two levels of in-place merge: groups of 4 splits, then the groups (a last group of 1)
    Case("split-decode-fused-two-levels", (S(1, 600, ((3, 100),)), S(1, 5), S(1, 130), S(1, 0), S(1, 64)), splits=37,
         max_query_len=1, config=KernelConfig(block_q=4, block_n=16, fuse_merge=True)),
    Case("split-mixed-fused-two-levels", (S(1, 400), S(24, 200, ((30, 60),))), splits=13, window=150,
         config=KernelConfig(block_q=8, block_n=16, short_block_n=32, fuse_merge=True)),
    # a register cap (ignored by the interpreter; on the GPU the compiler meets it, spilling if need be)
    Case("split-decode-register-cap", (S(1, 300, ((3, 100),)), S(1, 5), S(1, 130), S(1, 0)), splits=8,
         max_query_len=1, config=KernelConfig(block_q=4, block_n=64, maxnreg=128)),
    # Small key tiles so that a window leaves tiles every row sees in full (the unmasked
    # path) between masked ones; large tiles as the GPU's prefill table uses.
    Case("full-tiles-window-unclipped", FULL_TILES, window=43, window_rule="ranges_unclipped",
         config=KernelConfig(block_q=4, block_n=16)),
    Case("full-tiles-window-two-sided", FULL_TILES, window=21, window_rule="two_sided",
         config=KernelConfig(block_q=4, block_n=16)),
    Case("full-tiles-window-clip-split", FULL_TILES, window=43, splits=3,
         config=KernelConfig(block_q=4, block_n=16)),
    Case("full-tiles-softcap-split", FULL_TILES, softcap=3.0, q_scale=3.0, splits=2,
         config=KernelConfig(block_q=8, block_n=32)),
    Case("large-tiles", (S(130, 0, ((10, 60),)), S(1, 200), S(70, 90, ((100, 150),))),
         config=KernelConfig(block_q=64, block_n=64, short_block_n=128)),
    Case("random-small-tiles-window", window=29, config=KernelConfig(block_q=4, block_n=16)),
    Case("random"),
    Case("random-window", window=24),
    Case("random-clip-split", window=40, splits=4, column_major=True),
    Case("random-two-sided", window=20, window_rule="two_sided"),
]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (NaN too, which torch.equal counts as unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_case(case: Case, dtype: torch.dtype, device: torch.device, new_kv: bool = False) -> None:
    """``case`` against the float64 reference; with ``new_kv`` the launch is given the new
    tokens' K/V to write into the caches (byte for byte as the reference write) and to
    attend over (decode launches read them back, others from k/v directly)."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = list(case.seqs) if case.seqs else random_seqs(rng, int(rng.integers(1, 6)), max_q=40, max_ctx=150,
                                                         max_ranges=case.max_ranges)
    total = sum(s.q_len for s in seqs)
    num_blocks = sum(-(-s.seq_len // case.block_size) for s in seqs) + 8
    meta, blocks_of = build_meta(seqs, block_size=case.block_size, num_blocks=num_blocks,
                                 max_ranges=case.max_ranges, rng=rng, device=device, num_seqs=len(seqs) + 2,
                                 num_tokens=total + 5)
    if case.column_major:
        meta = dataclasses.replace(meta, block_table=meta.block_table.t().contiguous().t())
    hq, hkv = case.heads
    cache_shape = (num_blocks, case.block_size, hkv, case.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    # slots no sequence holds (as a cache from torch.empty has them): must reach no output
    bs = case.block_size
    held = [blocks[p // bs] * bs + p % bs for sq, blocks in zip(seqs, blocks_of) for p in range(sq.seq_len)]
    unused = torch.ones(num_blocks * bs, dtype=torch.bool)
    unused[held] = False
    for c in (k_cache, v_cache):
        c.view(-1, hkv, case.head_dim)[unused.to(device)] = float("nan")
    q = (case.q_scale * torch.randn(total + 5, hq, case.head_dim, generator=gen)).to(device=device, dtype=dtype)
    q[total:] = float("nan")         # rows of no token
    out = torch.full_like(q, float("nan"))
    opts = dict(window=case.window, window_rule=case.window_rule, ranges=case.ranges, softcap=case.softcap)
    k_ref, v_ref = k_cache, v_cache
    if new_kv:
        new = tuple(torch.randn(total + 5, hkv, case.head_dim, generator=gen).to(device=device, dtype=dtype)
                    for _ in range(2))
        for t in new:        # rows of no token (as torch.empty leaves them): must reach no output
            t[total:] = float("nan")
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        reference.write_kv(*new, k_ref, v_ref, meta.slot_mapping)
        opts_new = dict(new_kv=new)
    else:
        opts_new = {}

    paged_attention(q, k_cache, v_cache, out, meta, num_splits=case.splits, config=case.config,
                    max_query_len=case.max_query_len, **opts, **opts_new)

    if new_kv:
        assert same_bytes(k_cache, k_ref) and same_bytes(v_cache, v_ref), f"cache write differs (seed={seed})"
    ref = reference.paged_attention(q, k_ref, v_ref, meta, **opts)
    assert_close(f"out[{case.id}]", out[:total], ref, *TOL[dtype], seed)
    assert torch.isnan(out[total:]).all(), f"padded rows of out were written (seed={seed})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_attention(case, dtype, device):
    run_case(case, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_launch_writes_new_kv(case, dtype, device):
    """Every case with ``new_kv``: the launch writes the new K/V and attends over them
    (prefill and mixed launches read the new keys from k/v through tensor descriptors)."""
    run_case(case, dtype, device, new_kv=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_new_kv_heads_stay_apart(dtype, splits, device):
    """A head dim below a power of two (80, loaded as 128 columns): K/V read from k/v in bulk
    copies span into the next head's columns; whatever those hold (inf here) must not
    reach this head's output."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [S(1, 37), S(23, 0, ((3, 12),)), S(40, 9)]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=12, max_ranges=1, rng=rng, device=device, num_seqs=4,
                         num_tokens=total + 3)
    k_cache, v_cache = (torch.randn(12, 16, 2, 80, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    k_new, v_new = (torch.randn(total + 3, 2, 80, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    k_new[:, 1] = float("inf")
    v_new[:, 1] = float("inf")
    q = torch.randn(total + 3, 4, 80, generator=gen).to(device=device, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out, meta, num_splits=splits, new_kv=(k_new, v_new))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), f"cache write differs (seed={seed})"
    ref = reference.paged_attention(q, k_ref, v_ref, meta)
    # query heads 0 and 1 read KV head 0, whose bulk copies take 48 columns of head 1
    assert_close("out[KV head 0]", out[:total, :2], ref[:, :2], *TOL[dtype], seed)


OFFSET_CASES = ("decode-launch-split", "block-size-24", "large-tiles", "full-tiles-window-clip-split", "random")


@pytest.mark.parametrize("case", [c for c in CASES if c.id in OFFSET_CASES], ids=lambda c: c.id)
def test_paged_attention_64_bit_offsets(case, device, monkeypatch):
    """Caches with an element past 2**31 take 64-bit offsets in the kernel (KV_OFF32 off).
    Such caches are too large to make here, so the launch is told they are."""
    monkeypatch.setattr(importlib.import_module("graphrt.kernels.paged_attention"), "_offsets_fit_32",
                        lambda cache: False)
    run_case(case, torch.float16, device)


def test_offsets_fit_32():
    """The check that picks 32-bit offsets reads shapes and strides only (meta tensors:
    nothing is allocated), padded head dims included."""
    fit = importlib.import_module("graphrt.kernels.paged_attention")._offsets_fit_32
    room = 2 ** 31 - 256                     # MAX_HEAD_DIM of room for a padded head dim
    assert fit(torch.empty(room // 2048, 16, 1, 128, device="meta"))
    assert not fit(torch.empty(room // 2048 + 1, 16, 1, 128, device="meta"))
    assert fit(torch.empty(1, 1, 1, room, device="meta"))
    assert not fit(torch.empty(1, 1, 1, room + 1, device="meta"))
    # strides, not sizes: one block of a cache strided as a far larger one
    big = torch.empty(2, 16, 8, 128, device="meta").as_strided((2, 16, 8, 128), (2 ** 31, 1024, 128, 1))
    assert not fit(big)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_attend(dtype, device):
    """The layer's real order: write the new tokens' K/V, then attend over the cache."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [S(1, 37, ((0, 20),)), S(23, 0, ((3, 12),)), S(5, 16)]
    total = sum(s.q_len for s in seqs)
    num_blocks = 12
    meta, _ = build_meta(seqs, block_size=16, num_blocks=num_blocks, max_ranges=2, rng=rng, device=device,
                         num_seqs=4, num_tokens=total + 3)
    k_cache = torch.randn(num_blocks, 16, 2, 64, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, 16, 2, 64, generator=gen).to(device=device, dtype=dtype)
    k_new = torch.randn(total + 3, 2, 64, generator=gen).to(device=device, dtype=dtype)
    v_new = torch.randn(total + 3, 2, 64, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(total + 3, 8, 64, generator=gen).to(device=device, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping)

    write_kv(k_new, v_new, k_cache, v_cache, meta)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out, meta)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), f"cache write differs (seed={seed})"
    assert_close("out", out[:total], reference.paged_attention(q, k_ref, v_ref, meta), *TOL[dtype], seed)


# (sequences, splits, config): decodes at block edges and across many key tiles; longer
# query runs in a decode launch (hand-built metadata, tiles of 4 tokens: later tiles read
# new keys that earlier tiles' programs write too); the merge in place and as a launch
WRITE_CASES = [
    ((S(1, 0), S(1, 15), S(1, 16), S(1, 130, ((3, 100),)), S(1, 47)), 1, None),
    ((S(1, 200, ((3, 100),)), S(1, 5), S(1, 130), S(1, 0)), 3, None),
    ((S(1, 300), S(1, 5), S(1, 64)), 9, KernelConfig(block_q=4, block_n=16, fuse_merge=True)),
    ((S(1, 300), S(1, 31)), 5, KernelConfig(block_q=4, block_n=32, fuse_merge=False)),
    ((S(1, 20), S(9, 3, ((0, 5),)), S(0, 4), S(17, 30), S(6, 0)), 2, KernelConfig(block_q=4, block_n=16)),
    (None, 4, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,splits,config", WRITE_CASES)
def test_decode_launch_writes_new_kv(seqs, splits, config, dtype, device):
    """``new_kv``: a decode launch writes the new K/V into the caches itself (the same bytes
    as ``write_kv``) and attends over them (the float64 reference of write, then attend)."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = list(seqs) if seqs else [S(1, int(c)) for c in rng.integers(0, 400, int(rng.integers(1, 9)))]
    total = sum(s.q_len for s in seqs)
    num_blocks = sum(-(-s.seq_len // 16) for s in seqs) + 4
    meta, _ = build_meta(seqs, block_size=16, num_blocks=num_blocks, max_ranges=2, rng=rng, device=device,
                         num_seqs=len(seqs) + 2, num_tokens=total + 3)
    cache = lambda: torch.randn(num_blocks, 16, 2, 64, generator=gen).to(device=device, dtype=dtype)
    k_cache, v_cache = cache(), cache()
    k_new, v_new, q = (torch.randn(total + 3, h, 64, generator=gen).to(device=device, dtype=dtype)
                       for h in (2, 2, 8))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))

    paged_attention(q, k_cache, v_cache, out, meta, num_splits=splits, config=config, max_query_len=1,
                    new_kv=(k_new, v_new))

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), f"cache write differs (seed={seed})"
    assert_close("out", out[:total], reference.paged_attention(q, k_ref, v_ref, meta), *TOL[dtype], seed)
    assert torch.isnan(out[total:]).all(), f"padded rows of out were written (seed={seed})"


def refill(fixed: dict[str, torch.Tensor], new) -> None:
    """Put ``new`` metadata into the fixed tensors in place (zero-padded), as a runtime's
    buffers are between replays of one launch."""
    for name, t in fixed.items():
        src = getattr(new, name)
        t.zero_()[tuple(slice(0, n) for n in src.shape)].copy_(src)


@pytest.mark.parametrize("fuse_merge", [True, False])
def test_same_launch_serves_changing_steps(fuse_merge, device):
    """One set of launch arguments (as a captured graph would hold) over metadata that
    changes in place between calls, short and long contexts alike, with splits; the fused
    merge's counters are back at zero after each call."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    num_blocks, num_seqs, num_tokens = 40, 4, 24
    k_cache = torch.randn(num_blocks, 16, 1, 64, generator=gen).to(device)
    v_cache = torch.randn(num_blocks, 16, 1, 64, generator=gen).to(device)
    q = torch.randn(num_tokens, 4, 64, generator=gen).to(device)
    steps = [[S(1, 3), S(1, 200, ((10, 90),))], [S(20, 0, ((2, 15),)), S(1, 60)], [S(1, 0), S(1, 1), S(1, 150)]]
    first, _ = build_meta(steps[0], block_size=16, num_blocks=num_blocks, max_ranges=2, rng=rng, device=device,
                          num_seqs=num_seqs, num_tokens=num_tokens)
    fixed = {name: getattr(first, name).clone() for name in first.__dataclass_fields__}
    meta = type(first)(**fixed)
    out = torch.empty_like(q)
    workspace = split_workspace(num_tokens, 4, 64, 3, device, max_num_seqs=num_seqs)
    workspace[0].fill_(float("nan"))   # the merge weighs only the partials of splits that ran
    config = dataclasses.replace(default_config(64, torch.float32, 4, num_tokens=num_tokens), fuse_merge=fuse_merge)
    for seqs in steps:
        new, _ = build_meta(seqs, block_size=16, num_blocks=num_blocks, max_ranges=2, rng=rng, device=device,
                            num_seqs=num_seqs, num_tokens=num_tokens)
        refill(fixed, new)
        out.fill_(float("nan"))
        paged_attention(q, k_cache, v_cache, out, meta, num_splits=3, workspace=workspace, config=config)
        assert int(workspace[2].count_nonzero()) == 0, f"a tile counter was left set (seed={seed})"
        total = sum(s.q_len for s in seqs)
        assert_close(f"out[{len(seqs)} seqs]", out[:total], reference.paged_attention(q, k_cache, v_cache, meta),
                     *TOL[torch.float32], seed)
        assert torch.isnan(out[total:]).all(), f"padded rows were written (seed={seed})"


def test_random_tile_shapes(device):
    """Random tile tables (query tile, key tile, short path, splits) with random windows,
    window rules, ranges on/off and soft-caps over random batches: the masked / full / short split of the
    work must give the reference result for any shape, not only the table's."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    for _ in range(4):
        hq, hkv = [(8, 2), (4, 1), (6, 2), (4, 4)][int(rng.integers(4))]
        qpk_pad = 1 << (hq // hkv - 1).bit_length()
        block_q = max(16 // qpk_pad, 1) * int(rng.choice([1, 2, 4]))
        config = KernelConfig(block_q=block_q, block_n=int(rng.choice([16, 32, 64])),
                              short_block_n=int(rng.choice([16, 32, 64])) if rng.random() < 0.7 else None,
                              fuse_merge=[None, True, False][int(rng.integers(3))])
        opts = dict(window=int(rng.integers(5, 80)) if rng.random() < 0.6 else None,
                    window_rule=str(rng.choice(["clip", "two_sided", "ranges_unclipped"])),
                    ranges=bool(rng.random() < 0.8),
                    softcap=3.0 if rng.random() < 0.3 else None)
        splits = int(rng.choice([1, 1, 2, 3, 6]))
        max_query_len = 1 if rng.random() < 0.3 else None     # the decode launch's program mapping
        seqs = random_seqs(rng, int(rng.integers(1, 5)), max_q=50, max_ctx=150, max_ranges=2)
        total = sum(s.q_len for s in seqs)
        num_blocks = sum(-(-s.seq_len // 16) for s in seqs) + 4
        meta, _ = build_meta(seqs, block_size=16, num_blocks=num_blocks, max_ranges=2, rng=rng, device=device,
                             num_seqs=len(seqs) + 1, num_tokens=total + 3)
        k_cache = torch.randn(num_blocks, 16, hkv, 64, generator=gen).to(device)
        v_cache = torch.randn(num_blocks, 16, hkv, 64, generator=gen).to(device)
        q = torch.randn(total + 3, hq, 64, generator=gen).to(device)
        out = torch.full_like(q, float("nan"))
        paged_attention(q, k_cache, v_cache, out, meta, num_splits=splits, config=config,
                        max_query_len=max_query_len, **opts)
        ref = reference.paged_attention(q, k_cache, v_cache, meta, **opts)
        assert_close(f"out[{config}, splits={splits}, max_query_len={max_query_len}, {opts}]", out[:total], ref, *TOL[torch.float32], seed)
        assert torch.isnan(out[total:]).all(), f"padded rows were written (seed={seed})"


@pytest.mark.gpu
def test_programmatic_dependent_launches_in_a_graph(monkeypatch):
    """With PDL on (GRAPHRT_PDL=1), a captured torch copy -> write_kv -> attention -> merge
    chain waits for each launch's inputs: replays over new queries, keys and metadata give
    the reference result."""
    from graphrt.kernels._checks import pdl_supported

    device = torch.device("cuda")
    monkeypatch.setenv("GRAPHRT_PDL", "1")
    if not pdl_supported(device):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    seed = fresh_seed()
    rng, gen = rngs(seed)
    num_blocks, num_seqs, hq, hkv, d = 300, 3, 8, 2, 64
    k_cache = torch.randn(num_blocks, 16, hkv, d, generator=gen).to(device, torch.float16)
    v_cache = torch.randn(num_blocks, 16, hkv, d, generator=gen).to(device, torch.float16)
    steps = [[S(1, 900), S(1, 5), S(1, 2000, ((100, 400),))], [S(1, 30), S(1, 1500), S(1, 0)]]
    first, _ = build_meta(steps[0], block_size=16, num_blocks=num_blocks, max_ranges=1, rng=rng, device=device,
                          num_seqs=num_seqs, num_tokens=num_seqs)
    fixed = {name: getattr(first, name).clone() for name in first.__dataclass_fields__}
    meta = type(first)(**fixed)
    # finite inputs from the start: the warm-up and capture runs write K/V into the cache too
    q_in, kv_in = (torch.randn(num_seqs, h, d, generator=gen).to(device, torch.float16) for h in (hq, hkv))
    q, kv, out = torch.empty_like(q_in), torch.empty_like(kv_in), torch.empty_like(q_in)
    workspace = split_workspace(num_seqs, hq, d, 16, device)
    config = dataclasses.replace(default_config(d, torch.float16, hq // hkv, max_query_len=1), pdl=True)

    def run():
        q.copy_(q_in)
        kv.copy_(kv_in)
        write_kv(kv, kv, k_cache, v_cache, meta)
        paged_attention(q, k_cache, v_cache, out, meta, num_splits=16, workspace=workspace, max_query_len=1,
                        config=config)

    run()                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seqs in steps:
        new, _ = build_meta(seqs, block_size=16, num_blocks=num_blocks, max_ranges=1, rng=rng, device=device,
                            num_seqs=num_seqs, num_tokens=num_seqs)
        refill(fixed, new)
        q_in.copy_(torch.randn(q_in.shape, generator=gen).to(device, torch.float16))
        kv_in.copy_(torch.randn(kv_in.shape, generator=gen).to(device, torch.float16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        slots = meta.slot_mapping.long()
        assert torch.equal(k_ref.view(-1, hkv, d)[slots], kv_in), f"KV write missed (seed={seed})"
        ref = reference.paged_attention(q_in, k_ref, v_ref, meta)
        assert_close(f"out[{len(seqs)} seqs, pdl]", out, ref, *TOL[torch.float16], seed)


@pytest.mark.gpu
def test_fused_merge_over_many_replays():
    """The split-KV merge done by each tile's last split (a counter per tile, reset by that
    split) on the GPU, where the splits of a tile finish in any order and on any SM: a
    captured decode launch of 48 sequences x 32 splits, replayed over new contexts (from
    idle splits to all 32 busy) and new queries, gives the reference result every time and
    leaves every counter at zero."""
    device = torch.device("cuda")
    seed = fresh_seed()
    rng, gen = rngs(seed)
    num_seqs, hq, hkv, d, splits = 48, 8, 2, 64, 32
    num_blocks = num_seqs * 130 + 8
    k_cache = torch.randn(num_blocks, 16, hkv, d, generator=gen).to(device, torch.float16)
    v_cache = torch.randn(num_blocks, 16, hkv, d, generator=gen).to(device, torch.float16)

    def draw():
        return [S(1, int(rng.integers(0, 2000))) for _ in range(num_seqs)]

    # the first step has the longest context: its block table is the widest
    first, _ = build_meta([S(1, 2047)] + draw()[1:], block_size=16, num_blocks=num_blocks, max_ranges=1, rng=rng,
                          device=device, num_seqs=num_seqs, num_tokens=num_seqs)
    fixed = {name: getattr(first, name).clone() for name in first.__dataclass_fields__}
    meta = type(first)(**fixed)
    q_in = torch.randn(num_seqs, hq, d, generator=gen).to(device, torch.float16)
    q, out = torch.empty_like(q_in), torch.empty_like(q_in)
    workspace = split_workspace(num_seqs, hq, d, splits, device)

    def run():
        q.copy_(q_in)
        paged_attention(q, k_cache, v_cache, out, meta, num_splits=splits, workspace=workspace, max_query_len=1,
                        config=config)

    config = dataclasses.replace(default_config(d, torch.float16, hq // hkv, max_query_len=1), fuse_merge=True)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for i in range(12):
        new, _ = build_meta(draw(), block_size=16, num_blocks=num_blocks, max_ranges=1, rng=rng, device=device,
                            num_seqs=num_seqs, num_tokens=num_seqs)
        refill(fixed, new)
        q_in.copy_(torch.randn(q_in.shape, generator=gen).to(device, torch.float16))
        out.fill_(float("nan"))
        for _ in range(3):                  # back to back: the counters must be reset between launches
            graph.replay()
        torch.cuda.synchronize()
        ref = reference.paged_attention(q_in, k_cache, v_cache, meta)
        assert_close(f"out[replay {i}]", out, ref, *TOL[torch.float16], seed)
        assert int(workspace[2].count_nonzero()) == 0, f"a tile counter was left set (seed={seed})"


# K/V the bulk copies cannot read as rows [T, Hkv * D]: (dtype, head_dim, row width of the
# tensor k and v are sliced from)
NO_BULK_KV = {
    "heads-not-adjacent": (torch.float32, 64, 96),     # a slice of wider rows: stride(1) = 96
    "heads-unaligned-12": (torch.float16, 12, 12),     # 24-byte heads in 48-byte rows
    "heads-unaligned-20": (torch.float16, 20, 20),     # 40-byte heads in 80-byte rows
}


@pytest.mark.parametrize("kind", sorted(NO_BULK_KV))
def test_new_kv_without_bulk_copies(kind, device, monkeypatch):
    """K/V whose heads are not adjacent, or do not start on 16 bytes though the rows do
    (a copy starts at a head), cannot be read through descriptors: the launch writes them
    first (``write_kv``) and reads the cache, with the same cache bytes and output."""
    dtype, head_dim, width = NO_BULK_KV[kind]
    module = importlib.import_module("graphrt.kernels.paged_attention")
    writes, write = [], module.write_kv
    monkeypatch.setattr(module, "write_kv", lambda *a, **kw: (writes.append(1), write(*a, **kw)))
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [S(1, 40, ((2, 30),)), S(30, 0, ((5, 20),)), S(17, 50)]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=12, max_ranges=1, rng=rng, device=device, num_seqs=4,
                         num_tokens=total + 2)
    k_cache, v_cache = (torch.randn(12, 16, 2, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    wide = torch.randn(2, total + 2, 2, width, generator=gen).to(device, dtype)
    k_new, v_new = wide[0, :, :, :head_dim], wide[1, :, :, :head_dim]
    q = torch.randn(total + 2, 8, head_dim, generator=gen).to(device, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))

    paged_attention(q, k_cache, v_cache, out, meta, num_splits=2, new_kv=(k_new, v_new))

    assert writes, "the launch read k/v through descriptors instead of writing them first"
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), f"cache write differs (seed={seed})"
    assert_close("out", out[:total], reference.paged_attention(q, k_ref, v_ref, meta), *TOL[dtype], seed)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_new_kv_from_fused_qkv_rows(head_dim, device, monkeypatch):
    """q, k and v as views of one fused projection's rows ([T, (Hq + 2 Hkv) * D]): k and v
    have adjacent heads in rows wider than theirs, which the bulk copies read as they are
    (no write first); same cache bytes and output as the reference."""
    def no_fallback(*args, **kwargs):
        raise AssertionError("the launch fell back to write_kv first")

    monkeypatch.setattr(importlib.import_module("graphrt.kernels.paged_attention"), "write_kv", no_fallback)
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [S(1, 40, ((2, 30),)), S(30, 0, ((5, 20),)), S(17, 50)]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=12, max_ranges=1, rng=rng, device=device, num_seqs=4,
                         num_tokens=total + 2)
    hq, hkv, d = 4, 2, head_dim
    k_cache, v_cache = (torch.randn(12, 16, hkv, d, generator=gen).to(device) for _ in range(2))
    qkv = torch.randn(total + 2, (hq + 2 * hkv) * d, generator=gen).to(device)
    qkv[total:] = float("nan")                        # rows of no token
    q = qkv[:, :hq * d].view(-1, hq, d)
    k_new = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    v_new = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    assert k_new.stride(0) == (hq + 2 * hkv) * d and k_new.stride(1) == d
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping)
    out = torch.full((total + 2, hq, d), float("nan"), device=device)

    paged_attention(q, k_cache, v_cache, out, meta, num_splits=2, new_kv=(k_new, v_new))

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), f"cache write differs (seed={seed})"
    assert_close("out", out[:total], reference.paged_attention(q, k_ref, v_ref, meta), *TOL[torch.float32], seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launch", ["mixed", "mixed-split", "decode-split"])
def test_non_finite_query_stays_in_its_row(launch, dtype, device):
    """inf and NaN in single query rows (a head of a token) reach only those rows' outputs:
    the other heads of the KV head and the other tokens of the tile match the reference."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    decode = launch.startswith("decode")
    seqs = [S(1, 70), S(1, 9), S(1, 33)] if decode else [S(1, 40, ((2, 30),)), S(30, 0, ((5, 20),)), S(17, 50)]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=16, max_ranges=1, rng=rng, device=device, num_seqs=4,
                         num_tokens=total)
    k_cache, v_cache = (torch.randn(16, 16, 2, 64, generator=gen).to(device, dtype) for _ in range(2))
    q = torch.randn(total, 8, 64, generator=gen).to(device, dtype)
    bad = [(0, 1, 5, float("inf")), (total - 2, 6, 0, float("nan")), (total // 2, 3, 63, -float("inf"))]
    for t, h, d, x in bad:
        q[t, h, d] = x
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out, meta, num_splits=3 if launch.endswith("split") else 1,
                    max_query_len=1 if decode else None)
    ref = reference.paged_attention(q, k_cache, v_cache, meta)
    clean = torch.ones(total, 8, dtype=torch.bool)
    for t, h, _, _ in bad:
        clean[t, h] = False
    assert_close("out (rows without a non-finite value)", out[clean], ref[clean], *TOL[dtype], seed)


@pytest.mark.parametrize("launch", ["plain", "split", "decode-new-kv", "new-kv"])
def test_launch_of_no_token_slots(launch, device):
    """Metadata of 0 token slots (an empty step built by hand): every launch form returns
    and writes nothing."""
    meta = AttentionMetadata(
        query_start_loc=torch.zeros(2, dtype=torch.int32, device=device),
        seq_lens=torch.zeros(1, dtype=torch.int32, device=device),
        block_table=torch.zeros(1, 1, dtype=torch.int32, device=device),
        prefix_ranges=torch.zeros(1, 0, 2, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device))
    k_cache = torch.randn(2, 16, 2, 64, device=device)
    v_cache = torch.randn_like(k_cache)
    before = (k_cache.clone(), v_cache.clone())
    q, k = torch.zeros(0, 4, 64, device=device), torch.zeros(0, 2, 64, device=device)
    opts = {"plain": {}, "split": dict(num_splits=2), "decode-new-kv": dict(max_query_len=1, new_kv=(k, k)),
            "new-kv": dict(new_kv=(k, k))}[launch]
    paged_attention(q, k_cache, v_cache, torch.empty_like(q), meta, **opts)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def rotated64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ([T, H, D]) with its rotary embedding over the first R = cos.shape[1] columns
    (rotate-half form), in float64: the reference of ``rope``."""
    x, cos, sin = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    half = cos.shape[-1] // 2
    rot = x[..., : 2 * half]
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + turned * sin, x[..., 2 * half:]), dim=-1)


ROPE_CASES = {   # launch options, head_dim, rotated columns
    "decode": (dict(max_query_len=1), 64, 64),
    "decode-split": (dict(max_query_len=1, num_splits=3), 64, 64),
    "decode-split-merge-launch": (dict(max_query_len=1, num_splits=5,
                                       config=KernelConfig(block_q=4, block_n=16, fuse_merge=False)), 64, 64),
    "decode-partial": (dict(max_query_len=1), 64, 32),         # phi-style: half the columns rotated
    "decode-head-80": (dict(max_query_len=1, num_splits=2), 80, 80),   # padded to 128 columns
    "mixed": ({}, 64, 64),                                       # rotated first, then the launch
    "mixed-split": (dict(num_splits=2), 64, 16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tables", ["own-dtype", "fp32"])
@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_launch_applies_rope(kind, tables, dtype, device):
    """``rope``: q and the new k given before their rotary embedding, cos/sin rows per
    token: the caches hold the rotated k and the output is attention over rotated q and k
    (the float64 reference rotates, writes, then attends). Padding rows of the tables are
    NaN, which no valid output may see."""
    opts, head_dim, dim = ROPE_CASES[kind]
    seed = fresh_seed()
    rng, gen = rngs(seed)
    decode = opts.get("max_query_len") == 1
    seqs = [S(1, int(c), ((1, 30),) if i == 0 else ()) for i, c in enumerate(rng.integers(0, 200, 4))] if decode \
        else [S(1, 40, ((2, 30),)), S(30, 0, ((5, 20),)), S(17, 50), S(1, 0)]
    total = sum(s.q_len for s in seqs)
    num_blocks = sum(-(-s.seq_len // 16) for s in seqs) + 4
    meta, _ = build_meta(seqs, block_size=16, num_blocks=num_blocks, max_ranges=2, rng=rng, device=device,
                         num_seqs=len(seqs) + 1, num_tokens=total + 3)
    cache = lambda: torch.randn(num_blocks, 16, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    k_cache, v_cache = cache(), cache()
    k_new, v_new, q = (torch.randn(total + 3, h, head_dim, generator=gen).to(device=device, dtype=dtype)
                       for h in (2, 2, 8))
    angle = torch.rand(total + 3, dim // 2, generator=gen, dtype=torch.float64) * 2 * torch.pi
    angle = torch.cat((angle, angle), dim=1)                     # HF's tables repeat the frequencies
    table_dtype = dtype if tables == "own-dtype" else torch.float32
    cos, sin = (f(angle).to(device=device, dtype=table_dtype) for f in (torch.cos, torch.sin))
    cos[total:], sin[total:] = float("nan"), float("nan")
    q_rot, k_rot = rotated64(q, cos, sin), rotated64(k_new, cos, sin)
    k_ref, v_ref = k_cache.double(), v_cache.double()
    reference.write_kv(k_rot, v_new.double(), k_ref, v_ref, meta.slot_mapping)
    q_before, k_before = q.clone(), k_new.clone()
    out = torch.full_like(q, float("nan"))

    paged_attention(q, k_cache, v_cache, out, meta, new_kv=(k_new, v_new), rope=(cos, sin), **opts)

    assert torch.equal(q, q_before) and torch.equal(k_new, k_before), "q or k was rotated in place"
    atol, rtol = TOL[dtype]
    assert_close("k_cache", k_cache, k_ref, atol, rtol, seed)
    assert torch.equal(v_cache, v_ref.to(dtype)), f"v cache differs (seed={seed})"
    assert_close("out", out[:total], reference.paged_attention(q_rot, k_ref, v_ref, meta), atol, rtol, seed)
    assert torch.isnan(out[total:]).all(), f"padded rows of out were written (seed={seed})"


@pytest.mark.parametrize("bad,error,match", [
    (lambda c, s: (c, s, c), TypeError, "rope must be a pair"),
    (lambda c, s: (c, None), TypeError, r"rope\[1\] \(sin\) must be a torch.Tensor"),
    (lambda c, s: (c[:-1], s[:-1]), ValueError, "rope tables have"),
    (lambda c, s: (c[:, :3], s[:, :3]), ValueError, "must be even"),
    (lambda c, s: (c.double(), s.double()), TypeError, r"rope\[0\] \(cos\) must have dtype"),
    (lambda c, s: (c, s[:, :2]), ValueError, r"rope\[1\] \(sin\)"),
    ("no-new-kv", ValueError, "rope needs new_kv"),
])
def test_rope_refused(bad, error, match, device):
    """Bad rotary tables get a clear error before anything is written: the caches and out
    are as they were."""
    seqs = [S(1, 20), S(1, 3)]
    rng, gen = rngs(fresh_seed())
    meta, _ = build_meta(seqs, block_size=16, num_blocks=4, max_ranges=1, rng=rng, device=device)
    k_cache, v_cache = (torch.randn(4, 16, 1, 32, generator=gen).to(device) for _ in range(2))
    q, k, v = (torch.randn(2, h, 32, generator=gen).to(device) for h in (2, 1, 1))
    cos, sin = torch.ones(2, 32, device=device), torch.zeros(2, 32, device=device)
    before = [t.clone() for t in (k_cache, v_cache)]
    out = torch.full_like(q, float("nan"))
    new_kv, rope = (None, (cos, sin)) if bad == "no-new-kv" else ((k, v), bad(cos, sin))
    with pytest.raises(error, match=match):
        paged_attention(q, k_cache, v_cache, out, meta, max_query_len=1, new_kv=new_kv, rope=rope)
    assert all(torch.equal(a, b) for a, b in zip((k_cache, v_cache), before)) and torch.isnan(out).all()
