"""Speculative decoding with every decision on the device (docs/speculative.md): greedy, or
sampled with rejection sampling against the draft's distributions.

A ``SpecState`` holds, per request row r, what only the device knows between steps:
``length[r]`` (the request's tokens whose KV the target's cache holds and that are final)
and ``tokens[r] = [prev, next, d_1 .. d_K]``: the token at ``length - 1``, the token to
feed at ``length`` (the target's own choice), and the latest K drafts. The step functions
below read and write it inside captured steps; the host stages steps whose lengths are
upper bounds (every draft accepted) with blocks allocated for them, names each
sequence's row and its tokens' offset against that row's length
(``Runtime.step(..., requests=, offsets=)``), and reads the emitted tokens whenever it
chooses (one iteration later, say), never to decide the next step.

One iteration for requests whose target and draft caches hold their prompts:
- the draft: one step of two tokens a sequence at offset -1 ([prev, next]), then K - 1
  steps of one token at offsets 1 .. K - 1 (the drafts so far): each writes the next draft
  into ``tokens[r, 2 ..]`` (``draft_step``);
- the target: one step of K + 1 tokens at offset 0 ([next, d_1 .. d_K]) (``verify_step``):
  the drafts the target's argmax agrees with, from the first on, are accepted; it returns
  the tokens that became final ([next, d_1 .. d_a], 1 + a of them) and moves the row on:
  length += 1 + a, prev = the last of those, next = the target's token after them.
Rejected drafts' KV rows lie past the new length: never attended, and overwritten.

Sampled (``SpecState(..., vocab=V)``, ``RuntimeConfig(sampling=True)`` and each request's
``SamplingParams`` in every step): the target's prompt step draws ``next``; each draft
step draws its draft and keeps the distribution it drew from in ``draft_probs[r, j]``;
the verify step accepts draft j when u_j q_j(d_j) < p_j(d_j) (p: the target's kept
distribution there, the same settings) and draws the token after the accepted ones from
max(0, p - q) renormalised (``kernels.speculative.accept_rejection``): the emitted tokens
follow the target's own sampling distribution whatever the draft. The uniforms come from
the request's seed with counter ``length + 2**48`` (apart from every draw's counter, a
position), so a request's tokens depend on its seed and its tokens only.
"""

from __future__ import annotations

from typing import Callable

import torch

from graphrt.kernels.ops import greedy as greedy_op
from graphrt.kernels.ops import kept_lowest as kept_lowest_op
from graphrt.kernels.ops import place_tokens as place_tokens_op
from graphrt.kernels.ops import uniforms as uniforms_op
from graphrt.kernels.sampling import kept_probs
from graphrt.kernels.speculative import accept_greedy, accept_rejection

VERIFY_STREAM = 2 ** 48     # added to a verify's counter: its uniforms never share a draw's key


class SpecState:
    """Device-owned rows of ``max_requests`` requests for K = ``drafts`` drafts a step,
    shared by the draft's and the target's runtimes (allocated once: their graphs read and
    write these addresses). Row ``max_requests`` is where padding sequences write.
    ``vocab``: sampled decoding (module doc), with the drafts' distributions kept in
    ``draft_probs`` [R + 1, K, vocab] float32 (4 (R + 1) K vocab bytes); None: greedy."""

    def __init__(self, max_requests: int, drafts: int, device: torch.device | str, *, vocab: int | None = None):
        for name, v in (("max_requests", max_requests), ("drafts", drafts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SpecState {name} must be a positive int, got {v!r}")
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
            raise ValueError(f"SpecState vocab must be a positive int or None, got {vocab!r}")
        self.max_requests, self.drafts, self.vocab = max_requests, drafts, vocab
        self.length = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)            # [R + 1]
        self.tokens = torch.zeros(max_requests + 1, drafts + 2, dtype=torch.int64, device=device)  # [R + 1, K + 2]
        self.accepted = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)          # [R + 1]
        self.draft_probs = (torch.zeros(max_requests + 1, drafts, vocab, dtype=torch.float32, device=device)
                            if vocab else None)                                                  # [R + 1, K, V]

    @property
    def sampled(self) -> bool:
        return self.draft_probs is not None

    def rows(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [S] int64, valid [S] bool): each sequence's row, padding sent to the last."""
        request = _speculative(ctx)["request"]
        valid = (request >= 0) & (request < self.max_requests)
        return torch.where(valid, request, self.max_requests).long(), valid


def _speculative(ctx) -> dict:
    if getattr(ctx, "speculative", None) is None:
        raise RuntimeError("graphrt.speculative steps need RuntimeConfig(speculative=True): each sequence's row "
                           "and offset travel in the step's copy")
    return ctx.speculative


def _place(ctx, state: SpecState) -> None:
    """The step's lengths, positions, slots and ids from the state (before the model runs)."""
    spec = _speculative(ctx)
    meta = ctx.meta
    # the custom op: opaque to torch.compile, as graphrt's attention is
    place_tokens_op(spec["request"], spec["offset"], state.length, meta.query_start_loc, meta.seq_lens, ctx.positions,
                    meta.slot_mapping, meta.block_table, ctx.block_size, ctx.input_ids, state.tokens)


def prefill_step(state: SpecState, last_logits: Callable) -> Callable:
    """A target's prompt step (placed by the host as usual): ``last_logits(ctx)`` [S, V]
    (each sequence's last token); then each named row takes length = the sequence's
    length, prev = its last token, next = the argmax (sampled: the draw). Returns the next
    ids [S]."""

    def step(ctx):
        logits = last_logits(ctx)
        rows, valid = state.rows(ctx)
        ids = ctx.sample(logits) if state.sampled else greedy_op(logits)  # [S]
        state.length[rows] = torch.where(valid, ctx.meta.seq_lens, 0)
        state.tokens[rows, 0] = ctx.input_ids[ctx.last_token_index]
        state.tokens[rows, 1] = ids
        return ids
    return step


def draft_step(state: SpecState, last_logits: Callable) -> Callable:
    """A draft step placed from the state: each sequence's argmax (sampled: its draw, the
    distribution kept in ``draft_probs``) after its last token is the draft at position
    length + offset + q, stored at ``tokens[r, 1 + offset + q]``. Returns the drafts [S]."""

    def step(ctx):
        _place(ctx, state)
        logits = last_logits(ctx)
        rows, _ = state.rows(ctx)
        qsl = ctx.meta.query_start_loc
        col = (1 + _speculative(ctx)["offset"] + (qsl[1:] - qsl[:-1])).clamp(2, state.drafts + 1).long()
        if state.sampled:
            ids, probs = ctx.sample(logits, probs=True)
            state.draft_probs[rows, col - 2] = probs
        else:
            ids = greedy_op(logits)
        state.tokens[rows, col] = ids
        return ids
    return step


def verify_step(state: SpecState, all_logits: Callable) -> Callable:
    """The target's verify step placed from the state (K + 1 tokens a sequence at offset 0):
    ``all_logits(ctx)`` [T, V] (every token's). Returns (emitted [S, K + 1] int64, counts
    [S] int32): the first counts[i] of row i became final this step (0 for padding)."""

    def step(ctx):
        _place(ctx, state)
        logits = all_logits(ctx)
        k = state.drafts
        rows, valid = state.rows(ctx)
        qsl = ctx.meta.query_start_loc
        at = (qsl[:-1, None].long() + torch.arange(k + 1, device=logits.device)).clamp(max=logits.shape[0] - 1)
        row_tokens = state.tokens[rows]                                         # [S, K + 2]
        if state.sampled:
            accepted, next_ids = _accept_sampled(ctx, state, logits[at.reshape(-1)], rows, row_tokens[:, 2:])
        else:
            accepted, next_ids = accept_greedy(greedy_op(logits)[at], row_tokens[:, 2:])
        emitted = row_tokens[:, 1:]                                             # [next, d_1 .. d_K]
        state.length[rows] = state.length[rows] + 1 + accepted
        state.tokens[rows, 0] = row_tokens.gather(1, 1 + accepted.long()[:, None]).squeeze(1)
        state.tokens[rows, 1] = next_ids
        state.accepted[rows] = accepted
        return emitted, torch.where(valid, 1 + accepted, 0)
    return step


def _accept_sampled(ctx, state: SpecState, logits: torch.Tensor, rows: torch.Tensor,
                    drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of a verify step: ``logits`` [S (K + 1), V], the target's after
    each of a sequence's K + 1 tokens; drafts [S, K]."""
    s, k1 = drafts.shape[0], state.drafts + 1
    cfg = ctx.sampling
    if cfg is None:
        raise RuntimeError("a sampled SpecState needs RuntimeConfig(sampling=True): the settings travel in the "
                           "step's copy")

    def each(t: torch.Tensor) -> torch.Tensor:        # a sequence's setting for each of its K + 1 rows
        return t.repeat_interleave(k1)  # a copy: for one sequence a reshaped expand is a stride-0 view
    length = state.length[rows].long()
    # p's kept sets: the filters' passes without a draw (the draws here are the acceptance's uniforms)
    lowest = kept_lowest_op(logits, each(cfg["temperature"]), each(cfg["top_k"]), each(cfg["top_p"]),
                            each(cfg["min_p"]))
    target = kept_probs(logits, each(cfg["temperature"]), lowest).view(s, k1, -1)
    u = uniforms_op(cfg["seed"], length + VERIFY_STREAM, k1)
    return accept_rejection(target, state.draft_probs[rows], drafts, u)


def speculative_runtimes(cfg, state: SpecState, target, draft, **runtime_kw) -> tuple:
    """The four runtimes a ``SpeculativeLoop`` drives: the target's prompt and verify
    runtimes, sharing one KV cache, and the draft's prompt and draft runtimes, sharing
    another. ``target`` and ``draft`` are model steps as ``TransformersModel`` gives them:
    called on a ctx for each sequence's last-token logits, ``all_logits(ctx)`` for every
    token's (the target's), and ``num_layers``. ``cfg``: ``RuntimeConfig(...,
    speculative=True)``; ``runtime_kw``: the other ``Runtime`` arguments (device, strict,
    compile, ...)."""
    from graphrt.runtime import Runtime

    t_pre = Runtime(cfg, prefill_step(state, target), num_layers=target.num_layers, **runtime_kw)
    t_ver = Runtime(cfg, verify_step(state, target.all_logits), num_layers=target.num_layers,
                    kv_caches=(t_pre.k_caches, t_pre.v_caches), **runtime_kw)
    d_pre = Runtime(cfg, draft, num_layers=draft.num_layers, **runtime_kw)
    d_dec = Runtime(cfg, draft_step(state, draft), num_layers=draft.num_layers,
                    kv_caches=(d_pre.k_caches, d_pre.v_caches), **runtime_kw)
    return t_pre, t_ver, d_pre, d_dec


class SpeculativeLoop:
    """Greedy speculative decoding of a fixed batch of requests (state rows 0 .. n - 1) over
    four runtimes: the target's prompt and verify runtimes and the draft's prompt and
    draft runtimes (each pair sharing its KV cache). The host only stages: its bound on
    each row's length grows by K + 1 an iteration and comes down by the drafts a verify
    rejected once that verify's counts have reached the host (a non-blocking copy, read
    when it has landed, and not before ``lag`` more iterations were staged: by default
    the host stages each iteration before it knows the last one's counts); ``blocks`` must
    hold the bound (``bounds``). ``iterate`` returns the verify step's outputs copied on the
    device (emitted [n, K + 1], counts [n]); reading them is the caller's choice. The same
    copy to the host that brings the counts brings the emitted tokens: ``tokens`` holds
    each request's tokens whose iteration has been settled (what a server streams, no
    wait added).
    A sampled state (``SpecState(vocab=)``) takes each request's ``SamplingParams`` at
    ``prefill(..., sampling=)``; they travel in every step's copy (packed once: a tuple)."""

    RING = 4       # verify counts in flight to the host before it waits for the oldest

    def __init__(self, state: SpecState, target_prompt, target_verify, draft_prompt, draft, *, lag: int = 1):
        if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag < self.RING:
            raise ValueError(f"lag must be an int in [0, {self.RING}), got {lag!r}")
        self.state, self.k, self.lag = state, state.drafts, lag
        self.runtimes = (target_prompt, target_verify, draft_prompt, draft)
        self.blocks: list[list[int]] = []
        self.upper: list[int] = []
        cuda = state.length.is_cuda
        # each verify's counts go to the host in a non-blocking copy; the host settles its
        # bounds from them once they have landed (``settle``), never waiting for one unless
        # RING iterations are in flight
        self._host = [torch.zeros(state.max_requests, dtype=torch.int32, pin_memory=cuda) for _ in range(self.RING)]
        self._host_tokens = [torch.zeros(state.max_requests, self.k + 1, dtype=torch.int64, pin_memory=cuda)
                             for _ in range(self.RING)]
        self._streamed: list[list[int]] = []
        self._events = [torch.cuda.Event() if cuda else None for _ in range(self.RING)]
        self._pending: list[int] = []           # ring slots of iterations not yet settled, oldest first
        self._next = 0
        self._sampling: tuple | None = None

    @property
    def tokens(self) -> list[list[int]]:
        """Each request's generated tokens that have reached the host (the target's first
        token on, in order), as of the last ``settle``."""
        return [list(t) for t in self._streamed]

    @property
    def bounds(self) -> list[int]:
        """The host's bound on each row's length (the true length once every verify has
        landed)."""
        return list(self.upper)

    def prefill(self, prompts: list, blocks: list[list[int]], *, sampling=None):
        """Both models' prompt steps (rows 0 .. n - 1); returns the target's first tokens [n].
        ``sampling``: one ``SamplingParams`` per request (a sampled state; default greedy)."""
        import numpy as np

        from graphrt.step import SeqStep, Step

        t_pre, _, d_pre, _ = self.runtimes
        if len(prompts) > self.state.max_requests:
            raise ValueError(f"{len(prompts)} requests for a SpecState of {self.state.max_requests} rows")
        if sampling is not None and not self.state.sampled:
            raise ValueError("sampling settings need a sampled SpecState (SpecState(..., vocab=V)): a greedy one "
                             "keeps no draft distributions")
        sampling = tuple(sampling) if sampling is not None else None
        step = Step([SeqStep(q_len=len(p), context_len=0, block_ids=b) for p, b in zip(prompts, blocks)])
        ids = np.concatenate([np.asarray(p) for p in prompts])
        first = t_pre.step(step, ids, requests=list(range(len(prompts))), sampling=sampling)
        d_pre.step(step, ids)
        self._sampling = sampling
        self.blocks, self.upper = [list(b) for b in blocks], [len(p) for p in prompts]
        self._pending.clear()
        self._streamed = [[] for _ in prompts]
        return first[: len(prompts)]

    def settle(self, keep: int = 0) -> None:
        """Lower the host's bounds by the drafts each landed verify rejected, oldest first,
        leaving the newest ``keep`` unread; waits for a copy only when RING are in flight."""
        while len(self._pending) > keep:
            slot = self._pending[0]
            event = self._events[slot]
            if event is not None and not event.query():
                if len(self._pending) < self.RING:
                    return
                event.synchronize()             # RING iterations ahead: back-pressure
            counts = self._host[slot][: len(self.upper)].tolist()      # landed: a host read, no sync
            emitted = self._host_tokens[slot][: len(self.upper)].tolist()
            self.upper = [u - (self.k + 1 - c) for u, c in zip(self.upper, counts)]
            for out, row, c in zip(self._streamed, emitted, counts):
                out += row[:c]
            self._pending.pop(0)

    def iterate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K draft steps and one verify step."""
        from graphrt.step import SeqStep, Step

        _, t_ver, _, d_dec = self.runtimes
        self.settle(keep=self.lag)
        n, k = len(self.upper), self.k
        rows = list(range(n))

        def step(q_len: int, first: int) -> Step:     # positions bounded by every draft accepted so far
            return Step([SeqStep(q_len=q_len, context_len=u + first, block_ids=b) for u, b in zip(self.upper, self.blocks)])
        sampling = self._sampling
        d_dec.step(step(2, -1), requests=rows, offsets=[-1] * n, sampling=sampling)
        for j in range(2, k + 1):
            d_dec.step(step(1, j - 1), requests=rows, offsets=[j - 1] * n, sampling=sampling)
        emitted, counts = t_ver.step(step(k + 1, 0), requests=rows, offsets=[0] * n, sampling=sampling)
        self.upper = [u + k + 1 for u in self.upper]
        slot = self._next
        self._next = (slot + 1) % self.RING
        self._host[slot][:n].copy_(counts[:n], non_blocking=True)
        self._host_tokens[slot][:n].copy_(emitted[:n], non_blocking=True)
        if self._events[slot] is not None:
            self._events[slot].record()
        self._pending.append(slot)
        return emitted[:n].clone(), counts[:n].clone()
