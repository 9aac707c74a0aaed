"""Input embeddings inside steps: given rows replace the token embeddings of the tokens they
belong to, through a device-to-device copy and a selector in the one pinned copy; on the GPU
captured, replayed, one pinned copy and no sync per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cases import fresh_seed, rngs
from _model import random_step
from graphrt import Runtime, RuntimeConfig, SeqStep, Step
from graphrt.checking import ReferenceRunner
from graphrt.toy import ToyModel
from test_runtime import compare

HIDDEN = 64


def embed_cfg(dtype=torch.float32, **kw) -> RuntimeConfig:
    fields = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=160, max_num_seqs=8,
                  max_num_tokens=128, max_model_len=256, max_prefix_ranges=3, dtype=dtype, embed_dim=HIDDEN)
    fields.update(kw)
    return RuntimeConfig(**fields)


def random_embeds(rng, gen, step: Step, device, dtype):
    """Embeddings for a random subset of the step's tokens (sometimes none), rows in a random order."""
    n = int(rng.integers(0, step.num_tokens + 1)) if rng.random() < 0.8 else 0
    rows = rng.permutation(step.num_tokens)[:n]
    return torch.randn(n, HIDDEN, generator=gen).to(device=device, dtype=dtype), rows


def run_steps(device, dtype, steps: int, *, capture: bool, seed: int):
    rng, gen = rngs(seed)
    cfg = embed_cfg(dtype)
    model = ToyModel(cfg, num_layers=2, hidden=HIDDEN, vocab=64, window=24, seed=seed, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device, strict=device.type == "cuda")
    if capture:
        rt.capture(decode_buckets=[2, 8], mixed_buckets=[32, 128], quiet=True)
    ref = ReferenceRunner(cfg, model, num_layers=2, device=device)
    plain = ReferenceRunner(cfg, model, num_layers=2, device=device)     # the same steps without embeddings
    for i in range(steps):
        step = random_step(rng, cfg, num_seqs=int(rng.integers(1, cfg.max_num_seqs + 1)), decode=bool(i % 3 == 2))
        ids = rng.integers(0, 64, step.num_tokens)
        embeds, rows = random_embeds(rng, gen, step, device, dtype)
        got = tuple(o.clone() for o in rt.step(step, ids, embeds=embeds, embed_rows=rows))
        if capture:
            assert rt.last.mode == "replay"
        compare(f"step {i}", got, ref.step(step, ids, embeds=embeds, embed_rows=rows), step.num_seqs,
                step.num_tokens, dtype, seed)
        without = plain.step(step, ids)
        if len(rows):       # the embeddings took effect: the given tokens' hidden rows moved
            moved = (got[0][: step.num_tokens].double().cpu() - without[0].double().cpu()).abs().amax(-1)
            assert (moved[rows] > 1e-3).all(), f"given embeddings left their tokens unchanged (seed={seed})"
    return rt


def test_embeds_match_reference_eager(device):
    if device.type == "cuda":
        pytest.skip("the GPU test below covers eager and replay")
    run_steps(device, torch.float32, 4, capture=False, seed=fresh_seed())


def test_embeds_are_checked_before_anything_is_written(device):
    cfg = embed_cfg()
    model = ToyModel(cfg, num_layers=1, hidden=HIDDEN, vocab=50, device=device)
    rt = Runtime(cfg, model, num_layers=1, device=device)
    step = Step([SeqStep(q_len=4, context_len=0, block_ids=[1])])
    ids = [1, 2, 3, 4]
    e = torch.randn(2, HIDDEN, device=device)
    rt.step(step, ids, embeds=e, embed_rows=[0, 3])
    arena, embeds = rt.buffers.arena.clone(), rt.buffers.inputs_embeds.clone()
    staging = [s.clone() for s in rt.buffers.staging]
    bad = [
        (dict(embeds=e), ValueError, "embeds and embed_rows go together"),
        (dict(embeds=e, embed_rows=[0, 4]), ValueError, r"token indices in \[0, 4\)"),
        (dict(embeds=e, embed_rows=[-1, 2]), ValueError, r"token indices in \[0, 4\)"),
        (dict(embeds=e, embed_rows=[2, 2]), ValueError, "a token twice"),
        (dict(embeds=e, embed_rows=[1]), ValueError, "must be 2 host ints"),
        (dict(embeds=e, embed_rows=[0.0, 1.0]), ValueError, "must be 2 host ints"),
        (dict(embeds=e[:, :10], embed_rows=[0, 1]), ValueError, r"\[n, embed_dim=64\] float tensor"),
        (dict(embeds=e.long(), embed_rows=[0, 1]), ValueError, r"\[n, embed_dim=64\] float tensor"),
        (dict(embeds=[[0.0] * HIDDEN] * 2, embed_rows=[0, 1]), TypeError, "embeds must be a torch.Tensor"),
        (dict(embeds=torch.empty(2, HIDDEN, device="meta"), embed_rows=[0, 1]), ValueError,
         "copied device-to-device only"),
    ]
    for kwargs, err, match in bad:
        with pytest.raises(err, match=match):
            rt.step(step, ids, **kwargs)
    assert torch.equal(rt.buffers.arena, arena), "a rejected step changed the device arena"
    assert torch.equal(rt.buffers.inputs_embeds, embeds), "a rejected step changed inputs_embeds"
    assert all(torch.equal(a, b) for a, b in zip(rt.buffers.staging, staging)), "a rejected step changed staging"
    plain = Runtime(embed_cfg(embed_dim=0), ToyModel(embed_cfg(embed_dim=0), num_layers=1, hidden=HIDDEN, vocab=50,
                                                     device=device), num_layers=1, device=device)
    with pytest.raises(ValueError, match="RuntimeConfig.embed_dim is 0"):
        plain.step(step, ids, embeds=e, embed_rows=[0, 1])


def test_selector_travels_in_the_pinned_copy(device):
    """The selector is part of the arena's copied prefix; a step without embeddings resets it."""
    cfg = embed_cfg()
    rt = Runtime(cfg, ToyModel(cfg, num_layers=1, hidden=HIDDEN, vocab=50, device=device), num_layers=1,
                 device=device)
    step = Step([SeqStep(q_len=3, context_len=0, block_ids=[1]), SeqStep(q_len=2, context_len=5, block_ids=[2])])
    rt.step(step, [1, 2, 3, 4, 5], embeds=torch.randn(2, HIDDEN, device=device), embed_rows=np.array([4, 1]))
    layout = rt.buffers.layout(step.num_seqs, step.num_tokens)
    views = rt.buffers.device_views(layout)
    assert views.embed_index.tolist() == [-1, 1, -1, -1, 0]
    assert layout.offsets["embed_index"] < layout.copy_bytes(1)
    rt.step(step, [1, 2, 3, 4, 5])
    assert views.embed_index.tolist() == [-1] * 5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_embeds_replayed_from_graphs(dtype):
    run_steps(torch.device("cuda"), dtype, 40, capture=True, seed=fresh_seed())


@pytest.mark.gpu
def test_embeds_keep_one_pinned_copy_and_no_sync():
    from torch.profiler import ProfilerActivity, profile, record_function

    from graphrt.profiling import count_transfers

    seed = fresh_seed()
    rng, gen = rngs(seed)
    device = torch.device("cuda")
    cfg = embed_cfg(torch.bfloat16)
    model = ToyModel(cfg, num_layers=2, hidden=HIDDEN, vocab=64, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device, strict=True)
    rt.capture(decode_buckets=[8], mixed_buckets=[128], quiet=True)
    steps = [random_step(rng, cfg, num_seqs=int(rng.integers(1, 9)), decode=bool(i % 2)) for i in range(12)]
    inputs = [(rng.integers(0, 64, s.num_tokens), *random_embeds(rng, gen, s, device, cfg.dtype)) for s in steps]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("graphrt_steps"):
            for s, (ids, e, rows) in zip(steps, inputs):
                rt.step(s, ids, embeds=e, embed_rows=rows)
                assert rt.last.mode == "replay"
        torch.cuda.synchronize()
    seen = count_transfers(prof, "graphrt_steps")
    assert seen.h2d_pinned == len(steps), f"{seen.h2d_pinned} pinned HtoD copies over {len(steps)} steps"
    assert seen.h2d_pageable == 0 and seen.syncs == 0, f"{seen.h2d_pageable} pageable copies, {seen.syncs} syncs"
