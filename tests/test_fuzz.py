"""Property-based tests over step descriptions (hypothesis).

Every valid step runs through the runtime and matches the float64-attention reference;
every invalid one raises a clear error and leaves the staged buffers and the KV cache
bit-for-bit unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hypothesis import HealthCheck, example, given, settings, strategies as st

from _cases import TOL, assert_close, examples
from graphrt import Runtime, RuntimeConfig, SeqStep, Step
from graphrt.checking import ReferenceRunner
from graphrt.toy import ToyModel

CFG = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=24, max_num_seqs=4,
                    max_num_tokens=32, max_model_len=96, max_prefix_ranges=2, dtype=torch.float32)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def seq_shapes(draw, max_seqs=3):
    """(q_len, context_len, ranges) per sequence, valid for CFG, tokens within capacity."""
    n = draw(st.integers(1, max_seqs))
    shapes, budget = [], CFG.max_num_tokens
    for i in range(n):
        q = draw(st.integers(1, max(1, min(12, budget - (n - i - 1)))))
        budget -= q
        ctx = draw(st.integers(0, 40))
        k = draw(st.integers(0, min(CFG.max_prefix_ranges, (q + ctx + 1) // 2)))   # 2k distinct cut points
        cuts = sorted(draw(st.lists(st.integers(0, q + ctx), min_size=2 * k, max_size=2 * k, unique=True)))
        shapes.append((q, ctx, [(cuts[2 * j], cuts[2 * j + 1]) for j in range(k)]))
    return shapes


def make_step(shapes, perm) -> Step:
    free = iter(perm)
    return Step([SeqStep(q_len=q, context_len=c, block_ids=[next(free) for _ in range(-(-(q + c) // 16))],
                         prefix_ranges=r) for q, c, r in shapes])


def runtime(device):
    model = ToyModel(CFG, num_layers=1, hidden=32, vocab=40, device=device)
    return Runtime(CFG, model, num_layers=1, device=device), model


@settings(max_examples=examples(12), **SETTINGS)
@given(shapes=seq_shapes(), perm=st.permutations(range(CFG.num_blocks)), data=st.data())
def test_valid_steps_match_reference(shapes, perm, data, device):
    rt, model = runtime(device)
    ref = ReferenceRunner(CFG, model, num_layers=1, device=device)
    step = make_step(shapes, perm)
    ids = np.array(data.draw(st.lists(st.integers(0, 39), min_size=step.num_tokens, max_size=step.num_tokens)))
    hidden, logits = rt.step(step, ids)
    want_hidden, want_logits = ref.step(step, ids)
    atol, rtol = TOL[CFG.dtype]
    assert_close("hidden", hidden[: step.num_tokens], want_hidden, 2 * atol, 2 * rtol, seed=-1)
    assert_close("logits", logits[: step.num_seqs], want_logits, 2 * atol, 2 * rtol, seed=-1)


BREAKS = {
    "ranges unsorted": lambda s: s[0][2].reverse() if len(s[0][2]) == 2 else s[0][2].extend([(5, 7), (1, 3)]),
    "ranges overlapping": lambda s: s[0][2].__setitem__(slice(None), [(0, 4), (3, 6)]),
    "range empty": lambda s: s[0][2].__setitem__(slice(None), [(2, 2)]),
    "range past seq_len": lambda s: s[0][2].__setitem__(slice(None), [(0, s[0][0] + s[0][1] + 1)]),
    "too many ranges": lambda s: s[0][2].__setitem__(slice(None), [(0, 1), (1, 2), (2, 3)]),
    "too many seqs": lambda s: s.extend([(1, 0, [])] * (CFG.max_num_seqs + 1 - len(s))),
    "too many tokens": lambda s: s.__setitem__(0, (CFG.max_num_tokens + 1, 0, [])),
    "q_len 0": lambda s: s.__setitem__(0, (0, s[0][1], [])),
}


@settings(max_examples=examples(40), **SETTINGS)
@example(shapes=[(1, 0, [])], perm=list(range(CFG.num_blocks)), breaking="q_len 0", other="block written twice")
@example(shapes=[(1, 16, []), (2, 0, [])], perm=list(range(CFG.num_blocks)), breaking="q_len 0",
         other="block written twice")
@given(shapes=seq_shapes(), perm=st.permutations(range(CFG.num_blocks)), breaking=st.sampled_from(sorted(BREAKS)),
       other=st.sampled_from(["block id high", "too few blocks", "block written twice", "ids float", "ids short",
                              "none"]))
def test_invalid_steps_change_nothing(shapes, perm, breaking, other, device):
    rt, _ = runtime(device)
    good = make_step(shapes, perm)
    rt.step(good, np.zeros(good.num_tokens, np.int64))
    before = [t.clone() for t in [rt.buffers.arena, *rt.buffers.staging, *rt.k_caches, *rt.v_caches]]

    shapes = [(q, c, list(r)) for q, c, r in shapes]
    BREAKS[breaking](shapes)
    q_lens = [q for q, _, _ in shapes]
    try:
        bad = make_step(shapes, list(perm) * 3)      # enough ids for the longest breaks
        blocks = None
        if other == "block id high":
            blocks = [CFG.num_blocks] * 10
        elif other == "too few blocks":
            blocks = []
        if blocks is not None:
            bad = Step([SeqStep(q_len=q, context_len=c, block_ids=blocks, prefix_ranges=r) for q, c, r in shapes])
        if other == "block written twice":          # one more sequence writes into a block a sequence writes
            rows = [row[: -(-(q + c) // 16)] for (q, c, _), row in zip(shapes, bad.block_table.tolist())]
            writers = [(i, c) for i, (q, c, _) in enumerate(shapes) if q > 0]
            # the first sequence that writes (none after "q_len 0" of a lone sequence: then
            # the new sequence writes into the block of a second new one)
            extra = [] if writers else [SeqStep(q_len=1, context_len=0, block_ids=[perm[0]])]
            shared = rows[writers[0][0]][writers[0][1] // 16] if writers else perm[0]
            bad = Step([*[SeqStep(q_len=q, context_len=c, block_ids=row, prefix_ranges=r)
                          for (q, c, r), row in zip(shapes, rows)],
                        *extra, SeqStep(q_len=1, context_len=0, block_ids=[int(shared)])])
            q_lens += [1] * (1 + len(extra))
        ids = {"ids float": np.zeros(sum(q_lens)), "ids short": np.zeros(max(0, sum(q_lens) - 1), np.int64)}.get(
            other, np.zeros(sum(q_lens), np.int64))
    except TypeError:
        return                                          # rejected while describing the step: nothing staged
    with pytest.raises((ValueError, TypeError)) as err:
        rt.step(bad, ids)
    assert str(err.value), "an error without a message"
    after = [rt.buffers.arena, *rt.buffers.staging, *rt.k_caches, *rt.v_caches]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{breaking}/{other} changed staged state"
