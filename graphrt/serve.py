"""A small continuous-batching loop over a Runtime: the demos', the adapter tests' and
``graphrt bench model``'s prefill.

Requests join at different steps; each step takes every decode plus prefill chunks within a
token budget. A chunk never ends inside a prefix range (a range may only use keys that are
in the cache after the step, so an image in a range is prefilled whole, in one chunk), a
sequence carries the ranges it has complete, the image tokens in a chunk bring their
embeddings through ``Runtime.step(embeds=, embed_rows=)``, and where a request has
positions of its own (multimodal RoPE) they travel with the step (``positions=``). A
finished request's blocks go back to the free list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.profiler import record_function

from graphrt.sampling import SamplingParams
from graphrt.step import SeqStep, Step


def next_chunk(cached: int, budget: int, length: int, ranges: Sequence[tuple[int, int]]) -> int:
    """Prompt tokens to prefill next for a sequence with ``cached`` of ``length`` prompt
    tokens in the cache: at most ``budget``, except that a chunk never ends inside a range
    ``[start, end)``: it stops before the range, or, when the range starts the chunk, takes
    it whole (which may exceed the budget). 0 when nothing fits."""
    n = min(length - cached, budget)
    for start, end in ranges:
        if start < cached + n < end:
            n = start - cached if start > cached else end - cached
            break
    return max(n, 0)


@dataclass
class Request:
    rid: int
    arrival: int                          # step at which it joins
    prompt: list[int]
    new_tokens: int                       # tokens to generate
    ranges: list[tuple[int, int]] = field(default_factory=list)   # prefix ranges, half-open positions
    # half-open runs of image tokens whose embeddings ``features`` holds (default: ``ranges``)
    images: list[tuple[int, int]] | None = None
    features: torch.Tensor | None = None  # [sum of image lengths, E] embeddings of the images' tokens, in order
    pixels: torch.Tensor | None = None    # the images the features came from (for a reference forward)
    image_grid_thw: torch.Tensor | None = None   # [images, 3] their patch grids, where the model takes them
    # [P, len(prompt)] positions of the prompt's tokens where they are not 0, 1, ... (None:
    # those); a generated token at sequence position p takes p + position_delta in every row
    positions: np.ndarray | None = None
    position_delta: int = 0
    blocks: list[int] = field(default_factory=list)
    cached: int = 0                       # tokens in the KV cache
    generated: list[int] = field(default_factory=list)
    logits: list[tuple[int, torch.Tensor]] = field(default_factory=list)   # (position, logits there)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.new_tokens


def schedule(running: list[Request], chunk: int, block_size: int, free_blocks: list[int], position_rows: int = 1):
    """This step's (SeqSteps, token ids, owners, embeds or None, embed rows, positions or
    None: [position_rows, tokens] where a request has positions of its own)."""
    budget, seqs, ids, owners, embeds, rows, positions = chunk, [], [], [], [], [], []
    own_positions = False
    for r in running:
        prefilling = r.cached < len(r.prompt)
        n = next_chunk(r.cached, budget, len(r.prompt), r.ranges) if prefilling else 0
        if prefilling and n == 0:
            continue                      # no prefill budget left this step
        q_len, first = n or 1, len(ids)
        ids += r.prompt[r.cached: r.cached + n] if n else [r.generated[-1]]
        budget = max(budget - n, 0)
        row = 0
        for start, end in (r.ranges if r.images is None else r.images):   # the chunk's image tokens bring
            lo, hi = max(start, r.cached), min(end, r.cached + n)          # their embeddings
            if r.features is not None and lo < hi:
                embeds.append(r.features[row + lo - start: row + hi - start])
                rows += range(first + lo - r.cached, first + hi - r.cached)
            row += end - start
        if n and r.positions is not None:
            positions.append(np.asarray(r.positions)[:, r.cached: r.cached + n])
        else:
            positions.append(np.full((position_rows, q_len), 0, np.int64)
                             + np.arange(r.cached, r.cached + q_len) + (0 if n else r.position_delta))
        own_positions |= r.positions is not None or r.position_delta != 0
        while len(r.blocks) * block_size < r.cached + q_len:
            r.blocks.append(free_blocks.pop())
        seen = [rg for rg in r.ranges if rg[1] <= r.cached + q_len]
        seqs.append(SeqStep(q_len=q_len, context_len=r.cached, block_ids=list(r.blocks), prefix_ranges=seen))
        owners.append(r)
    return (seqs, ids, owners, (torch.cat(embeds) if embeds else None), rows,
            np.concatenate(positions, axis=1) if own_positions else None)


def serve(rt, requests: list[Request], *, chunk: int, free_blocks: list[int], never: Sequence[int] | torch.Tensor = (),
          sampling: Mapping[int, SamplingParams] | None = None,
          on_step: Callable[[int, Step, list[Request], list[int], Any], None] | None = None,
          host_times: list[float] | None = None, read_back: bool = True) -> int:
    """Run ``requests`` to completion on ``rt`` (a Runtime whose model step returns the
    logits of each sequence's last token, [S, vocab], or a tuple ending with them). The
    one request loop of the demos and ``graphrt bench model``.

    Tokens: greedy, never one of ``never`` (image placeholders, say); or, with ``sampling``
    (a request id -> ``SamplingParams`` map; the runtime's config has ``sampling=True``),
    each step passes its sequences' settings and takes the ids the step drew itself: the
    step function then returns a tuple ending with (logits, drawn ids). Each request keeps
    the logits of every position it took a token at. ``on_step(step_no, step, owners, ids,
    outputs)`` runs after each step (ids: the step's input token ids); ``host_times``
    receives each ``rt.step`` call's host seconds. ``read_back=False``: the tokens are not
    read on the host (no sync a step); each request's token stays on the device as a 0-d
    tensor in ``generated``, so every request must want one new token (a prefill, with its
    first token). Returns the number of steps."""
    if not read_back and any(r.new_tokens != 1 for r in requests):
        raise ValueError("serve(read_back=False) runs requests of new_tokens=1 only (a decode needs its last "
                         "token on the host)")
    banned = torch.as_tensor(never, dtype=torch.long).to(rt.device)     # once, before the first step
    step_no = steps = 0
    while not all(r.done for r in requests):
        running = [r for r in requests if r.arrival <= step_no and not r.done]
        step_no += 1
        seqs, ids, owners, embeds, rows, positions = schedule(running, chunk, rt.cfg.block_size, free_blocks,
                                                              rt.cfg.position_rows)
        if not seqs:
            continue
        step = Step(seqs)
        params = [sampling[r.rid] for r in owners] if sampling is not None else None
        t0 = time.perf_counter()
        with record_function("graphrt_step"):          # what a profile of the loop counts as the step
            out = rt.step(step, ids, embeds=embeds, embed_rows=rows if embeds is not None else None,
                          positions=positions, sampling=params)
        if host_times is not None:
            host_times.append(time.perf_counter() - t0)
        n = step.num_seqs
        step_logits = out[-2] if sampling is not None else out[-1] if isinstance(out, tuple) else out
        logits = step_logits[:n].float()
        if logits.data_ptr() == step_logits.data_ptr():
            logits = logits.clone()                 # new tensors: the next replay cannot touch them
        if sampling is not None:
            drawn = out[-1][:n].clone()
        else:
            drawn = (logits.index_fill(1, banned, float("-inf")) if banned.numel() else logits).argmax(-1)
        tokens = drawn.tolist() if read_back else drawn   # the loop's own read-back (or none)
        steps += 1
        for i, (r, q_len) in enumerate(zip(owners, step.q_lens.tolist())):
            r.cached += q_len
            if r.cached >= len(r.prompt):
                r.logits.append((r.cached - 1, logits[i]))
                r.generated.append(int(tokens[i]) if read_back else tokens[i])
                if r.done:                # its blocks serve the requests still to come
                    free_blocks.extend(reversed(r.blocks))
        if on_step:
            on_step(step_no, step, owners, ids, out)
    return steps
