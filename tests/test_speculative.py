"""graphrt.kernels.speculative: ``place_tokens`` (a step's positions, lengths and slots from
device-owned lengths) against a Python reference, on random and on hand-built arbitrary
metadata; ``accept_greedy`` on explicit cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cases import fresh_seed, rngs
from graphrt.kernels.speculative import accept_greedy, place_tokens


def placed(request, offset, length, qsl, seq_lens, block_table, block_size, num_tokens):
    """The reference: (seq_lens, positions, slot_mapping) after placement, from staged copies
    (positions and slots of tokens no sequence holds stay as staged: here 0 and -1)."""
    seq_lens = seq_lens.copy()
    positions = np.zeros(num_tokens, np.int64)
    slots = np.full(num_tokens, -1, np.int64)
    for i in range(len(request)):
        start, end = int(qsl[i]), min(int(qsl[i + 1]), num_tokens)
        if end - start <= 0 or start < 0:
            continue
        r = int(request[i])
        known = 0 <= r < len(length)
        first = (int(length[r]) if known else 0) + int(offset[i])
        ok = known and first >= 0 and first + end - start < 2 ** 31
        seq_lens[i] = first + end - start if ok else 0
        for j in range(end - start):
            pos = first + j
            b = pos // block_size
            slot = -1
            if ok and 0 <= b < block_table.shape[1] and block_table[i, b] >= 0:
                slot = int(block_table[i, b]) * block_size + pos % block_size
            slots[start + j], positions[start + j] = slot, pos if ok else 0
    return seq_lens, positions, slots


def run(request, offset, length, qsl, seq_lens, block_table, block_size, num_tokens, device):
    t = lambda a, dtype: torch.as_tensor(np.asarray(a), dtype=dtype, device=device)  # noqa: E731
    out = dict(seq_lens=t(seq_lens, torch.int32), positions=torch.zeros(num_tokens, dtype=torch.int64, device=device),
               slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device))
    place_tokens(t(request, torch.int32), t(offset, torch.int32), t(length, torch.int32),
                 query_start_loc=t(qsl, torch.int32), block_table=t(block_table, torch.int32), block_size=block_size,
                 **out)
    return [out[k].cpu().numpy() for k in ("seq_lens", "positions", "slot_mapping")]


@pytest.mark.parametrize("trial", range(4))
def test_place_tokens_matches_reference(trial, device):
    seed = fresh_seed()
    rng, _ = rngs(seed)
    s, k, bs, requests = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.choice([1, 4, 16])), 12
    q_lens = rng.choice([0, 1, 2, k + 1], size=s)                    # padding, decodes, a draft's first, verifies
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + int(rng.integers(0, 4))
    length = rng.integers(1, 60, size=requests).astype(np.int32)
    request = rng.permutation(requests)[:s].astype(np.int32)
    offset = rng.choice([-1, 0, 1, k - 1], size=s).astype(np.int32)
    width = -(-(60 + k + 2) // bs)
    block_table = rng.permutation(s * width + 50)[: s * width].reshape(s, width).astype(np.int32)
    block_table[:, width - 1] = rng.choice([-1, 7], size=s)          # an unallocated last block here and there
    staged = rng.integers(0, 99, size=s).astype(np.int32)
    got = run(request, offset, length, qsl, staged, block_table, bs, num_tokens, device)
    want = placed(request, offset, length, qsl, staged, block_table, bs, num_tokens)
    for name, g, w in zip(("seq_lens", "positions", "slot_mapping"), got, want):
        bad = np.nonzero(g != w)[0]
        assert bad.size == 0, f"{name} (seed {seed}) differs at {bad[:8].tolist()}: {g[bad[:8]]} vs {w[bad[:8]]}"


def test_place_tokens_on_arbitrary_metadata_stays_inside(device):
    """Hand-built values (request indices and offsets out of range, spans past the tokens,
    negative starts, lengths near 2**31): the launch returns, and matches the reference."""
    rng, _ = rngs(fresh_seed())
    wild = [-2 ** 31, -5, -1, 0, 3, 40, 2 ** 31 - 1]
    for _ in range(12):
        s, requests, num_tokens = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 20))
        qsl = np.sort(rng.choice(wild + list(range(0, 25)), size=s + 1)).astype(np.int32)
        request = rng.choice(wild, size=s).astype(np.int32)
        offset = rng.choice(wild, size=s).astype(np.int32)
        length = rng.choice(wild, size=requests).astype(np.int32)
        block_table = rng.choice(wild, size=(s, 3)).astype(np.int32)
        staged = np.zeros(s, np.int32)
        got = run(request, offset, length, qsl, staged, block_table, 4, num_tokens, device)
        want = placed(request, offset, length, qsl, staged, block_table, 4, num_tokens)
        for name, g, w in zip(("seq_lens", "positions", "slot_mapping"), got, want):
            assert np.array_equal(g, w), f"{name}: {g} vs {w} (qsl {qsl}, request {request}, offset {offset}, " \
                                         f"length {length})"


def test_place_tokens_refuses_bad_input(device):
    i32 = lambda *a: torch.zeros(*a, dtype=torch.int32, device=device)  # noqa: E731
    i64 = lambda *a: torch.zeros(*a, dtype=torch.int64, device=device)  # noqa: E731
    good = dict(query_start_loc=i32(3), seq_lens=i32(2), positions=i64(4), slot_mapping=i64(4), block_table=i32(2, 3),
                block_size=4)
    with pytest.raises(ValueError, match="request must have 2 entries"):
        place_tokens(i32(3), i32(2), i32(5), **good)
    with pytest.raises(TypeError, match="offset must have dtype"):
        place_tokens(i32(2), i64(2), i32(5), **good)
    with pytest.raises(ValueError, match="block_table must have 2 rows"):
        place_tokens(i32(2), i32(2), i32(5), **{**good, "block_table": i32(3, 3)})
    with pytest.raises(ValueError, match="one entry per token slot"):
        place_tokens(i32(2), i32(2), i32(5), **{**good, "positions": i64(5)})
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        place_tokens(i32(2), i32(2), i32(5), **{**good, "block_size": 0})


@pytest.mark.parametrize("target,drafts,accepted,next_id", [
    pytest.param([5, 6, 7, 8], [5, 6, 7], 3, 8, id="all-accepted-bonus"),
    pytest.param([5, 6, 7, 8], [4, 6, 7], 0, 5, id="first-rejected"),
    pytest.param([5, 6, 7, 8], [5, 9, 7], 1, 6, id="second-rejected-later-match-ignored"),
    pytest.param([5, 6], [5], 1, 6, id="one-draft"),
])
def test_accept_greedy(target, drafts, accepted, next_id, device):
    t = torch.tensor([target, target[::-1]], device=device)
    d = torch.tensor([drafts, [target[-1]] + drafts[1:]], device=device)   # row 1: its first draft matches
    acc, nxt = accept_greedy(t, d)
    assert acc.dtype == torch.int32 and nxt.dtype == torch.int64
    assert (int(acc[0]), int(nxt[0])) == (accepted, next_id)
    assert int(acc[1]) >= 1


def test_accept_greedy_refuses_bad_shapes(device):
    with pytest.raises(ValueError, match=r"draft_ids must be \[2, 3\]"):
        accept_greedy(torch.zeros(2, 4, dtype=torch.int64, device=device),
                      torch.zeros(2, 4, dtype=torch.int64, device=device))
