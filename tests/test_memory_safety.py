"""No input makes a kernel touch memory outside its tensors, hang, or silently compute on
the wrong rows.

Host-side checks refuse what they can see (row counts, layers, dtypes, head_dim); the
kernels themselves bound what only the device sees (the metadata's values), so that even
hand-built metadata with arbitrary numbers stays inside ``out``, the caches and the
workspace. Outputs here are views into larger tensors whose guard bands must come back
bit-for-bit unchanged; on the GPU, ``compute-sanitizer`` checks the same tests
(tests/test_sanitizer.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from _cases import TOL, Seq, assert_close, build_meta, examples, fresh_seed, rngs
from graphrt import Runtime, RuntimeConfig, SeqStep, Step
from graphrt.kernels import AttentionMetadata, KernelConfig, default_config, paged_attention, reference, write_kv
from graphrt.kernels.paged_attention import apply_rope

GUARD = 3          # rows (or cache blocks) of guard band on each side
SENTINEL = 7.25    # what the bands hold
POISON = 7         # the cache block that only reads past a block table reach


def banded(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole tensor, its middle ``shape`` view) with GUARD rows of SENTINEL each side."""
    whole = torch.full((shape[0] + 2 * GUARD, *shape[1:]), SENTINEL, dtype=dtype, device=device)
    return whole, whole[GUARD: GUARD + shape[0]]


def assert_bands(name: str, whole: torch.Tensor) -> None:
    bands = torch.cat([whole[:GUARD].flatten(), whole[-GUARD:].flatten()])
    sentinel = torch.full((), SENTINEL, dtype=whole.dtype)        # (7 in an int tensor)
    assert bool((bands == sentinel.to(bands.device)).all()), \
        f"{name}: a write landed outside the tensor (in its guard band)"


def banded_workspace(num_tokens: int, num_q_heads: int, splits: int, head_dim: int, num_seqs: int, device):
    """split_workspace's three tensors as banded views (the counters zero inside their
    bands), and the three whole tensors."""
    po_whole, part_o = banded((num_tokens, num_q_heads, splits, head_dim), torch.float32, device)
    pl_whole, part_lse = banded((num_tokens, num_q_heads, splits), torch.float32, device)
    ct_whole, counters = banded(((num_tokens + num_seqs) * num_q_heads,), torch.int32, device)
    counters.zero_()
    return (po_whole, pl_whole, ct_whole), (part_o, part_lse, counters)


def assert_workspace(wholes, workspace) -> None:
    """Bands intact, and the counters back at zero (a launch leaves them so, whatever its
    metadata: the next launch's merges depend on it)."""
    for i, whole in enumerate(wholes):
        assert_bands(f"workspace[{i}]", whole)
    assert int(workspace[2].count_nonzero()) == 0, "workspace[2]: the launch left a tile counter set"


@pytest.mark.parametrize("splits", [1, 2])
def test_metadata_with_more_tokens_than_q_rows(splits, device):
    """Hand-built metadata whose query_start_loc claims 21 tokens while q, out and
    slot_mapping have 5 rows: the kernel writes those 5 rows (correctly) and nothing past."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    full, _ = build_meta([Seq(8, 3), Seq(13, 0)], block_size=16, num_blocks=6, max_ranges=1, rng=rng, device=device)
    meta = AttentionMetadata(query_start_loc=full.query_start_loc, seq_lens=full.seq_lens,
                             block_table=full.block_table, prefix_ranges=full.prefix_ranges,
                             slot_mapping=full.slot_mapping[:5].clone())
    k_cache = torch.randn(6, 16, 2, 32, generator=gen).to(device)
    v_cache = torch.randn(6, 16, 2, 32, generator=gen).to(device)
    q21 = torch.randn(21, 4, 32, generator=gen).to(device)
    out_whole, out = banded((5, 4, 32), torch.float32, device)
    workspace = None
    if splits > 1:
        wholes, workspace = banded_workspace(5, 4, splits, 32, 2, device)

    paged_attention(q21[:5].clone(), k_cache, v_cache, out, meta, num_splits=splits, workspace=workspace)

    assert_bands("out", out_whole)
    if splits > 1:
        assert_workspace(wholes, workspace)
    ref = reference.paged_attention(q21, k_cache, v_cache, full)
    assert_close("out", out, ref[:5], *TOL[torch.float32], seed)


def test_write_kv_skips_slots_outside_the_cache(device):
    """Slots past the cache (259 of 256, 2**40) or negative are skipped on the device; the
    others are written; the reference write agrees."""
    seed = fresh_seed()
    _, gen = rngs(seed)
    k_whole, k_cache = banded((16, 16, 2, 32), torch.float32, device)
    v_whole, v_cache = banded((16, 16, 2, 32), torch.float32, device)
    slots = torch.tensor([0, 259, 255, -1, 2 ** 40, 256, 100, -(2 ** 40)], dtype=torch.int64, device=device)
    k = torch.randn(8, 2, 32, generator=gen).to(device)
    v = torch.randn(8, 2, 32, generator=gen).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, k_ref, v_ref, slots)

    write_kv(k, v, k_cache, v_cache, slots)

    assert_bands("k_cache", k_whole)
    assert_bands("v_cache", v_whole)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    for row, slot in ((0, 0), (2, 255), (6, 100)):
        assert torch.equal(k_cache[slot // 16, slot % 16], k[row]), f"slot {slot} was not written"


# Metadata values a hand-built (or corrupted) description might hold: anything an int32
# or int64 can carry, edges first.
EDGES32 = st.sampled_from([0, 1, -1, 15, 16, 17, 2 ** 31 - 1, -(2 ** 31), 2 ** 20, -(2 ** 20)])
ANY32 = st.one_of(EDGES32, st.integers(-40, 120), st.integers(-(2 ** 31), 2 ** 31 - 1))
ANY64 = st.one_of(st.integers(-4, 300), st.sampled_from([-1, 2 ** 62, -(2 ** 62), 255, 256]))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data(), num_seqs=st.integers(1, 3), num_tokens=st.integers(1, 12), max_blocks=st.integers(1, 5),
       max_ranges=st.integers(0, 2), splits=st.sampled_from([1, 1, 2]),
       window=st.sampled_from([None, 1, 5, 2 ** 40]),
       window_rule=st.sampled_from(["clip", "two_sided", "ranges_unclipped"]), ranges=st.booleans(),
       softcap=st.sampled_from([None, 3.0]), max_query_len=st.sampled_from([None, 1]), fuse_merge=st.booleans(),
       write_in_launch=st.booleans())
def test_garbage_metadata_stays_inside(data, num_seqs, num_tokens, max_blocks, max_ranges, splits, window,
                                       window_rule, ranges, softcap, max_query_len, fuse_merge, write_in_launch,
                                       device):
    """Arbitrary metadata values (negative, huge, unsorted, out of range): write_kv and
    paged_attention (a decode launch writing the new K/V itself too) return, and write
    nothing outside the caches, out and the workspace. What they compute from such input
    is unspecified."""
    ints = lambda n, s=ANY32: torch.tensor(data.draw(st.lists(s, min_size=n, max_size=n)), dtype=torch.int64)
    # The block table sits in a wider tensor whose extra rows and columns name a poison
    # block (NaN K/V) that no drawn id reaches, even clamped: NaN in the output means a
    # read past the table.
    table = ints(num_seqs * max_blocks).reshape(num_seqs, max_blocks)
    table = torch.where(table == POISON, POISON + 1, table).to(torch.int32)
    table_whole = torch.full((num_seqs + 2 * GUARD, max_blocks + GUARD), POISON, dtype=torch.int32)
    table_whole[GUARD: GUARD + num_seqs, :max_blocks] = table
    table_whole = table_whole.to(device)
    meta = AttentionMetadata(
        query_start_loc=ints(num_seqs + 1).to(torch.int32).to(device),
        seq_lens=ints(num_seqs).to(torch.int32).to(device),
        block_table=table_whole[GUARD: GUARD + num_seqs, :max_blocks],
        prefix_ranges=ints(num_seqs * max_ranges * 2).to(torch.int32).reshape(num_seqs, max_ranges, 2).to(device),
        slot_mapping=ints(num_tokens, ANY64).to(device))
    k_whole, k_cache = banded((16, 16, 1, 16), torch.float32, device)
    v_whole, v_cache = banded((16, 16, 1, 16), torch.float32, device)
    k_cache[POISON] = float("nan")
    v_cache[POISON] = float("nan")
    out_whole, out = banded((num_tokens, 2, 16), torch.float32, device)
    q = torch.randn(num_tokens, 2, 16).to(device)
    k_new = torch.randn(num_tokens, 1, 16).to(device)
    workspace = None
    if splits > 1:
        wholes, workspace = banded_workspace(num_tokens, 2, splits, 16, num_seqs, device)
        if not fuse_merge:
            workspace = workspace[:2]

    if not write_in_launch:
        write_kv(k_new, k_new, k_cache, v_cache, meta)
    paged_attention(q, k_cache, v_cache, out, meta, num_splits=splits, workspace=workspace, window=window,
                    window_rule=window_rule, ranges=ranges, softcap=softcap, max_query_len=max_query_len,
                    new_kv=(k_new, k_new) if write_in_launch else None,
                    config=None if fuse_merge else replace(default_config(16, torch.float32, 2,
                                                                          max_query_len=max_query_len),
                                                           fuse_merge=False))

    if device.type == "cuda":
        torch.cuda.synchronize()
    for name, whole in (("k_cache", k_whole), ("v_cache", v_whole), ("out", out_whole)):
        assert_bands(name, whole)
    if splits > 1:
        assert_workspace(wholes, workspace if fuse_merge else (*workspace, wholes[2][GUARD:-GUARD]))
    # (with splits, out itself may be NaN: the merge of splits that all saw no key)
    read = out if splits == 1 else workspace[0]
    assert not bool(read.isnan().any()), "a block id from past the block table was read (poison block)"


def test_wrapped_tile_arithmetic_reads_inside_the_block_table(device):
    """Metadata on which int32 tile arithmetic wraps (query_start_loc near -2**31) and once
    put a tile of keys past seq_len on the path whose block-table loads are unmasked (found
    by compute-sanitizer on the H200): every block-table read stays inside the table, seen
    here through a poison block id in the table's margins."""
    table = torch.full((4 + 2 * GUARD, 1 + GUARD), POISON, dtype=torch.int32)
    table[GUARD: GUARD + 4, :1] = torch.tensor([[0], [-1], [2 ** 31 - 1], [-(2 ** 31)]], dtype=torch.int32)
    table = table.to(device)
    big = 2 ** 31 - 1
    ranges = [[[-big - 1, -big - 1], [-1, big]], [[85, big], [0, 16]], [[16, -big - 1], [0, -big - 1]],
              [[big, 791868629], [85, 0]]]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([-639335737, 0, -13, -big - 1, -13], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([569346722, 0, -1, 16], dtype=torch.int32, device=device),
        block_table=table[GUARD: GUARD + 4, :1],
        prefix_ranges=torch.tensor(ranges, dtype=torch.int32, device=device),
        slot_mapping=torch.full((22,), -1, dtype=torch.int64, device=device))
    k_cache = torch.randn(16, 16, 2, 64, device=device)
    k_cache[POISON] = float("nan")
    q = torch.randn(22, 8, 64, device=device)
    out = torch.zeros_like(q)
    paged_attention(q, k_cache, k_cache.clone(), out, meta)
    assert not bool(out.isnan().any()), "a block id from past the block table was read (poison block)"


def test_wrapped_window_bound_leaves_few_new_key_tiles(device):
    """A prefill launch reading the new keys from k/v, on metadata where the window's lower
    bound wraps int32 (a query length near 2**31 puts the first query position near
    -2**31): the new keys' tile range once spanned ~2**31 / BLOCK_N tiles (a launch that
    does not return). It must return, write only inside its tensors, and write the cache
    at the drawn slots only."""
    big = 2 ** 31
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, big - 100], dtype=torch.int64).to(torch.int32).to(device),
        seq_lens=torch.tensor([5], dtype=torch.int32, device=device),
        block_table=torch.tensor([[1]], dtype=torch.int32, device=device),
        prefix_ranges=torch.zeros(1, 0, 2, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor([3, -1, 700, 20], dtype=torch.int64, device=device))
    k_whole, k_cache = banded((4, 16, 1, 16), torch.float32, device)
    v_whole, v_cache = banded((4, 16, 1, 16), torch.float32, device)
    out_whole, out = banded((4, 2, 16), torch.float32, device)
    q = torch.randn(4, 2, 16).to(device)
    k_new = torch.randn(4, 1, 16).to(device)
    for window in (2 ** 40, 2 ** 30 - 7):
        paged_attention(q, k_cache, v_cache, out, meta, window=window, new_kv=(k_new, k_new),
                        config=KernelConfig(block_q=8, block_n=16))
    if device.type == "cuda":
        torch.cuda.synchronize()
    for name, whole in (("k_cache", k_whole), ("v_cache", v_whole), ("out", out_whole)):
        assert_bands(name, whole)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        written = (cache.reshape(4 * 16, 16) != SENTINEL).any(1).nonzero().flatten().tolist()
        assert set(written) <= {3, 20}, f"{name}: slots {written} written, only 3 and 20 drawn"


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("max_query_len", [1, None])
def test_launch_writes_new_kv_at_valid_slots_only(max_query_len, rope, splits, device):
    """A launch given the new K/V writes each token at its slot, and nothing where a slot is
    negative or past the cache (a token not to be kept, or hand-built metadata): decode
    launches (which read the keys back from the cache) and prefill ones (k/v directly),
    with and without rotating the keys."""
    seed = fresh_seed()
    _, gen = rngs(seed)
    lens = [7, 18, 1, 33]                 # context + 1 new token each
    blocks = [[5, 0], [3, 1], [6], [2, 4, 7]]
    num_slots = 8 * 16
    meta = AttentionMetadata(
        query_start_loc=torch.arange(5, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_table=torch.tensor([b + [0] * (3 - len(b)) for b in blocks], dtype=torch.int32, device=device),
        prefix_ranges=torch.zeros(4, 0, 2, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor([blocks[0][0] * 16 + 6, -1, num_slots + 9, blocks[3][2] * 16 + 0],
                                  dtype=torch.int64, device=device))
    k_cache = torch.full((8, 16, 1, 16), SENTINEL, device=device)
    v_cache = torch.full((8, 16, 1, 16), SENTINEL, device=device)
    q = torch.randn(4, 2, 16, generator=gen).to(device)
    k_new = torch.randn(4, 1, 16, generator=gen).to(device)
    v_new = torch.randn(4, 1, 16, generator=gen).to(device)
    tables = None
    if rope:
        angle = torch.rand(4, 8, generator=gen) * 6.28
        tables = tuple(torch.cat([f(angle)] * 2, -1).to(device) for f in (torch.cos, torch.sin))
    paged_attention(q, k_cache, v_cache, torch.empty_like(q), meta, num_splits=splits, max_query_len=max_query_len,
                    new_kv=(k_new, v_new), rope=tables)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for name, cache, new in (("k_cache", k_cache, k_new), ("v_cache", v_cache, v_new)):
        flat = cache.reshape(num_slots, 16)
        written = (flat != SENTINEL).any(1).nonzero().flatten().tolist()
        assert written == [int(meta.slot_mapping[0]), int(meta.slot_mapping[3])], \
            f"{name}: slots {written} written (seed={seed})"
        want = new[[0, 3]]
        if rope and name == "k_cache":
            want = apply_rope(want, tables[0][[0, 3]], tables[1][[0, 3]])
        torch.testing.assert_close(flat[written], want[:, 0], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"{name}: wrong values written (seed={seed}): {m}")


# ---------------------------------------------------------------- runtime entry points
CFG = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=16, max_num_seqs=4,
                    max_num_tokens=32, max_model_len=64, max_prefix_ranges=2, dtype=torch.float32)


def attention_model(call):
    """A one-layer step function whose attention call is ``call(ctx, q, k, v)``."""
    def model_step(ctx):
        t = ctx.num_tokens
        q = torch.randn(t, CFG.num_q_heads, CFG.head_dim, device=ctx.positions.device)
        kv = torch.randn(t, CFG.num_kv_heads, CFG.head_dim, device=ctx.positions.device)
        return call(ctx, q, kv, kv.clone())
    return model_step


@pytest.mark.parametrize("call,err,match", [
    (lambda c, q, k, v: c.attention(-1, q, k, v), ValueError, r"^layer must be in \[0, 2\) .* got -1"),
    (lambda c, q, k, v: c.attention(2, q, k, v), ValueError, r"^layer must be in \[0, 2\) .* got 2"),
    (lambda c, q, k, v: c.attention(True, q, k, v), TypeError, r"^layer must be an int, got bool"),
    (lambda c, q, k, v: c.attention(0.0, q, k, v), TypeError, r"^layer must be an int, got float"),
    (lambda c, q, k, v: c.attention(0, q.half(), k.half(), v.half()), TypeError,
     r"^q is torch.float16, the runtime's KV cache torch.float32"),
    (lambda c, q, k, v: c.attention(0, q, k.half(), v), TypeError, r"^k is torch.float16"),
    (lambda c, q, k, v: c.attention(0, q[:2], k, v), ValueError, r"^q must be \[3, 4, 32\] .* got \(2, 4, 32\)"),
    (lambda c, q, k, v: c.attention(0, q, k[:-1], v), ValueError, r"^k must be \[\d+, 2, 32\]"),
    (lambda c, q, k, v: c.attention(0, q, k, v[:, :1]), ValueError, r"^v must be \[\d+, 2, 32\]"),
    (lambda c, q, k, v: c.attention(0, q, k.tolist(), v), TypeError, r"^k must be a torch.Tensor"),
], ids=["layer-negative", "layer-past-end", "layer-bool", "layer-float", "q-fp16", "k-fp16", "q-rows", "k-rows",
        "v-heads", "k-list"])
def test_step_context_attention_rejects(call, err, match, device):
    """Eager (and at capture) the attention call checks its layer and tensors before
    writing the cache: the caches stay bit-for-bit unchanged."""
    rt = Runtime(CFG, attention_model(call), num_layers=2, device=device)
    caches = [t.clone() for t in (*rt.k_caches, *rt.v_caches)]
    step = Step([SeqStep(q_len=3, context_len=5, block_ids=[4])])
    with pytest.raises(err, match=match):
        rt.step(step)
    assert all(torch.equal(a, b) for a, b in zip(caches, (*rt.k_caches, *rt.v_caches))), "a cache was written"


def test_runtime_refuses_blocks_written_twice(device):
    """Two sequences writing into one block: refused before anything is staged; the same
    step with its own blocks runs; shared read-only prefix blocks are fine."""
    rt = Runtime(CFG, attention_model(lambda c, q, k, v: c.attention(0, q, k, v)), num_layers=1, device=device)
    rt.step(Step([SeqStep(q_len=4, context_len=0, block_ids=[1])]))
    before = [t.clone() for t in (rt.buffers.arena, *rt.buffers.staging, *rt.k_caches, *rt.v_caches)]
    bad = Step([SeqStep(q_len=1, context_len=20, block_ids=[2, 3]), SeqStep(q_len=2, context_len=18, block_ids=[2, 3])])
    with pytest.raises(ValueError, match=r"block 3 would be written twice .*seqs 0 .* and 1 "):
        rt.step(bad)
    after = (rt.buffers.arena, *rt.buffers.staging, *rt.k_caches, *rt.v_caches)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused step changed staged state"
    rt.step(Step([SeqStep(q_len=1, context_len=20, block_ids=[2, 3]), SeqStep(q_len=2, context_len=18,
                                                                               block_ids=[2, 4])]))


def test_config_refuses_head_dims_the_kernel_cannot_compile():
    fields = dict(num_q_heads=4, num_kv_heads=2, block_size=16, num_blocks=16, max_num_seqs=4, max_num_tokens=32,
                  max_model_len=64)
    for bad in (8, 1, 257, 512):
        with pytest.raises(ValueError, match=r"^RuntimeConfig.head_dim must be an int in \[9, 256\]"):
            RuntimeConfig(head_dim=bad, **fields)
    for good in (9, 16, 80, 256):
        RuntimeConfig(head_dim=good, **fields)


def test_custom_ops_check_like_the_launchers(device):
    """torch.ops.graphrt.* run the launchers' checks and device bounds."""
    import graphrt.kernels.ops  # noqa: F401  (registers the ops)

    rng, _ = rngs(fresh_seed())
    meta, _ = build_meta([Seq(3, 5), Seq(2, 0)], block_size=16, num_blocks=4, max_ranges=1, rng=rng, device=device)
    q = torch.randn(5, 4, 32, device=device)
    cache = torch.zeros(4, 16, 2, 32, device=device)
    with pytest.raises(ValueError, match=r"^q has 4 rows, the metadata 5 token slots"):
        torch.ops.graphrt.paged_attention(q[:4], cache, cache, q[:4].clone(), meta.query_start_loc, meta.seq_lens,
                                          meta.block_table, meta.prefix_ranges, meta.slot_mapping,
                                          q.new_empty(0), q.new_empty(0), q.new_empty(0, dtype=torch.int32))
    k_whole, k_cache = banded((4, 16, 2, 32), torch.float32, device)
    v_whole, v_cache = banded((4, 16, 2, 32), torch.float32, device)
    k = torch.randn(2, 2, 32, device=device)
    torch.ops.graphrt.write_kv(k, k, k_cache, v_cache, torch.tensor([64, 3], dtype=torch.int64, device=device))
    assert_bands("k_cache", k_whole)
    assert_bands("v_cache", v_whole)
    assert torch.equal(k_cache[0, 3], k[1]), "slot 3 was not written"
    untouched = torch.ones(4, 16, dtype=torch.bool, device=device)
    untouched[0, 3] = False
    assert bool((k_cache[untouched] == SENTINEL).all()), "slot 64 (past the cache) was written somewhere"


def test_bf16_matches_the_reference_on_any_device(device):
    """bf16 on CPU (the interpreter's bf16 tl.dot is wrong: the kernel takes fp32 dots
    there) agrees with the reference as closely as on the GPU."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [Seq(20, 9, ((2, 12),)), Seq(1, 40)]
    meta, _ = build_meta(seqs, block_size=16, num_blocks=8, max_ranges=1, rng=rng, device=device)
    k_cache = torch.randn(8, 16, 2, 64, generator=gen).to(device, torch.bfloat16)
    v_cache = torch.randn(8, 16, 2, 64, generator=gen).to(device, torch.bfloat16)
    q = torch.randn(21, 8, 64, generator=gen).to(device, torch.bfloat16)
    out = torch.empty_like(q)
    paged_attention(q, k_cache, v_cache, out, meta, softcap=20.0)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, softcap=20.0)
    assert_close("out", out, ref, *TOL[torch.bfloat16], seed)


WILD = dict(     # anything a caller might pass
    scale=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 10 ** 7), st.booleans()),
    softcap=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 10 ** 7), st.booleans()),
    window=st.one_of(st.integers(-3, 2 ** 70), st.booleans(), st.floats(0, 100)),
    window_rule=st.sampled_from(["causal", "Clip", 3, None]),
    ranges=st.one_of(st.integers(0, 1), st.none()),
    num_splits=st.one_of(st.sampled_from([-1, 0, 65, 64]), st.booleans()),
    rows=st.integers(-2, 2),
    head_dim=st.sampled_from([8, 16, 24, 320]),
)
GOOD = dict(     # valid values, edges included
    scale=st.one_of(st.none(), st.floats(1e-6, 1e6), st.integers(1, 3)),
    softcap=st.one_of(st.none(), st.floats(1e-6, 1e6), st.integers(1, 100)),
    window=st.one_of(st.none(), st.integers(1, 2 ** 70)),
    window_rule=st.sampled_from(["clip", "two_sided", "ranges_unclipped", "gemma3", "gemma4"]),
    ranges=st.booleans(),
    num_splits=st.sampled_from([1, 2, 5]),
    rows=st.just(0),
    head_dim=st.sampled_from([16, 24]),
)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data(), wild=st.sampled_from([None, *WILD]))
def test_paged_attention_arguments_refused_or_right(data, wild, device):
    """Valid arguments with at most one of them drawn from anything a caller might pass:
    the call either raises ValueError/TypeError naming an argument, with out and the caches
    untouched, or runs and matches the float64 reference."""
    args = {name: data.draw(WILD[name] if name == wild else GOOD[name], label=name) for name in GOOD}
    rows, head_dim, num_splits = args.pop("rows"), args.pop("head_dim"), args.pop("num_splits")
    rng, gen = rngs(fresh_seed())
    meta, _ = build_meta([Seq(6, 9, ((2, 10),)), Seq(1, 20)], block_size=16, num_blocks=5, max_ranges=1, rng=rng,
                         device=device, num_tokens=8)
    k_cache = torch.randn(5, 16, 1, head_dim, generator=gen).to(device)
    v_cache = torch.randn(5, 16, 1, head_dim, generator=gen).to(device)
    q = torch.randn(8 + rows, 2, head_dim, generator=gen).to(device)
    out = torch.full_like(q, SENTINEL)
    before = [t.clone() for t in (k_cache, v_cache, out)]
    try:
        paged_attention(q, k_cache, v_cache, out, meta, num_splits=num_splits, **args)
    except (ValueError, TypeError) as err:
        message = str(err)
        assert wild is not None, f"valid arguments refused: {message}"
        assert message.split(" ")[0] in {"q", "scale", "softcap", "window", "window_rule", "ranges", "num_splits",
                                         "q.shape[2]"}, message
        assert all(torch.equal(a, b) for a, b in zip(before, (k_cache, v_cache, out))), f"changed by: {message}"
        return
    ref = reference.paged_attention(q, k_cache, v_cache, meta, **args)
    # fp32 logits carry a relative error of ~1e-6: with scales up to 1e6 the output's
    # tolerance grows with the largest logit
    scale = args["scale"] or head_dim ** -0.5
    logit = min(scale * float((q.double() @ k_cache.double().flatten(0, 2).T).abs().max()), args["softcap"] or math.inf)
    tol = 1e-4 * max(1.0, logit / 10)
    assert_close(f"out {args} splits={num_splits}", out[:7], ref, tol, tol, seed=-1)
