"""Host-side step description: validation errors and packing into the kernels' layout."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from _cases import build_meta, fresh_seed, random_seqs, rngs
from graphrt import RuntimeConfig, SeqStep, Step, build_metadata

CFG = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=64, max_num_seqs=8,
                    max_num_tokens=128, max_model_len=256, max_prefix_ranges=3, dtype=torch.float32)


def seq(q_len=1, context_len=20, ranges=(), blocks=None):
    n = -(-(q_len + context_len) // CFG.block_size)
    return SeqStep(q_len=q_len, context_len=context_len, block_ids=list(range(n)) if blocks is None else blocks,
                   prefix_ranges=ranges)


@pytest.mark.parametrize("seqs,match", [
    ([], r"0 sequences"),
    ([seq()] * 9, r"9 sequences; allowed 1..max_num_seqs=8"),
    ([seq(), seq(q_len=0)], r"seq 1: q_len must be >= 1"),
    ([seq(context_len=-1)], r"seq 0: context_len must be >= 0"),
    ([seq(q_len=100), seq(q_len=29)], r"129 new tokens, more than max_num_tokens=128"),
    ([seq(q_len=1, context_len=256, blocks=list(range(17)))], r"seq 0: context_len \+ q_len = 257 exceeds max_model_len"),
    ([seq(), seq(context_len=40, blocks=[1, 2])], r"seq 1: has 2 block_ids, fewer than"),
    ([seq(blocks=[0, 1, 64])], r"seq 0: block id 64 is outside \[0, num_blocks=64\)"),
    ([seq(blocks=[-1, 1])], r"seq 0: block id -1 is outside"),
    ([seq(ranges=[(0, 2), (3, 4), (5, 6), (7, 8)])], r"seq 0: has 4 prefix ranges, more than max_prefix_ranges=3"),
    ([seq(), seq(ranges=[(5, 5)])], r"seq 1: prefix range 0 \[5, 5\) is empty"),
    ([seq(ranges=[(7, 3)])], r"seq 0: prefix range 0 \[7, 3\) is empty or reversed"),
    ([seq(ranges=[(-2, 3)])], r"seq 0: prefix range 0 \[-2, 3\) starts before position 0"),
    ([seq(ranges=[(0, 4), (10, 22)])], r"seq 0: prefix range 1 \[10, 22\) ends past the sequence's length after "
                                       r"this step \(21\)"),
    ([seq(ranges=[(10, 15), (2, 5)])], r"seq 0: prefix range 1 \[2, 5\) starts before the previous range ends"),
    ([seq(ranges=[(2, 10), (8, 12)])], r"seq 0: prefix range 1 \[8, 12\) starts before the previous range ends"),
], ids=["empty", "too-many-seqs", "q-len-0", "negative-context", "too-many-tokens", "past-max-model-len",
        "too-few-blocks", "block-id-high", "block-id-negative", "too-many-ranges", "range-empty", "range-reversed",
        "range-negative", "range-past-seq-len", "ranges-unsorted", "ranges-overlap"])
def test_validate_rejects(seqs, match):
    with pytest.raises(ValueError, match=match):
        Step(seqs).validate(CFG)


def test_validate_accepts_edges():
    Step([seq(q_len=1, context_len=0, ranges=[(0, 1)], blocks=[0]),            # one-token range at position 0
          seq(q_len=5, context_len=11, ranges=[(0, 4), (4, 8), (8, 16)], blocks=[1]),  # touching ranges to seq_len
          seq(q_len=1, context_len=255, blocks=list(range(2, 18)))]).validate(CFG)  # exactly max_model_len


def test_validate_accepts_shared_prefix_blocks():
    """Blocks only read may be shared by any number of sequences (a common prefix); only
    the blocks that new tokens write must be distinct."""
    prefix = [7, 8, 9]                                 # 48 shared context tokens
    Step([seq(q_len=1, context_len=48, blocks=prefix + [20]),
          seq(q_len=3, context_len=48, blocks=prefix + [21]),
          seq(q_len=16, context_len=48, blocks=prefix + [22]),
          seq(q_len=20, context_len=32, blocks=prefix[:2] + [23, 24])]).validate(CFG)


@pytest.mark.parametrize("seqs,match", [
    ([seq(q_len=20, context_len=0, blocks=[3, 3])], r"block 3 would be written twice .*seq 0 lists it twice "
                                                     r"\(block_ids\[0\] and \[1\]\)"),
    ([seq(q_len=5, context_len=10, blocks=[3]), seq(q_len=5, context_len=0, blocks=[3])],
     r"block 3 would be written twice .*seqs 0 \(block_ids\[0\]\) and 1 \(block_ids\[0\]\) both write into it"),
    ([seq(q_len=1, context_len=20, blocks=[1, 2]), seq(q_len=1, context_len=21, blocks=[1, 2])],
     r"block 2 would be written twice .*seqs 0 .* and 1 "),                  # two decodes, offsets 4 and 5
    ([seq(q_len=1, context_len=20, blocks=[1, 30 + i]) for i in range(7)] + [seq(q_len=40, context_len=0,
                                                                                  blocks=[50, 51, 33])],
     r"block 33 would be written twice .*seqs 3 \(block_ids\[1\]\) and 7 \(block_ids\[2\]\)"),
], ids=["one-seq-twice", "two-seqs-one-block", "two-decodes-one-block", "mixed-many"])
def test_validate_rejects_blocks_written_twice(seqs, match):
    with pytest.raises(ValueError, match=match):
        Step(seqs).validate(CFG)


@pytest.mark.parametrize("bad,err", [
    (dict(q_len=1.0), TypeError), (dict(q_len=True), TypeError), (dict(block_ids=[0.5, "x"]), TypeError),
    (dict(prefix_ranges=[(1, 2, 3)]), TypeError),
], ids=["float-q-len", "bool-q-len", "bad-block-ids", "range-triple"])
def test_step_rejects_wrong_types(bad, err):
    fields = dict(q_len=1, context_len=3, block_ids=[0], prefix_ranges=())
    fields.update(bad)
    with pytest.raises(err):
        Step([SeqStep(**fields)])


def test_pack_matches_plain_builder():
    """Step.pack (vectorised) == the tests' loop-by-loop builder, padding included."""
    seed = fresh_seed()
    rng, _ = rngs(seed)
    seqs = random_seqs(rng, 6, max_q=20, max_ctx=100, max_ranges=CFG.max_prefix_ranges)
    total = sum(s.q_len for s in seqs)
    want, blocks = build_meta(seqs, block_size=CFG.block_size, num_blocks=CFG.num_blocks,
                              max_ranges=CFG.max_prefix_ranges, rng=rng, device="cpu", num_seqs=8,
                              num_tokens=total + 4)
    step = Step([SeqStep(q_len=s.q_len, context_len=s.ctx, block_ids=b, prefix_ranges=s.ranges)
                 for s, b in zip(seqs, blocks)])
    got, positions = build_metadata(step, CFG, "cpu", num_seqs=8, num_tokens=total + 4)
    for name in ("query_start_loc", "seq_lens", "prefix_ranges", "slot_mapping"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{name} differs (seed={seed})"
    for i, b in enumerate(blocks):
        assert got.block_table[i, : len(b)].tolist() == b, f"block_table row {i} differs (seed={seed})"
    want_pos = [p for s in seqs for p in range(s.ctx, s.seq_len)] + [0] * 4
    assert positions.tolist() == want_pos


def test_pack_clears_stale_ranges():
    """Re-packing into the same arrays: a sequence with fewer ranges than last step must
    not keep the old ones (they would change its mask)."""
    arrays = dict(query_start_loc=np.zeros(5, np.int32), seq_lens=np.zeros(4, np.int32),
                  block_table=np.zeros((4, CFG.max_blocks_per_seq), np.int32),
                  prefix_ranges=np.zeros((4, 3, 2), np.int32), slot_mapping=np.zeros(8, np.int64))
    Step([seq(ranges=[(0, 5), (6, 9), (10, 20)])] * 2).pack(CFG.block_size, **arrays)
    Step([seq(ranges=[(2, 3)]), seq()]).pack(CFG.block_size, **arrays)
    assert arrays["prefix_ranges"][:2].tolist() == [[[2, 3], [0, 0], [0, 0]], [[0, 0]] * 3]
    assert arrays["query_start_loc"].tolist() == [0, 1, 2, 2, 2]
    assert arrays["slot_mapping"][2:].tolist() == [-1] * 6


@pytest.mark.parametrize("field,value", [
    ("num_q_heads", 0), ("head_dim", -64), ("block_size", 16.0), ("max_num_seqs", True),
    ("max_prefix_ranges", -1), ("num_q_heads", 6), ("max_num_tokens", 4), ("dtype", torch.int32),
])
def test_config_rejects(field, value):
    fields = dict(num_q_heads=8, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=8, max_num_seqs=8,
                  max_num_tokens=64, max_model_len=128)
    fields[field] = value
    with pytest.raises(ValueError, match=field):
        RuntimeConfig(**fields)


def test_from_arrays_packs_like_seqsteps():
    seed = fresh_seed()
    rng, _ = rngs(seed)
    seqs = random_seqs(rng, 5, max_q=20, max_ctx=100, max_ranges=CFG.max_prefix_ranges)
    needed = [-(-s.seq_len // CFG.block_size) for s in seqs]
    blocks = np.split(rng.permutation(CFG.num_blocks)[: sum(needed)], np.cumsum(needed)[:-1])
    listed = Step([SeqStep(q_len=s.q_len, context_len=s.ctx, block_ids=b.tolist(), prefix_ranges=s.ranges)
                   for s, b in zip(seqs, blocks)])
    table = np.full((5, CFG.max_blocks_per_seq), -1)                 # unused entries: anything
    ranges = np.full((5, CFG.max_prefix_ranges, 2), 7)
    for i, (s, b) in enumerate(zip(seqs, blocks)):
        table[i, : len(b)] = b
        if s.ranges:
            ranges[i, : len(s.ranges)] = s.ranges
    columnar = Step.from_arrays(q_lens=[s.q_len for s in seqs], context_lens=[s.ctx for s in seqs],
                                block_table=table, prefix_ranges=ranges,
                                range_counts=[len(s.ranges) for s in seqs])
    got, want = (build_metadata(st, CFG, "cpu", num_seqs=6, num_tokens=listed.num_tokens + 2) for st in
                 (columnar, listed))
    for name in ("query_start_loc", "seq_lens", "prefix_ranges", "slot_mapping"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), f"{name} differs (seed={seed})"
    assert torch.equal(got[1], want[1])
    for i, n in enumerate(needed):
        assert torch.equal(got[0].block_table[i, :n], want[0].block_table[i, :n]), f"row {i} (seed={seed})"


def test_from_arrays_rejects():
    good = dict(q_lens=[1, 2], context_lens=[3, 4], block_table=[[0], [1]])
    Step.from_arrays(**good).validate(CFG)
    with pytest.raises(TypeError, match="block_table must be a 2-d integer array"):
        Step.from_arrays(**{**good, "block_table": [[0.5], [1.0]]})
    with pytest.raises(ValueError, match="must agree on the number of sequences"):
        Step.from_arrays(**{**good, "context_lens": [3]})
    with pytest.raises(ValueError, match=r"seq 1: block id 64 is outside"):
        Step.from_arrays(**{**good, "block_table": [[0], [64]]}).validate(CFG)
    with pytest.raises(ValueError, match=r"seq 0: prefix range 0 \[2, 9\) ends past"):
        Step.from_arrays(**good, prefix_ranges=[[(2, 9)], [(0, 0)]]).validate(CFG)


def random_step_arrays(rng: np.random.Generator, max_seqs: int, num_blocks: int, *, decode_p: float = 0.0,
                       distinct_p: float = 0.0, derived_p: float = 0.0, max_context: int = 100,
                       no_ranges_p: float = 0.0) -> dict:
    """``Step.from_arrays`` keywords of a random step, valid or broken in any limit: up
    to ``max_seqs`` sequences of up to 3 new tokens (all decodes with probability
    ``decode_p``), contexts below ``max_context``, blocks from [0, num_blocks) (distinct with
    probability ``distinct_p`` when they fit, else drawn with repeats), 4 range slots;
    now and then a q_len of 0, a negative context, a count off by one, a block id out of
    range, shuffled, shifted or empty ranges, or a range count too large. With probability
    ``derived_p`` the block and range counts are left for validate to derive; with
    ``no_ranges_p`` the step has no range slots at all."""
    n = int(rng.integers(1, max_seqs + 1))
    q = np.ones(n, np.int64) if rng.random() < decode_p else rng.integers(0 if rng.random() < 0.05 else 1, 4, n)
    c = rng.integers(-1 if rng.random() < 0.05 else 0, max_context, n)
    need = -(-(q + c) // 16)
    counts = np.maximum(need + (rng.integers(-1, 2, n) if rng.random() < 0.1 else 0), 0)
    width = int(max(counts.max(), 1)) + int(rng.integers(0, 2))
    if n * width <= num_blocks and rng.random() < distinct_p:
        table = rng.permutation(num_blocks)[: n * width].reshape(n, width)
    else:
        table = rng.integers(-1 if rng.random() < 0.05 else 0, num_blocks + (rng.random() < 0.05), (n, width))
    # cut points inside each sequence (sorted: valid ranges), now and then shuffled,
    # pushed past the sequence or below 0, or collapsed to empty
    cuts = np.sort((rng.random((n, 8)) * (q + c)[:, None]).astype(np.int64), axis=1)
    cuts[:, 1::2] += 1
    if rng.random() < 0.1:
        rng.shuffle(cuts, axis=1)
    if rng.random() < 0.05:
        cuts[int(rng.integers(n)), int(rng.integers(8))] += int(rng.integers(-3, 4))
    ranges = cuts.reshape(n, 4, 2)
    if rng.random() < 0.1:
        i, j = int(rng.integers(n)), int(rng.integers(4))
        ranges[i, j, 1] = ranges[i, j, 0]
    kwargs = dict(q_lens=q, context_lens=c, block_table=table, prefix_ranges=ranges)
    if rng.random() >= derived_p:
        kwargs.update(block_counts=counts, range_counts=rng.integers(0, 5 if rng.random() < 0.05 else 4, n))
    elif rng.random() >= 0.05:        # derived: the non-empty ranges count, mostly at most 3 of them
        ranges[:, 3] = 0
    if rng.random() < no_ranges_p:
        del kwargs["prefix_ranges"]
        kwargs.pop("range_counts", None)
    return kwargs


def test_small_and_numpy_checks_agree():
    """validate() checks up to 32 sequences in Python and more with numpy reductions: on
    random steps, valid and broken in every limit, both give the same verdict."""
    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=50, max_num_seqs=32,
                        max_num_tokens=60, max_model_len=120, max_prefix_ranges=3, dtype=torch.float32)
    verdicts = []
    for _ in range(1500):
        kwargs = random_step_arrays(rng, 20, cfg.num_blocks)
        step = Step.from_arrays(**kwargs)
        small, big = step._checks_small(cfg) is not None, step._checks_numpy(cfg)
        assert small == big, f"checks disagree (seed={seed}): small {small}, numpy {big}, {kwargs}"
        verdicts.append(big)
    assert 0.05 < np.mean(verdicts) < 0.95, f"the random steps should be both valid and not ({np.mean(verdicts):.2f})"


def validation_paths() -> list:
    """(_SMALL_STEP, _fast) settings that send Step.validate and pack down each of their
    paths: Python checks, numpy checks, and the C helper where it was built (CI must cover
    it)."""
    import graphrt.step as step_module

    if os.environ.get("CI") and step_module._fast is None:
        pytest.fail("graphrt._fast was not built (setup.py): CI must cover the C path")
    return [(1000, None), (0, None)] + ([(1000, step_module._fast)] if step_module._fast is not None else [])


def test_python_numpy_and_c_paths_validate_and_pack_alike(monkeypatch):
    """Small steps are validated in Python (derived counts and the written-blocks check
    included, which also hand pack the decode slots), larger ones with numpy, and both
    are done by the C helper where it was built (graphrt._fast; on a broken step the
    Python checks then run for the message): forced down each path, random steps
    (decodes and chunks, given and derived counts, repeated blocks now and then, any
    limit broken) get the same error message or the same packed arrays. Contexts up to
    400 tokens (25 block-table columns: the C pack's 8-column blocks and a remainder),
    steps without range slots now and then, staging arrays holding stale values."""
    import graphrt.step as step_module

    paths = validation_paths()

    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=320, max_num_seqs=12,
                        max_num_tokens=80, max_model_len=420, max_prefix_ranges=3, dtype=torch.float32)
    outcomes = []
    for _ in range(400):
        kwargs = random_step_arrays(rng, 12, cfg.num_blocks, decode_p=0.5, distinct_p=0.6, derived_p=0.5,
                                    max_context=400, no_ranges_p=0.2)
        results = []
        for small, fast in paths:
            monkeypatch.setattr(step_module, "_SMALL_STEP", small)
            monkeypatch.setattr(step_module, "_fast", fast)
            step = Step.from_arrays(**kwargs)
            try:
                step.validate(cfg)
            except ValueError as exc:
                results.append(("error", str(exc)))
                continue
            stale = 7        # what a staging slot holds from an earlier step
            host = dict(query_start_loc=np.full(13, stale, np.int32), seq_lens=np.full(12, stale, np.int32),
                        block_table=np.full((cfg.max_blocks_per_seq, 12), stale, np.int32).T,   # as the staging view
                        prefix_ranges=np.full((12, 3, 2), stale, np.int32), slot_mapping=np.full(80, stale, np.int64),
                        positions=np.full(80, stale, np.int64))
            step.pack(cfg.block_size, **host)
            results.append(("packed", step.block_columns, {k: v.tolist() for k, v in host.items()}))
        assert all(r == results[0] for r in results), f"the paths differ (seed={seed}): {kwargs}\n{results}"
        outcomes.append(results[0][0])
    assert 0.1 < outcomes.count("error") / len(outcomes) < 0.9, f"steps should be both valid and not (seed={seed})"


@pytest.mark.parametrize("field", ["context_lens", "q_lens"])
def test_huge_lengths_are_refused_not_wrapped(monkeypatch, field):
    """context_len + q_len of int64 values near the top wraps to a negative seq_len, which
    passed every limit before; each length is now held to max_model_len on its own, on
    every validation path."""
    import graphrt.step as step_module

    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=40, max_num_seqs=40,
                        max_num_tokens=80, max_model_len=120, max_prefix_ranges=3, dtype=torch.float32)
    paths = validation_paths()
    for n in (2, 40):               # a few sequences (Python checks) and many (numpy)
        arrays = dict(q_lens=np.ones(n, np.int64), context_lens=np.full(n, 5, np.int64),
                      block_table=np.arange(n, dtype=np.int64)[:, None])
        arrays[field][0] = np.iinfo(np.int64).max
        for small, fast in paths:
            monkeypatch.setattr(step_module, "_SMALL_STEP", small)
            monkeypatch.setattr(step_module, "_fast", fast)
            with pytest.raises(ValueError, match=f"seq 0: {field[:-1]} {np.iinfo(np.int64).max} exceeds max_model_len"):
                Step.from_arrays(**arrays).validate(cfg)


def test_c_helper_refuses_arrays_that_do_not_fit():
    """graphrt._fast reads and writes only inside the arrays it is given: called directly
    with lengths that disagree, negative lengths, keys past the table or views too small,
    it raises instead of touching memory outside them."""
    import graphrt.step as step_module

    fast = step_module._fast
    if fast is None:
        pytest.skip("graphrt._fast was not built")
    i64 = lambda *v: np.array(v, dtype=np.int64)
    q, c, table, ranges = i64(1, 2), i64(3, 0), np.array([[0, 1], [2, 3]], np.int64), np.zeros((2, 1, 2), np.int64)
    limits = (16, 80, 120, 8, 40, 3)

    def views(seqs=2, tokens=3, width=2, ranges_width=1):
        return (np.zeros(seqs + 1, np.int32), np.zeros(seqs, np.int32), np.zeros((width, seqs), np.int32).T,
                np.zeros((seqs, ranges_width, 2), np.int32), np.zeros(tokens, np.int64), np.zeros(tokens, np.int64))

    assert fast.check(q, c, table, None, ranges, None, *limits) == 1
    fast.pack(q, c, table, ranges, 16, 1, *views())               # fits
    with pytest.raises(ValueError):
        fast.check(i64(1), c, table, None, ranges, None, *limits)   # lengths disagree
    with pytest.raises(TypeError):
        fast.check(q.astype(np.int32), c, table, None, ranges, None, *limits)
    for args, bad in [((i64(-5, 2), c, table, ranges), "negative q_len"),
                      ((q, i64(-3, 0), table, ranges), "negative context_len"),
                      ((i64(1, 40), c, table, ranges), "keys past the table's width"),
                      ((q, c, table, ranges), "more tokens than slots")]:
        staging = views(tokens=2) if bad == "more tokens than slots" else views()
        with pytest.raises(ValueError):
            fast.pack(*args, 16, 1, *staging)
    for staging in (views(seqs=1), views(width=1), views(tokens=2)):
        with pytest.raises(ValueError):
            fast.pack(q, c, table, ranges, 16, 2, *staging)
