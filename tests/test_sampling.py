"""graphrt.kernels.sampling.sample (a row's next token from its logits, settings read from
device tensors) against the float64 reference (kernels/reference.py: sorting, the same
Philox uniforms), transformers' own logits warpers (the kept sets) and the softmax it
should draw from (a chi-square test); SamplingParams' checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _cases import fresh_seed, rngs
from graphrt.kernels import reference
from graphrt.kernels.sampling import greedy, kept_lowest, kept_probs, philox_uniform, sample, uniforms
from graphrt.sampling import GREEDY, SamplingParams

HAS_CUDA = torch.cuda.is_available()


def settings(rows: list[tuple], device) -> dict:
    """Device tensors of per-row (temperature, top_k, top_p, min_p, seed, counter)."""
    cols = list(zip(*rows))
    return dict(temperature=torch.tensor(cols[0], dtype=torch.float32, device=device),
                top_k=torch.tensor(cols[1], dtype=torch.int32, device=device),
                top_p=torch.tensor(cols[2], dtype=torch.float32, device=device),
                min_p=torch.tensor(cols[3], dtype=torch.float32, device=device),
                seed=torch.tensor(cols[4], dtype=torch.int64, device=device),
                counter=torch.tensor(cols[5], dtype=torch.int64, device=device))


def kept(logits: torch.Tensor, lowest: torch.Tensor) -> torch.Tensor:
    """[S, V] bool: the kernel's kept set, every logit at or above its row's lowest kept."""
    x = logits.float().cpu().nan_to_num(nan=-math.inf, neginf=-math.inf)
    return (x >= lowest.cpu()[:, None]) & (x > -math.inf)


def draw_gap(row: torch.Tensor, keep: torch.Tensor, t: float, seed: int, counter: int) -> float:
    """How far apart the reference's two best Gumbel scores are (a near tie may go either way
    between the kernel's fp32 and the reference's float64)."""
    x = row.double().nan_to_num(nan=-math.inf, neginf=-math.inf)
    u = torch.from_numpy(philox_uniform(seed, counter, np.arange(row.shape[0]))).double()
    g = torch.where(keep, (x - x.max()) / t - torch.log(-torch.log(u)), -math.inf).sort(descending=True).values
    return float(g[0] - g[1]) if keep.sum() > 1 else math.inf


def assert_draws(logits: torch.Tensor, args: dict, ids: torch.Tensor, lowest: torch.Tensor, rows: list[tuple],
                 label: str) -> None:
    """The kernel's draws ``ids`` and kept sets (``lowest``) for ``rows``' settings against
    the float64 reference: greedy rows its first maximum; the others its kept set, its draw
    (or a near tie of Gumbel scores), a token inside the set."""
    ref = reference.sample(logits.cpu(), *(args[k].cpu() for k in ("temperature", "top_k", "top_p", "min_p",
                                                                     "seed", "counter")))
    got = kept(logits, lowest)
    for i, (t, k, p, mp, sd, c) in enumerate(rows):
        if t == 0:
            assert int(ids[i]) == int(ref[i]), f"{label} row {i}: greedy"
            continue
        keep, _ = reference.sampling_keep(logits[i].cpu(), t, k, p, mp)
        assert torch.equal(got[i], keep), (f"{label} row {i} {rows[i]}: kept {int(got[i].sum())} tokens, the "
                                           f"reference {int(keep.sum())}; differ at "
                                           f"{torch.nonzero(got[i] != keep).flatten()[:8].tolist()}")
        if int(ids[i]) != int(ref[i]):
            assert draw_gap(logits[i].cpu(), keep, t, sd, c) < 1e-4, \
                f"{label} row {i} {rows[i]}: drew {int(ids[i])}, the reference {int(ref[i])}"
        assert bool(keep[int(ids[i])]), f"{label} row {i}: drew {int(ids[i])} outside the kept set"


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 1000, 2500], ids=lambda v: f"V{v}")
def test_sample_matches_reference(dtype, vocab, device):
    seed = fresh_seed()
    rng, gen = rngs(seed)
    s = 12
    logits = (torch.randn(s, vocab, generator=gen) * 3).to(device=device, dtype=dtype)
    logits[3, : vocab // 2] = -math.inf                     # a masked part of the vocabulary
    rows = [(float(rng.choice([0.0, 0.3, 1.0, 2.0])), int(rng.choice([0, 1, 5, vocab, vocab + 3])),
             float(rng.choice([1.0, 0.9, 0.5, 0.05])), float(rng.choice([0.0, 0.1, 0.5])),
             int(rng.integers(0, 2 ** 62)), int(rng.integers(0, 2 ** 40))) for _ in range(s)]
    rows[0] = (1.0, 0, 1.0, 0.0, 7, 0)                      # plain sampling
    rows[1] = (0.0, 0, 1.0, 0.0, 7, 0)                      # greedy
    args = settings(rows, device)
    lowest = torch.empty(s, dtype=torch.float32, device=device)
    ids = sample(logits, **args, lowest=lowest)
    assert_draws(logits, args, ids, lowest, rows, f"seed {seed}")
    for i, row in enumerate(rows):      # greedy: the first maximum (lowest is the maximum, which ties share)
        if row[0] == 0:
            assert int(ids[i]) == int(torch.argmax(logits[i].float().cpu())), f"row {i} (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 1000, 1025, 40000], ids=lambda v: f"V{v}")
def test_greedy_is_the_first_maximum(dtype, vocab, device):
    """``greedy`` against ``torch.argmax`` (the first maximum) on float64 copies: random
    rows, rows of ties (small integers), masked rows, a row strided out of a wider tensor,
    and every grouping of the chunks giving the same answer."""
    from graphrt.kernels.sampling import chunking

    seed = fresh_seed()
    _, gen = rngs(seed)
    s = 9
    wide = torch.randn(s, vocab + 5, generator=gen, dtype=torch.float64) * 3
    wide[1] = torch.randint(0, 3, (vocab + 5,), generator=gen).double()      # many ties at the maximum
    wide[2, : vocab // 2] = -math.inf                                          # a masked half
    wide[3] = -math.inf                                                        # nothing finite: 0
    wide[4, -6] = 1e4                                                          # the last column
    logits = wide.to(device=device, dtype=dtype)[:, :vocab]                   # rows strided by vocab + 5
    want = torch.argmax(logits.double().cpu(), dim=1)
    want[3] = 0
    got = greedy(logits)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), \
        f"seed {seed}: rows {torch.nonzero(got.cpu() != want).flatten().tolist()} differ"
    chunks = chunking(vocab)[2]
    for group in sorted({1, 3, chunks}):
        assert torch.equal(greedy(logits, group=group).cpu(), want), f"group {group} (seed {seed})"
    out = torch.full((s,), -1, dtype=torch.int64, device=device)
    assert greedy(logits, out=out) is out and torch.equal(out.cpu(), want)
    from graphrt.kernels import ops
    assert torch.equal(ops.greedy(logits).cpu(), want)        # torch.ops.graphrt.greedy


def test_greedy_takes_nan_as_minus_infinity_and_refuses_bad_input(device):
    nan, ninf = math.nan, -math.inf
    rows = torch.tensor([[nan, 1.0, nan], [nan, nan, nan], [ninf, nan, -2.0], [3.0, 3.0, nan]], device=device)
    assert greedy(rows).tolist() == [1, 0, 2, 0]
    assert greedy(torch.zeros(0, 8, device=device)).shape == (0,)
    with pytest.raises(ValueError, match="logits must have 2 dims"):
        greedy(torch.zeros(8, device=device))
    with pytest.raises(ValueError, match="at least one column"):
        greedy(torch.zeros(2, 0, device=device))
    with pytest.raises(ValueError, match="contiguous last dim"):
        greedy(torch.zeros(8, 2, device=device).t())
    with pytest.raises(TypeError, match="logits must have dtype"):
        greedy(torch.zeros(2, 8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="out must have 2 entries"):
        greedy(torch.zeros(2, 8, device=device), out=torch.zeros(3, dtype=torch.int64, device=device))
    for group in (0, 1.5, True):
        with pytest.raises(ValueError, match="group must be an int >= 1"):
            greedy(torch.zeros(2, 8, device=device), group=group)


def test_chunks_walked_together_or_apart_draw_the_same(device):
    """A program walks one chunk of a row or several (``group``, chosen from the batch): the
    kept sets and the draws are the same to the bit, and they are the reference's, also
    where whole chunks lie below a threshold (those chunks are not read)."""
    from graphrt.kernels.sampling import chunking

    seed = fresh_seed()
    rng, gen = rngs(seed)
    vocab, s = 5000, 8
    _, chunk, chunks = chunking(vocab)
    assert chunks == 5
    logits = (torch.randn(s, vocab, generator=gen) * 2).to(device)
    logits[:, chunk: 3 * chunk] -= 30.0          # two chunks far below every row's top set
    logits[2, : 2 * chunk] = -math.inf           # and a row whose first chunks are all masked
    rows = [(float(rng.choice([0.5, 1.0, 1.5])), int(rng.choice([0, 1, 7, 60])), float(rng.choice([1.0, 0.9, 0.3])),
             float(rng.choice([0.0, 0.05])), int(rng.integers(0, 2 ** 62)), int(rng.integers(0, 2 ** 40)))
            for _ in range(s)]
    rows[0] = (0.0, 0, 1.0, 0.0, 1, 1)                       # greedy beside them
    args = settings(rows, device)
    got = {}
    for group in (1, 2, 5):
        lowest = torch.empty(s, dtype=torch.float32, device=device)
        got[group] = (sample(logits, **args, lowest=lowest, group=group).cpu(), lowest.cpu())
    for group in (2, 5):
        assert torch.equal(got[group][0], got[1][0]), f"group {group} (seed {seed})"
        assert torch.equal(got[group][1], got[1][1]), f"group {group} (seed {seed})"
    ids, lowest = got[1]
    assert_draws(logits, args, ids, lowest, rows, f"seed {seed}")
    keep_all = kept(logits, lowest)
    for i, (t, k, p, mp, _, _) in enumerate(rows):
        if t > 0 and (k or p < 1 or mp > 0):    # a filter is on: the low chunks keep nothing
            assert not keep_all[i, chunk: 3 * chunk].any(), f"row {i} {rows[i]}: the low chunks hold a kept token"


def test_radix_levels_skip_empty_chunks_and_any_tile_selects_the_same(device):
    """The radix selects (top-k's, top-p's) read at each level only the chunks that held a
    candidate in the digit the level before kept: with each row's top set in one chunk
    and many chunks, the kept sets and draws are the reference's, and the same to the bit
    whatever tile the levels read in (the counts are exact; the masses are summed in
    another order, which could move top-p's threshold only at a mass within rounding of
    p times the total)."""
    from graphrt.kernels.sampling import _passes, chunking

    seed = fresh_seed()
    rng, gen = rngs(seed)
    vocab, s = 6000, 6
    _, chunk, chunks = chunking(vocab)
    assert chunks == 6
    # small integers: many ties, and the thresholds are logits of a few values
    logits = torch.randint(-8, 0, (s, vocab), generator=gen).float()
    for i in range(s):                    # each row's top set in a chunk of its own
        c = int(rng.integers(0, chunks))
        logits[i, c * chunk: c * chunk + 40] += torch.randint(4, 9, (40,), generator=gen).float()
    logits = logits.to(device)
    rows = [(1.0, int(rng.choice([3, 10, 25])), float(rng.choice([1.0, 0.8, 0.5])), 0.0,
             int(rng.integers(0, 2 ** 62)), int(rng.integers(0, 2 ** 40))) for _ in range(s)]
    rows[0] = (1.0, 0, 0.6, 0.0, 3, 5)                      # top-p alone
    args = settings(rows, device)
    got = []
    for radix in (None, (256, 4), (128, 2)):
        ids = torch.empty(s, dtype=torch.int64, device=device)
        lowest = torch.empty(s, dtype=torch.float32, device=device)
        _passes(logits, *(args[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed", "counter")), ids,
                lowest, None, radix=radix)
        assert_draws(logits, args, ids, lowest, rows, f"radix {radix} (seed {seed})")
        got.append((ids.cpu(), lowest.cpu()))
    for (ids, lowest), radix in zip(got[1:], ((256, 4), (128, 2))):
        assert torch.equal(ids, got[0][0]) and torch.equal(lowest, got[0][1]), f"radix {radix} (seed {seed})"


def test_select_bounds_from_chunk_maxima_and_shared_digits(device):
    """Top-k's select starts from the k-th largest chunk maximum where k is at most the
    chunk count, and a select skips the levels whose digit its bounds share: the kept sets
    and draws stay the reference's at k = 1, at the chunk count and one past it, with ties
    among the chunk maxima, with masked chunks below the bound, and with every logit of a
    row in one binade (bounds that share most digits), and where the chunk maxima are the
    top logits (the bound is the threshold)."""
    from graphrt.kernels.sampling import chunking

    seed = fresh_seed()
    rng, gen = rngs(seed)
    vocab = 40000
    _, chunk, chunks = chunking(vocab)
    assert chunks == 40
    logits = torch.randn(8, vocab, generator=gen) * 2
    logits[3] = torch.randint(-5, 5, (vocab,), generator=gen).float()              # ties everywhere
    logits[4] = 1.0 + torch.rand(vocab, generator=gen) * 2 ** -9                     # one binade, close
    logits[5] = -3.0 - torch.rand(vocab, generator=gen)                              # all negative
    logits[6, : chunks // 2 * chunk] = -math.inf                                     # half the chunks masked
    # one spike a chunk, far above the rest (two chunks' alike): the chunk maxima are the
    # top logits, so the k-th largest maximum is the threshold itself
    logits[7] = -10.0 - torch.rand(vocab, generator=gen)
    spikes = 5.0 + 0.25 * torch.randperm(chunks, generator=gen).float()
    spikes[int(rng.integers(0, chunks))] = spikes[int(rng.integers(0, chunks))]
    for c in range(chunks):
        logits[7, c * chunk + int(rng.integers(0, min(chunk, vocab - c * chunk)))] = spikes[c]
    logits = logits.to(device)
    k_of = [1, chunks, chunks + 1, 3, 7, 20, 25, int(rng.integers(2, chunks))]
    rows = [(float(rng.choice([0.7, 1.0])), k, float(rng.choice([1.0, 0.9, 0.5])), 0.0,
             int(rng.integers(0, 2 ** 62)), int(rng.integers(0, 2 ** 40))) for k in k_of]
    args = settings(rows, device)
    lowest = torch.empty(len(rows), dtype=torch.float32, device=device)
    ids = sample(logits, **args, lowest=lowest)
    assert_draws(logits, args, ids, lowest, rows, f"seed {seed}")


def test_short_path_serves_bounded_rows_and_selects_as_the_radix_passes(device):
    """The short path (the logits at or above top-k's chunk-maximum bound copied to a list,
    sorted, both thresholds read off it) serves exactly the rows it may (sampling, top-k on
    with k at most the chunk count, a list that holds every candidate) and gives their kept
    sets and draws to the bit as the radix passes do (forced with a list of two), both the
    reference's: random rows, ties everywhere, one binade, masked chunks, spikes that make
    the bound the threshold, top-p on and off; a row with too many candidates, k past the
    chunk count, top-k off and greedy take the radix passes or none."""
    import triton

    from graphrt.kernels.sampling import CANDIDATES, _collect_kernel, _max_kernel, _passes, _select_kernel, chunking

    seed = fresh_seed()
    rng, gen = rngs(seed)
    vocab = 20000
    block, chunk, chunks = chunking(vocab)
    s = 11
    logits = torch.randn(s, vocab, generator=gen) * 2
    logits[3] = torch.randint(-5, 5, (vocab,), generator=gen).float()              # ties everywhere
    logits[4] = 1.0 + torch.rand(vocab, generator=gen) * 2 ** -9                     # one binade, close
    logits[5, : chunks // 2 * chunk] = -math.inf                                     # half the chunks masked
    logits[6] = -10.0 - torch.rand(vocab, generator=gen)                             # one spike a chunk
    for c in range(chunks):
        logits[6, c * chunk + int(rng.integers(0, min(chunk, vocab - c * chunk)))] = 5.0 + 0.25 * c
    logits = logits.to(device)
    ps = [1.0, 0.9, 0.5, 0.05]
    rows = [(float(rng.choice([0.7, 1.0, 2.0])), int(rng.choice([1, 5, 12, chunks])), float(rng.choice(ps)),
             float(rng.choice([0.0, 0.1])), int(rng.integers(0, 2 ** 62)), int(rng.integers(0, 2 ** 40)))
            for _ in range(s)]
    rows[3] = (1.0, chunks, 0.9, 0.0, 1, 2)            # ties: thousands of logits at the bound, more than the list
    rows[8] = (1.0, chunks + 1, float(rng.choice(ps)), 0.0, 3, 4)     # no bound from the chunk maxima
    rows[9] = (1.0, 0, 0.9, 0.0, 5, 6)                 # top-p alone
    rows[10] = (0.0, 5, 0.9, 0.0, 7, 8)                # greedy
    rows[0] = (1.0, 5, 0.9, 0.05, 9, 10)              # served by the short path (random logits: few candidates)
    args = settings(rows, device)
    keys = ("temperature", "top_k", "top_p", "min_p", "seed", "counter")
    # which rows the short path serves, from its own launches
    pmax = torch.empty(s, chunks, dtype=torch.float32, device=device)
    pidx = torch.empty(s, chunks, dtype=torch.int32, device=device)
    count, fast = (torch.full((s,), 7, dtype=torch.int32, device=device) for _ in range(2))
    cand, fthr = torch.empty(s, CANDIDATES, device=device), torch.empty(s, dtype=torch.int64, device=device)
    cp = triton.next_power_of_2(chunks)
    grid = (s, chunks)
    rowargs = (logits, logits.stride(0), vocab, chunk, chunks, 1)
    _max_kernel[grid](*rowargs, pmax, pidx, count, COUNT=True, BLOCK=block)
    _collect_kernel[grid](*rowargs, args["temperature"], args["top_k"], pmax, pidx, count, cand, CAP=CANDIDATES, CP=cp,
                          BLOCK=block)
    _select_kernel[(s,)](args["temperature"], args["top_k"], args["top_p"], pmax, pidx, count, cand, fast, fthr,
                         vocab, chunks, CAP=CANDIDATES, CP=cp)
    x = logits.double().cpu()
    for i, (t, k, *_rest) in enumerate(rows):
        bounded = t > 0 and 0 < k <= chunks
        if bounded:         # the count: every logit at or above the k-th largest chunk maximum
            bound = pmax[i].cpu().double().sort(descending=True).values[k - 1]
            assert int(count[i]) == int((x[i] >= bound).sum()), f"row {i} (seed {seed})"
        want = int(bounded and int(count[i]) <= CANDIDATES)
        assert int(fast[i]) == want, f"row {i}: fast {int(fast[i])}, want {want} (seed {seed})"
    assert int(fast[3]) == 0 and int(fast[0]) == 1, f"seed {seed}"
    got = []
    for candidates in (CANDIDATES, 2):
        ids = torch.empty(s, dtype=torch.int64, device=device)
        lowest = torch.empty(s, dtype=torch.float32, device=device)
        _passes(logits, *(args[k] for k in keys), ids, lowest, None, candidates=candidates)
        assert_draws(logits, args, ids, lowest, rows, f"candidates {candidates} (seed {seed})")
        got.append((ids.cpu(), lowest.cpu()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), f"seed {seed}"
    with pytest.raises(ValueError, match="candidates must be a power of two"):
        _passes(logits, *(args[k] for k in keys), ids, lowest, None, candidates=100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 2500], ids=lambda v: f"V{v}")
def test_kept_lowest_is_what_sample_keeps(dtype, vocab, device):
    """``kept_lowest`` (the filters' passes without the draw, a verify's kept sets) writes
    the very ``lowest`` that ``sample`` gives beside its draw, at every grouping of chunks,
    into a given ``out`` or a new tensor; bad ``out`` refused before a launch."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    s = 10
    logits = (torch.randn(s, vocab, generator=gen) * 3).to(device=device, dtype=dtype)
    logits[4, : vocab // 2] = -math.inf
    logits[5] = -math.inf                                    # nothing finite
    rows = [(float(rng.choice([0.0, 0.4, 1.0])), int(rng.choice([0, 1, 6, vocab + 1])),
             float(rng.choice([1.0, 0.8, 0.2])), float(rng.choice([0.0, 0.1])), int(rng.integers(0, 2 ** 62)),
             int(rng.integers(0, 2 ** 40))) for _ in range(s)]
    rows[0] = (0.0, 0, 1.0, 0.0, 3, 3)                       # greedy: lowest is the maximum
    args = settings(rows, device)
    want = torch.empty(s, dtype=torch.float32, device=device)
    sample(logits, **args, lowest=want)
    filters = {k: args[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    for group in (1, 3):
        out = torch.full((s,), 123.0, device=device)
        assert kept_lowest(logits, **filters, out=out, group=group) is out
        assert torch.equal(out.cpu(), want.cpu()), f"group {group} (seed {seed})"
    assert torch.equal(kept_lowest(logits, **filters).cpu(), want.cpu()), f"seed {seed}"
    out = torch.full((s,), 123.0, device=device)
    for bad, error, match in ((out[:-1], ValueError, "out must have 10 entries"),
                              (out.double(), TypeError, "out must have dtype")):
        with pytest.raises(error, match=match):
            kept_lowest(logits, **filters, out=bad)
    with pytest.raises(ValueError, match="top_p must have one entry per row"):
        kept_lowest(logits, **{**filters, "top_p": filters["top_p"][:2]}, out=out)
    assert bool((out == 123.0).all()), "a refused call wrote out"


@pytest.mark.parametrize("case", [
    pytest.param((0.7, 0, 1.0, 0.0), id="temperature"),
    pytest.param((1.0, 10, 1.0, 0.0), id="top-k"),
    pytest.param((1.3, 0, 0.8, 0.0), id="top-p"),
    pytest.param((1.0, 0, 1.0, 0.05), id="min-p"),
    pytest.param((0.8, 40, 0.9, 0.02), id="all-three"),
    pytest.param((1.0, 1, 1.0, 0.0), id="top-k-1"),
    pytest.param((2.0, 0, 1e-6, 0.0), id="top-p-tiny"),
])
def test_kept_set_matches_transformers(case, device):
    """The kept set equals transformers' warpers in generate's order (temperature, top-k,
    top-p, min-p), checked with transformers 5.25 and 5.17."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    t, k, p, mp = case
    seed = fresh_seed()
    _, gen = rngs(seed)
    logits = torch.randn(6, 300, generator=gen) * 2.5
    logits[2, 100:] = -math.inf
    scores = lp.TemperatureLogitsWarper(t)(None, logits.clone())
    if k:
        scores = lp.TopKLogitsWarper(k)(None, scores)
    if p < 1:
        scores = lp.TopPLogitsWarper(p)(None, scores)
    if mp:
        scores = lp.MinPLogitsWarper(mp)(None, scores)
    theirs = scores > -math.inf
    lowest = torch.empty(6, device=device)
    sample(logits.to(device), **settings([(t, k, p, mp, 1, 2)] * 6, device), lowest=lowest)
    ours = kept(logits, lowest)
    assert torch.equal(ours, theirs), f"seed {seed}: {(ours != theirs).sum(1).tolist()} tokens differ per row"


@pytest.mark.parametrize("case,n", [
    pytest.param((1.5, 0, 1.0, 0.0), 2000, id="plain"),
    pytest.param((1.0, 0, 1.0, 0.05), 2000, id="min-p"),
    # top-k and top-p thresholds take 16 more passes a row: ~0.2 s a row in the interpreter
    pytest.param((0.8, 10, 0.9, 0.02), 20000, id="all-three", marks=pytest.mark.gpu),
])
def test_draws_follow_the_kept_softmax(case, n, device):
    """n draws of one row (counters 0..n-1) against the reference's renormalised softmax
    over the kept set: a chi-square test at significance 0.001 (the draws are a fixed
    function of seed and counter, so the outcome is the same on every run), and no draw
    outside the kept set."""
    t, k, p, mp = case
    logits = torch.linspace(-2.0, 2.0, 24)[torch.randperm(24, generator=torch.Generator().manual_seed(3))]
    args = settings([(t, k, p, mp, 11, c) for c in range(n)], device)
    ids = sample(logits.to(device)[None, :].expand(n, 24), **args).cpu()
    keep, probs = reference.sampling_keep(logits, t, k, p, mp)
    counts = torch.bincount(ids, minlength=24).double()
    assert counts[~keep].sum() == 0, f"drew outside the kept set: {torch.nonzero(counts * ~keep).flatten().tolist()}"
    expected = n * probs[keep]
    assert expected.min() >= 5, "the case needs >= 5 expected draws per kept token for the test to hold"
    assert int(keep.sum()) < 24 or mp == 0, "a filtering case must filter"
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom: p = {p_value:.2e}"


def test_sampling_edges(device):
    ninf = -math.inf
    cases = [   # (logits, (temperature, top_k, top_p, min_p), the ids every draw may give)
        ([1.0, 3.0, 3.0, 2.0], (0.0, 0, 1.0, 0.0), {1}),                     # greedy: the first maximum
        ([2.0, 2.0, 2.0, 2.0], (1.0, 1, 1.0, 0.0), {0, 1, 2, 3}),            # ties at the k-th all kept
        ([0.0, 5.0, 1.0, 2.0], (1.0, 1, 1.0, 0.0), {1}),                     # top-k 1
        ([0.0, 5.0, 1.0, 2.0], (1.0, 4, 1.0, 0.0), {0, 1, 2, 3}),            # k = vocab: off
        ([0.0, 5.0, 1.0, 2.0], (1.0, 99, 1.0, 0.0), {0, 1, 2, 3}),           # k > vocab: off
        ([0.0, 5.0, 1.0, 2.0], (1.0, 0, 1e-6, 0.0), {1}),                    # top-p: only the top token
        ([0.0, 9.0, 1.0, 2.0], (1.0, 0, 1.0, 0.9), {1}),                     # min-p: all but one filtered
        ([ninf, ninf, ninf], (1.0, 0, 1.0, 0.0), {0}),                       # nothing finite: 0
        ([math.nan, 1.0, math.nan], (1.0, 0, 1.0, 0.0), {1}),                # NaN counts as -inf
        ([ninf, 0.5, ninf, 0.2], (5.0, 0, 1.0, 0.0), {1, 3}),                # masked tokens never drawn
        ([4.0], (1.0, 3, 0.5, 0.5), {0}),                                    # one token
    ]
    for logits, (t, k, p, mp), allowed in cases:
        n = 32
        row = torch.tensor(logits, device=device)
        ids = sample(row[None, :].expand(n, row.shape[0]), **settings([(t, k, p, mp, 5, c) for c in range(n)], device))
        drawn = set(ids.tolist())
        assert drawn <= allowed, f"{logits} {(t, k, p, mp)}: drew {sorted(drawn)}, allowed {sorted(allowed)}"
        if len(allowed) > 1:      # 32 draws from two or more tokens: more than one of them
            assert len(drawn) > 1, f"{logits} {(t, k, p, mp)}: 32 draws all gave {drawn}"


def test_same_seed_and_counter_draw_the_same_token_in_any_batch(device):
    """A row's draw depends on its logits, settings, seed and counter only: not on the
    batch it shares or its place in it."""
    _, gen = rngs(fresh_seed())
    row = (torch.randn(500, generator=gen) * 2).to(device)
    mine = (0.9, 50, 0.95, 0.0, 1234, 77)
    alone = sample(row[None], **settings([mine], device))
    others = torch.randn(5, 500, generator=gen).to(device)
    batch = torch.cat([others[:3], row[None], others[3:]])
    rows = [(1.0, 0, 1.0, 0.0, i, i) for i in range(3)] + [mine] + [(0.5, 3, 1.0, 0.0, 9, 9)] * 2
    assert int(sample(batch, **settings(rows, device))[3]) == int(alone[0])
    # other counters draw other tokens (not one token for every counter)
    many = sample(row[None].expand(64, 500), **settings([(*mine[:5], c) for c in range(64)], device))
    assert len(set(many.tolist())) > 5


@pytest.mark.parametrize("vocab", [1, 17, 1000], ids=lambda v: f"V{v}")
def test_kept_probs_are_the_distribution_drawn_from(vocab, device):
    """kept_probs from the kernel's lowest kept logit equals the reference's float64 kept
    distribution, greedy rows and rows with nothing finite included."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    s = 10
    logits = (torch.randn(s, vocab, generator=gen) * 3).to(device)
    logits[2] = -math.inf                                   # nothing finite: one-hot at 0, as the draw
    logits[3, : vocab // 2] = -math.inf
    logits[4, -1] = math.nan
    rows = [(float(rng.choice([0.0, 0.3, 1.0, 2.0])), int(rng.choice([0, 1, 5, vocab + 3])),
             float(rng.choice([1.0, 0.9, 0.5])), float(rng.choice([0.0, 0.1])), int(rng.integers(0, 2 ** 62)),
             int(rng.integers(0, 2 ** 40))) for _ in range(s)]
    rows[1] = (0.0, 0, 1.0, 0.0, 7, 0)
    args = settings(rows, device)
    lowest = torch.empty(s, dtype=torch.float32, device=device)
    ids = sample(logits, **args, lowest=lowest)
    probs = kept_probs(logits, args["temperature"], lowest).cpu()
    assert probs.shape == (s, vocab) and probs.dtype == torch.float32
    for i, (t, k, p, mp, _, _) in enumerate(rows):
        _, want = reference.sampling_keep(logits[i].cpu(), t, k, p, mp)
        assert torch.allclose(probs[i].double(), want, atol=1e-6), f"row {i} {rows[i]} (seed {seed})"
        assert float(probs[i, int(ids[i])]) > 0, f"row {i}: drew {int(ids[i])}, of probability 0"


def test_uniforms_are_the_philox_stream(device):
    seed = torch.tensor([0, 7, 2 ** 62 + 5], device=device)
    counter = torch.tensor([0, 3, 2 ** 40 + 1], device=device)
    u = uniforms(seed, counter, 1500).cpu()
    assert u.shape == (3, 1500) and float(u.min()) >= 0 and float(u.max()) < 1
    for i in range(3):
        want = philox_uniform(int(seed[i]), int(counter[i]), np.arange(1500))
        assert np.array_equal(u[i].numpy(), want), i
    assert 0.45 < float(u.mean()) < 0.55
    with pytest.raises(ValueError, match="n must be an int"):
        uniforms(seed, counter, 0)
    with pytest.raises(ValueError, match="counter must have one entry per seed"):
        uniforms(seed, counter[:2], 4)
    with pytest.raises(TypeError, match="seed must have dtype"):
        uniforms(seed.int(), counter, 4)


def test_sample_refuses_bad_input(device):
    logits = torch.zeros(2, 8, device=device)
    good = settings([(1.0, 0, 1.0, 0.0, 0, 0)] * 2, device)
    with pytest.raises(TypeError, match="top_k must have dtype"):
        sample(logits, **{**good, "top_k": good["top_k"].long()})
    with pytest.raises(ValueError, match="seed must have one entry per row of logits"):
        sample(logits, **{**good, "seed": good["seed"][:1]})
    with pytest.raises(ValueError, match="logits must have 2 dims"):
        sample(logits[0], **good)
    with pytest.raises(ValueError, match="out must have 2 entries"):
        sample(logits, **good, out=torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="at least one column"):
        sample(torch.zeros(2, 0, device=device), **good)
    for group in (0, 1.5, True):
        with pytest.raises(ValueError, match="group must be an int >= 1"):
            sample(logits, **good, group=group)
    assert sample(torch.zeros(0, 8, device=device), **settings([(1.0, 0, 1.0, 0.0, 0, 0)], device)
                  | {k: v[:0] for k, v in good.items()}).shape == (0,)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
    (dict(temperature=math.nan), ValueError, "temperature must be finite"),
    (dict(temperature=1e-35), ValueError, "temperature must be 0 .greedy. or >= 1e-30"),
    (dict(temperature="1"), TypeError, "temperature must be a float"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.nan), ValueError, "top_p must be finite"),
    (dict(top_k=-1), ValueError, r"top_k must be in \[0, 2147483648\)"),
    (dict(top_k=2.0), TypeError, "top_k must be an int"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(min_p=1.0), ValueError, r"min_p must be in \[0, 1\)"),
    (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\)"),
    (dict(seed=-1), ValueError, "seed must be in"),
    (dict(seed=2 ** 63), ValueError, "seed must be in"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_sampling_params_refuse_bad_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_fill():
    n = 5
    arrays = dict(temperature=np.full(n, 9, np.float32), top_k=np.full(n, 9, np.int32),
                  top_p=np.full(n, 9, np.float32), min_p=np.full(n, 9, np.float32), seed=np.full(n, 9, np.int64))
    SamplingParams.fill([SamplingParams(0.7, 20, 0.9, 0.05, 3), GREEDY], **arrays)
    assert arrays["temperature"].tolist() == [pytest.approx(0.7), 0, 0, 0, 0]
    assert arrays["top_k"].tolist() == [20, 0, 0, 0, 0] and arrays["seed"].tolist() == [3, 0, 0, 0, 0]
    assert arrays["top_p"].tolist() == [pytest.approx(0.9), 1, 1, 1, 1]
    assert arrays["min_p"].tolist() == [pytest.approx(0.05), 0, 0, 0, 0]
    with pytest.raises(ValueError, match="6 sampling settings for 5 rows"):
        SamplingParams.fill([GREEDY] * 6, **arrays)
    with pytest.raises(TypeError, match=r"params\[1\] must be a SamplingParams"):
        SamplingParams.fill([GREEDY, 0.5], **arrays)


@pytest.mark.gpu
def test_sample_on_the_gpu_replayed():
    """bf16 logits of a Llama-3 vocabulary: the kernel against the reference, then captured
    once in a CUDA graph and replayed with other logits and settings written in place."""
    dev = torch.device("cuda")
    seed = fresh_seed()
    rng, gen = rngs(seed)
    s, v = 8, 128256
    logits = torch.empty(s, v, dtype=torch.bfloat16, device=dev)
    args = settings([(1.0, 0, 1.0, 0.0, 0, 0)] * s, dev)
    out = torch.empty(s, dtype=torch.int64, device=dev)
    lowest = torch.empty(s, dtype=torch.float32, device=dev)
    logits.copy_(torch.randn(s, v, generator=gen) * 3)
    sample(logits, **args, out=out, lowest=lowest)            # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(logits, **args, out=out, lowest=lowest)
    for trial in range(3):
        rows = [(float(rng.choice([0.0, 0.6, 1.0])), int(rng.choice([0, 1, 50, v])), float(rng.choice([1.0, 0.9, 0.3])),
                 float(rng.choice([0.0, 0.05])), int(rng.integers(0, 2 ** 62)), int(rng.integers(0, 2 ** 40)))
                for _ in range(s)]
        for name, t in settings(rows, dev).items():
            args[name].copy_(t)
        logits.copy_(torch.randn(s, v, generator=gen) * 3)
        graph.replay()
        eager = sample(logits, **args)
        assert torch.equal(out, eager), f"trial {trial} (seed {seed}): replay {out.tolist()}, eager {eager.tolist()}"
        assert_draws(logits, args, out, lowest, rows, f"trial {trial} (seed {seed})")


# ---------------------------------------------------------------- in a step

def sampling_runtime(device, dtype=torch.float32, **kw):
    from graphrt import Runtime, RuntimeConfig
    from graphrt.toy import ToyModel

    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=64, max_num_seqs=4,
                        max_num_tokens=32, max_model_len=128, max_prefix_ranges=1, dtype=dtype, sampling=True)
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=300, device=device)

    def step_fn(ctx):
        _, logits = model(ctx)                     # [S, vocab]: each sequence's last token
        return logits, ctx.sample(logits)
    return Runtime(cfg, step_fn, num_layers=2, device=device, **kw), cfg


def test_step_samples_with_each_sequence_settings(device):
    """``ctx.sample`` draws each sequence's token with its own staged settings and its length
    as the counter: the same ids as the kernel called on the step's logits, and as the
    float64 reference."""
    from graphrt import SamplingParams, SeqStep, Step

    rt, cfg = sampling_runtime(device)
    seqs = [SeqStep(q_len=4, context_len=0, block_ids=[1]), SeqStep(q_len=1, context_len=20, block_ids=[2, 3]),
            SeqStep(q_len=2, context_len=5, block_ids=[4])]
    step = Step(seqs)
    params = [SamplingParams(temperature=0.0), SamplingParams(0.8, top_k=5, seed=3),
              SamplingParams(1.2, top_p=0.7, min_p=0.01, seed=2 ** 62)]
    logits, ids = rt.step(step, np.arange(7) % 300, sampling=params)
    lengths = [4, 21, 7]
    rows = [(p.temperature, p.top_k, p.top_p, p.min_p, p.seed, n) for p, n in zip(params, lengths)]
    want = reference.sample(logits.cpu(), *(settings(rows, "cpu")[k] for k in ("temperature", "top_k", "top_p",
                                                                                 "min_p", "seed", "counter")))
    assert ids.tolist() == want.tolist()
    assert int(ids[0]) == int(torch.argmax(logits[0]))
    # the same settings, another batch around them: the same draw for the same sequence
    logits2, ids2 = rt.step(Step([seqs[1]]), [4], sampling=[params[1]])
    torch.testing.assert_close(logits2[0], logits[1])
    assert int(ids2[0]) == int(ids[1])
    # no settings: greedy
    _, greedy = rt.step(step, np.arange(7) % 300)
    assert greedy.tolist() == torch.argmax(logits, dim=1).tolist()
    # the reference runner's ctx.sample: the same draws from its own (float64-attention) logits
    from graphrt import ReferenceRunner

    runner = ReferenceRunner(cfg, rt.model_step, num_layers=2, device=device)
    ref_logits, ref_ids = runner.step(step, np.arange(7) % 300, sampling=params)
    torch.testing.assert_close(ref_logits, logits, atol=1e-3, rtol=1e-3)
    assert ref_ids.tolist() == ids.tolist()


def test_step_refuses_bad_sampling_before_touching_buffers(device):
    from graphrt import Runtime, RuntimeConfig, SamplingParams, SeqStep, Step
    from graphrt.toy import ToyModel

    rt, cfg = sampling_runtime(device)
    step = Step([SeqStep(q_len=2, context_len=0, block_ids=[1]), SeqStep(q_len=1, context_len=3, block_ids=[2])])
    rt.step(step, [1, 2, 3], sampling=[SamplingParams(), SamplingParams(0.5)])
    arena = rt.buffers.arena.clone()
    staging = [s.clone() for s in rt.buffers.staging]
    for bad, error, match in [([SamplingParams()], ValueError, "a list of 2 SamplingParams"),
                              (SamplingParams(), ValueError, "a list of 2 SamplingParams"),
                              ([SamplingParams(), 0.5], TypeError, r"sampling\[1\] must be a graphrt.SamplingParams")]:
        with pytest.raises(error, match=match):
            rt.step(step, [1, 2, 3], sampling=bad)
    assert torch.equal(rt.buffers.arena, arena) and all(torch.equal(a, b) for a, b in zip(rt.buffers.staging, staging))
    cfg_off = RuntimeConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "sampling": False})
    plain = Runtime(cfg_off, ToyModel(cfg_off, num_layers=2, hidden=64, vocab=300, device=device), num_layers=2,
                    device=device)
    with pytest.raises(ValueError, match="need RuntimeConfig.sampling=True."):
        plain.step(step, [1, 2, 3], sampling=[SamplingParams()] * 2)
    with pytest.raises(RuntimeError, match="StepContext.sample needs RuntimeConfig.sampling=True."):
        Runtime(cfg_off, lambda ctx: ctx.sample(torch.zeros(ctx.num_seqs, 8, device=device)), num_layers=2,
                device=device).step(step, [1, 2, 3])


def test_sampling_fields_join_the_one_copy_only_when_asked():
    from graphrt.buffers import FIELDS, SAMPLING_FIELDS, Layout

    plain, with_sampling = Layout.make(8, 64, 2, 10), Layout.make(8, 64, 2, 10, sampling=True)
    assert not set(SAMPLING_FIELDS) & set(plain.offsets)
    # five [8] fields, each padded to 16 bytes: 32 + 32 + 32 + 32 + 64
    assert with_sampling.copy_bytes(1) - plain.copy_bytes(1) == 192
    assert all(with_sampling.offsets[f] == plain.offsets[f] for f in plain.offsets)
    views = with_sampling.views(torch.zeros(with_sampling.nbytes, dtype=torch.uint8))
    assert views["temperature"].dtype == torch.float32 and views["seed"].dtype == torch.int64
    assert [f.name for f in FIELDS if f.option == "sampling"] == list(SAMPLING_FIELDS)


@pytest.mark.gpu
def test_sampled_decode_loop_replays_with_one_copy_and_no_sync():
    """Decode steps replayed in strict mode, each sequence with its settings, the sampled ids
    fed to the next step on the device: one pinned copy a step, no host sync, and every
    replay's ids equal the kernel's on that replay's logits."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from graphrt import SamplingParams, SeqStep, Step
    from graphrt.profiling import count_transfers

    dev = torch.device("cuda")
    rt, cfg = sampling_runtime(dev, torch.bfloat16, strict=True)
    rt.capture(decode_buckets=[4], mixed_buckets=[32], quiet=True)
    params = [SamplingParams(0.0), SamplingParams(0.7, top_k=20, seed=1), SamplingParams(1.0, top_p=0.9, seed=2),
              SamplingParams(1.5, min_p=0.05, seed=3)]
    blocks = [[4 * i + j for j in range(4)] for i in range(4)]
    prompt = Step([SeqStep(q_len=5, context_len=0, block_ids=blocks[i]) for i in range(4)])
    _, ids = rt.step(prompt, np.arange(20) % 300, sampling=params)
    steps = [Step([SeqStep(q_len=1, context_len=5 + j, block_ids=blocks[i]) for i in range(4)]) for j in range(12)]
    seen = []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("graphrt_steps"):
            for s in steps:
                logits, ids = rt.step(s, ids, sampling=params)
                assert rt.last.mode == "replay"
                seen.append((logits.clone(), ids.clone()))
        torch.cuda.synchronize()
    counted = count_transfers(prof, "graphrt_steps")
    assert counted.h2d_pinned == len(steps) and counted.h2d_pageable == 0 and counted.syncs == 0, counted
    for j, (logits, ids) in enumerate(seen):
        lengths = [6 + j] * 4
        rows = [(p.temperature, p.top_k, p.top_p, p.min_p, p.seed, n) for p, n in zip(params, lengths)]
        assert torch.equal(ids, sample(logits, **settings(rows, dev))), f"decode step {j}"


def test_a_tuple_of_settings_passed_again_is_packed_from_its_cache():
    """The same tuple again reuses the arrays packed from it; another tuple, a list or
    fewer sequences are packed afresh, and padding rows stay greedy."""
    from graphrt import RuntimeConfig, SeqStep, Step
    from graphrt.buffers import StepBuffers

    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=16, max_num_seqs=4,
                        max_num_tokens=16, max_model_len=64, dtype=torch.float32, sampling=True)
    buf = StepBuffers(cfg, "cpu")
    layout = buf.layout(4, 4)
    steps = {n: Step([SeqStep(q_len=1, context_len=3, block_ids=[i]) for i in range(n)]) for n in (2, 3)}
    first = (SamplingParams(0.5, seed=11), SamplingParams(0.7, top_k=3, seed=12))
    other = (SamplingParams(0.9, seed=21), SamplingParams(0.0, seed=22), SamplingParams(1.5, min_p=0.2, seed=23))

    def staged(slot):
        v = layout.views(buf._staging_np[slot])
        return v["seed"].tolist(), v["temperature"].tolist(), v["top_p"].tolist()
    for n, params in ((2, first), (2, first), (3, other), (2, first), (2, list(first)), (3, other), (3, other)):
        slot = buf.pack(steps[n], layout, None, None, None, params)
        seeds, temps, top_p = staged(slot)
        assert seeds == [p.seed for p in params] + [0] * (4 - n), (n, seeds)
        assert temps == pytest.approx([p.temperature for p in params] + [0.0] * (4 - n))
        assert top_p == pytest.approx([1.0] * 4)
