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


def test_place_tokens_reads_ids_from_the_request_rows(device):
    """Token j of a sequence takes column 1 + offset + j of its request's row (0 outside)."""
    tokens = torch.arange(30, dtype=torch.int64, device=device).reshape(3, 10) + 100      # row r: 100 + 10 r + col
    length = torch.tensor([5, 9, 2], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 4, 6, 7, 7], dtype=torch.int32, device=device)             # a verify, a pair, a single, pad
    request = torch.tensor([2, 0, 1, -1], dtype=torch.int32, device=device)
    offset = torch.tensor([0, -1, 8, 0], dtype=torch.int32, device=device)
    ids = torch.full((8,), 7, dtype=torch.int64, device=device)
    place_tokens(request, offset, length, query_start_loc=qsl, seq_lens=torch.zeros(4, dtype=torch.int32, device=device),
                 positions=torch.zeros(8, dtype=torch.int64, device=device),
                 slot_mapping=torch.zeros(8, dtype=torch.int64, device=device),
                 block_table=torch.zeros(4, 4, dtype=torch.int32, device=device), block_size=16, input_ids=ids,
                 tokens=tokens)
    # request 2 from column 1; request 0 from column 0; request 1 at column 9; slot 7 untouched
    assert ids.tolist() == [121, 122, 123, 124, 100, 101, 119, 7]


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


# ---------------------------------------------------------------- a loop

NOISE = 0.1

def speculative_setup(device, dtype, draft_seed: int, k: int, draft_noise: float = 0.0, *, sampled: bool = False,
                      requests: int = 4, **rt_kw):
    """A tiny random-weight Llama as the target (seed 0) and one as the draft (``draft_seed``:
    0 is the target itself; ``draft_noise``: its weights moved by that share of their own
    size, a draft that agrees with the target some of the time), through the transformers
    adapter, on their own runtimes. ``sampled``: a sampled state (the settings in each
    step's copy) for ``requests`` rows."""
    pytest.importorskip("transformers")
    from graphrt import Runtime
    from graphrt.integrations.tiny import nudge, tiny_model
    from graphrt.integrations.transformers import TransformersModel
    from graphrt.speculative import SpecState, speculative_runtimes

    target = TransformersModel(tiny_model("llama", 0).to(device=device, dtype=dtype))
    draft = TransformersModel(nudge(tiny_model("llama", draft_seed), draft_noise, 5).to(device=device, dtype=dtype))
    cfg = target.runtime_config(block_size=16, num_blocks=max(64, 2 * requests + 8), max_num_seqs=requests,
                                max_num_tokens=max(64, 8 * requests), max_model_len=256, speculative=True,
                                sampling=sampled)
    state = SpecState(requests, k, device, vocab=target.hf.config.vocab_size if sampled else None)
    runtimes = speculative_runtimes(cfg, state, target, draft, device=device, **rt_kw)
    plain = Runtime(cfg, target, num_layers=target.num_layers, device=device)
    return cfg, state, runtimes, plain


def run_speculative(runtimes, prompts, blocks, k: int, iterations: int, state=None, sampling=None):
    """Prefill both models, then ``iterations`` of draft (k steps) and verify
    (``graphrt.speculative.SpeculativeLoop``); each verify's outputs stay on the device."""
    from graphrt.speculative import SpeculativeLoop

    loop = SpeculativeLoop(state, *runtimes)
    loop.prefill(prompts, blocks, sampling=sampling)
    outputs = [loop.iterate() for _ in range(iterations)]
    if state.length.device.type == "cpu":       # every count has landed: the bounds are the lengths
        loop.settle()
        assert loop.bounds == state.length[: len(prompts)].tolist()
        # and the tokens streamed through the host ring are the verify steps' outputs
        assert loop.tokens == [sum((e[r, : int(c[r])].tolist() for e, c in outputs), []) for r in range(len(prompts))]
    return outputs


def greedy_tokens(plain, prompts, blocks, n: int) -> list[list[int]]:
    from graphrt import SeqStep, Step

    logits = plain.step(Step([SeqStep(q_len=len(p), context_len=0, block_ids=b) for p, b in zip(prompts, blocks)]),
                        np.concatenate(prompts))
    out = [[int(t)] for t in logits[: len(prompts)].argmax(-1).tolist()]
    for j in range(n - 1):
        logits = plain.step(Step([SeqStep(q_len=1, context_len=len(p) + j, block_ids=b)
                                  for p, b in zip(prompts, blocks)]), [o[-1] for o in out])
        for o, t in zip(out, logits[: len(prompts)].argmax(-1).tolist()):
            o.append(int(t))
    return out


@pytest.mark.parametrize("draft_seed,noise,k", [
    pytest.param(0, 0.0, 3, id="draft-is-target"),
    pytest.param(1, 0.0, 3, id="other-draft"),
    pytest.param(0, NOISE, 3, id="noisy-draft"),
    pytest.param(0, 0.0, 1, id="one-draft"),
])
def test_speculative_loop_gives_the_targets_greedy_tokens(draft_seed, noise, k, device):
    """Draft, verify, draft ... with the host staging upper bounds only: the tokens are the
    target's plain greedy decoding (checked with transformers 5.25)."""
    cfg, state, runtimes, plain = speculative_setup(device, torch.float32, draft_seed, k, noise)
    rng, _ = rngs(fresh_seed())
    prompts = [rng.integers(0, 64, n) for n in (7, 12, 9)]
    blocks = [list(range(16 * r, 16 * r + 16)) for r in range(3)]
    iterations = 5
    outputs = run_speculative(runtimes, prompts, blocks, k, iterations, state)
    got = [[] for _ in prompts]
    accepted = []
    for emitted, counts in outputs:
        for r in range(len(prompts)):
            got[r] += emitted[r, : int(counts[r])].tolist()
            accepted.append(int(counts[r]) - 1)
    want = greedy_tokens(plain, prompts, [list(range(48 + 5 * r, 48 + 5 * r + 5)) for r in range(3)],
                         max(len(g) for g in got))
    for r in range(len(prompts)):
        assert got[r] == want[r][: len(got[r])], f"request {r}: speculative {got[r]}, greedy {want[r]}"
        assert int(state.length[r]) == len(prompts[r]) + len(got[r])
    if draft_seed == 0 and not noise:       # the draft is the target: every draft accepted
        assert accepted == [k] * len(accepted), accepted
    else:
        assert sum(accepted) < k * len(accepted), f"a different draft had every draft accepted: {accepted}"
    if noise:                               # some accepted, some not: the correction path ran
        assert 0 < sum(accepted) and min(accepted) < k, accepted


@pytest.mark.parametrize("n", [3, 1], ids=["three-requests", "one-request"])
def test_sampled_loop_at_temperature_zero_gives_the_targets_greedy_tokens(n, device):
    """A sampled state whose requests sample greedily: rejection sampling over one-hot
    distributions is the greedy rule (a draft is accepted iff it is the argmax, and the token
    after is the argmax), so the tokens are the target's greedy decoding. One request too:
    a sequence's settings spread over its K + 1 rows must stay a real (strided) tensor."""
    from graphrt.sampling import GREEDY

    k = 2
    cfg, state, runtimes, plain = speculative_setup(device, torch.float32, 0, k, NOISE, sampled=True, requests=n)
    rng, _ = rngs(fresh_seed())
    prompts = [rng.integers(0, 64, m) for m in (7, 12, 9)[:n]]
    blocks = [list(range(16 * r, 16 * r + 16)) for r in range(n)]
    outputs = run_speculative(runtimes, prompts, blocks, k, 4, state, sampling=[GREEDY] * n)
    got = [sum((e[r, : int(c[r])].tolist() for e, c in outputs), []) for r in range(n)]
    accepted = [int(c[r]) - 1 for _, c in outputs for r in range(n)]
    want = greedy_tokens(plain, prompts, [list(range(48 + 5 * r, 48 + 5 * r + 5)) for r in range(n)],
                         max(len(g) for g in got))
    for r in range(n):
        assert got[r] == want[r][: len(got[r])], f"request {r}: speculative {got[r]}, greedy {want[r]}"
    if n > 1:                               # enough rounds that the noisy draft is both kept and refused
        assert 0 < sum(accepted) and min(accepted) < k, accepted


def test_sampled_loop_draws_from_the_targets_distribution(device):
    """64 requests with one prompt and their own seeds (temperature 1, top-k 3), a draft
    near the target: the pairs (t0, t1) the loop emits first (t0 drawn by the target's
    prompt step, t1 the draft when accepted, else the verify's draw) follow the target's
    own sampling: P(t0) P(t1 | t0) from transformers' forward of the target (fp32) and the
    float64 kept sets (chi-square at significance 0.001; the seeds are fixed). Both of the
    verify's paths ran (some first drafts accepted, some not). Checked with transformers
    5.25."""
    from graphrt.kernels import reference
    from graphrt.sampling import SamplingParams

    k, n, runs = 1, 64, 3
    cfg, state, runtimes, _ = speculative_setup(device, torch.float32, 0, k, NOISE, sampled=True, requests=n)
    prompt = np.array([5, 9, 33])
    blocks = [[2 * r, 2 * r + 1] for r in range(n)]
    pairs, first_accepted = [], []
    for run in range(runs):
        settings = [SamplingParams(temperature=1.0, top_k=3, seed=1000 * run + r) for r in range(n)]
        (emitted, counts), = run_speculative(runtimes, [prompt] * n, blocks, k, 1, state, sampling=settings)
        for r in range(n):
            c = int(counts[r])
            t1 = int(emitted[r, 1]) if c >= 2 else int(state.tokens[r, 1])     # d_1, or the verify's draw
            pairs.append((int(emitted[r, 0]), t1))
            first_accepted.append(c >= 2)
    assert 0 < sum(first_accepted) < len(first_accepted), f"accepted first drafts: {sum(first_accepted)}"
    # the target's distributions, from transformers' own forward
    from graphrt.integrations.tiny import tiny_model

    hf = tiny_model("llama", 0).float().eval()

    def dist(ids) -> torch.Tensor:
        with torch.no_grad():
            row = hf(torch.as_tensor(np.asarray(ids))[None]).logits[0, -1]
        return reference.sampling_keep(row, 1.0, 3, 1.0, 0.0)[1]
    p0 = dist(prompt)
    expected, observed = [], []
    for t0 in torch.nonzero(p0).flatten().tolist():
        p1 = dist(list(prompt) + [t0])
        for t1 in torch.nonzero(p1).flatten().tolist():
            expected.append(len(pairs) * float(p0[t0] * p1[t1]))
            observed.append(sum(1 for pair in pairs if pair == (t0, t1)))
    assert sum(observed) == len(pairs), "a pair outside the target's kept sets"
    expected, observed = torch.tensor(expected, dtype=torch.float64), torch.tensor(observed, dtype=torch.float64)
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, (f"chi-square {stat:.1f} on {dof} degrees of freedom: p = {p_value:.2e}; "
                            f"observed {observed.tolist()}, expected {[round(e, 1) for e in expected.tolist()]}")


@pytest.mark.gpu
def test_speculative_loop_replays_with_one_copy_a_step_and_no_sync():
    """The same loop from captured graphs in strict mode (bf16): one pinned copy a step,
    no host sync over four iterations (profiler-counted), the target's greedy tokens."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from graphrt.profiling import count_transfers

    dev = torch.device("cuda")
    k, iterations = 3, 4
    cfg, state, runtimes, plain = speculative_setup(dev, torch.bfloat16, 0, k, NOISE, strict=True)
    for i, rt in enumerate(runtimes):     # the verify runtime (second) with a verify bucket too
        rt.capture(decode_buckets=[4], mixed_buckets=[16, 64], quiet=True,
                   **(dict(verify_buckets=[4], drafts=k) if i == 1 else {}))
    rng, _ = rngs(fresh_seed())
    prompts = [rng.integers(0, 64, n) for n in (7, 12, 9)]
    blocks = [list(range(16 * r, 16 * r + 16)) for r in range(3)]
    run_speculative(runtimes, prompts, blocks, k, 1, state)            # warm-up (the prefill resets the rows)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("graphrt_steps"):
            outputs = run_speculative(runtimes, prompts, blocks, k, iterations, state)
        torch.cuda.synchronize()
    assert all(rt.last.mode == "replay" for rt in runtimes), [rt.last for rt in runtimes]
    assert runtimes[1].last.bucket.kind == "verify", runtimes[1].last
    counted = count_transfers(prof, "graphrt_steps")
    steps = 2 + iterations * (k + 1)
    assert counted.h2d_pinned == steps and counted.h2d_pageable == 0 and counted.syncs == 0, counted
    got = [[] for _ in prompts]
    for emitted, counts in outputs:
        for r in range(len(prompts)):
            got[r] += emitted[r, : int(counts[r])].tolist()
    want = greedy_tokens(plain, prompts, [list(range(48 + 5 * r, 48 + 5 * r + 5)) for r in range(3)],
                         max(len(g) for g in got))
    for r in range(len(prompts)):
        assert got[r] == want[r][: len(got[r])], f"request {r}: speculative {got[r]}, greedy {want[r]}"


def test_rejection_acceptance_emits_the_targets_distribution(device):
    """One draft (K = 1) from a draft distribution unlike the target's: the first emitted
    token (the draft when accepted, else the resampled one) follows the target's
    distribution (chi-square at significance 0.001 over 40000 rows, fixed seeds), and the
    acceptance rate is sum_x min(p(x), q(x))."""
    from graphrt.kernels.speculative import accept_rejection

    gen = torch.Generator().manual_seed(4)
    s, v = 40000, 8
    p = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02], dtype=torch.float64)
    q = torch.tensor([0.05, 0.05, 0.30, 0.30, 0.10, 0.10, 0.05, 0.05], dtype=torch.float64)
    target = torch.stack([p, p.flip(0)])[None].expand(s, 2, v).contiguous()          # [S, 2, V]
    draft = q[None, None].expand(s, 1, v).contiguous()                               # [S, 1, V]
    ids = torch.multinomial(q, s, replacement=True, generator=gen)[:, None]          # [S, 1]
    u = torch.rand(s, 2, generator=gen, dtype=torch.float64)
    accepted, nxt = accept_rejection(target.to(device), draft.to(device), ids.to(device), u.to(device))
    accepted, nxt = accepted.cpu(), nxt.cpu()
    first = torch.where(accepted == 1, ids[:, 0], nxt)
    counts = torch.bincount(first, minlength=v).double()
    expected = s * p
    stat = float(((counts - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((v - 1) / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {v - 1} degrees of freedom: p = {p_value:.2e}"
    rate, want = float(accepted.double().mean()), float(torch.minimum(p, q).sum())
    assert abs(rate - want) < 4 * (want * (1 - want) / s) ** 0.5, (rate, want)
    # every draft accepted: the token after them comes from the last distribution
    sure = accept_rejection(target.to(device), target[:, :1].contiguous().to(device),
                            torch.zeros(s, 1, dtype=torch.int64, device=device), u.to(device))
    assert bool((sure[0] == 1).all())
    bonus = torch.bincount(sure[1].cpu(), minlength=v).double()
    stat = float(((bonus - s * p.flip(0)) ** 2 / (s * p.flip(0))).sum())
    assert float(torch.special.gammaincc(torch.tensor((v - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))) > 1e-3, stat


def test_accept_rejection_refuses_bad_shapes(device):
    from graphrt.kernels.speculative import accept_rejection

    t = torch.zeros(2, 3, 5, device=device)
    with pytest.raises(ValueError, match=r"draft_probs must be \[2, 2, 5\]"):
        accept_rejection(t, torch.zeros(2, 3, 5, device=device), torch.zeros(2, 2, dtype=torch.int64, device=device),
                         torch.zeros(2, 3, device=device))
    with pytest.raises(ValueError, match=r"uniforms must be \[2, 3\]"):
        accept_rejection(t, torch.zeros(2, 2, 5, device=device), torch.zeros(2, 2, dtype=torch.int64, device=device),
                         torch.zeros(2, 2, device=device))
