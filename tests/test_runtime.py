"""Runtime: arena layout, staging, validation, eager == reference (CPU and GPU), and on
the GPU replay == eager == reference, one pinned copy and no sync per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cases import TOL, assert_close, fresh_seed, rngs
from _model import random_step
from graphrt.checking import ReferenceRunner
from graphrt import Runtime, RuntimeConfig, SeqStep, Step
from graphrt.buffers import Layout, StepBuffers
from graphrt.toy import ToyModel


def small_cfg(dtype=torch.float32, **kw) -> RuntimeConfig:
    fields = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=96, max_num_seqs=6,
                  max_num_tokens=96, max_model_len=192, max_prefix_ranges=2, dtype=dtype)
    fields.update(kw)
    return RuntimeConfig(**fields)


def compare(name, got, want, num_seqs, num_tokens, dtype, seed):
    atol, rtol = TOL[dtype]
    assert_close(f"{name} hidden", got[0][:num_tokens], want[0][:num_tokens], 2 * atol, 2 * rtol, seed)
    assert_close(f"{name} logits", got[1][:num_seqs], want[1][:num_seqs], 2 * atol, 2 * rtol, seed)


def test_layout_is_compact_and_aligned():
    small, big = Layout.make(2, 8, 3, 100), Layout.make(64, 512, 3, 100)
    for lay in (small, big):
        assert all(off % 16 == 0 for off in lay.offsets.values()) and lay.block_table_offset % 16 == 0
    assert small.copy_bytes(1) < 400 < big.copy_bytes(1)       # follows the bucket, not the capacity
    assert small.copy_bytes(7) - small.copy_bytes(1) == 6 * 4 * 2   # and the longest sequence's blocks
    views = big.views(torch.zeros(big.nbytes, dtype=torch.uint8))
    assert views["block_table"].shape == (64, 100) and views["block_table"].stride() == (1, 64)
    assert views["prefix_ranges"].shape == (64, 3, 2)


def test_stage_copies_step_sized_prefix():
    cfg = small_cfg()
    buf = StepBuffers(cfg, "cpu")
    layout = buf.layout(4, 16)
    step = Step([SeqStep(q_len=3, context_len=20, block_ids=[5, 9]), SeqStep(q_len=1, context_len=0, block_ids=[2])])
    slot = buf.pack(step, layout, np.arange(4))
    nbytes = layout.copy_bytes(2)
    buf.copy(slot, nbytes)
    v = buf.device_views(layout)
    assert v.meta.query_start_loc.tolist() == [0, 3, 4, 4, 4]
    assert v.meta.seq_lens.tolist() == [23, 1, 0, 0]
    assert v.meta.slot_mapping.tolist() == [9 * 16 + 4, 9 * 16 + 5, 9 * 16 + 6, 2 * 16] + [-1] * 12
    assert v.positions[:4].tolist() == [20, 21, 22, 0] and v.input_ids[:5].tolist() == [0, 1, 2, 3, 0]
    assert v.meta.block_table[:2, :2].tolist() == [[5, 9], [2, 0]]
    assert not buf.arena[nbytes:].any(), "bytes past the step's prefix were copied"


def test_bad_step_leaves_staged_state_untouched(device):
    cfg = small_cfg()
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device)
    good = Step([SeqStep(q_len=5, context_len=3, block_ids=[1], prefix_ranges=[(0, 4)])])
    rt.step(good, [1, 2, 3, 4, 5])
    arena = rt.buffers.arena.clone()
    staging = [s.clone() for s in rt.buffers.staging]
    caches = [c.clone() for c in rt.k_caches + rt.v_caches]
    bad_steps = [
        (Step([SeqStep(q_len=2, context_len=3, block_ids=[1], prefix_ranges=[(4, 9)])]), [1, 2], "ends past"),
        (Step([SeqStep(q_len=2, context_len=3, block_ids=[96])]), [1, 2], "block id 96"),
        (Step([SeqStep(q_len=97, context_len=0, block_ids=list(range(7)))]), None, "max_num_tokens"),
        (Step([SeqStep(q_len=2, context_len=3, block_ids=[1])]), [1, 2, 3], "input_ids must be 2 integers"),
        (Step([SeqStep(q_len=2, context_len=3, block_ids=[1])]), [1.0, 2.0], "input_ids must be 2 integers"),
    ]
    for step, ids, match in bad_steps:
        with pytest.raises(ValueError, match=match):
            rt.step(step, ids)
    assert torch.equal(rt.buffers.arena, arena), "a rejected step changed the device arena"
    assert all(torch.equal(a, b) for a, b in zip(rt.buffers.staging, staging)), "a rejected step changed staging"
    assert all(torch.equal(a, b) for a, b in zip(rt.k_caches + rt.v_caches, caches)), "a rejected step wrote the cache"


def test_runtime_rejects_bad_construction():
    cfg = small_cfg()
    model = ToyModel(cfg, num_layers=1, hidden=64, vocab=50)
    with pytest.raises(TypeError, match="cfg must be a RuntimeConfig"):
        Runtime(dict(), model, num_layers=1)
    with pytest.raises(ValueError, match="num_layers"):
        Runtime(cfg, model, num_layers=0, device="cpu")
    with pytest.raises(ValueError, match=r"kv_caches k_caches\[0\] must be"):
        Runtime(cfg, model, num_layers=1, device="cpu", kv_caches=([torch.zeros(3)], [torch.zeros(3)]))
    with pytest.raises(ValueError, match="ring must be >= 2"):
        Runtime(cfg, model, num_layers=1, device="cpu", ring=1)


def run_against_reference(device, dtype, steps: int, *, capture: bool, seed: int, host_ahead: int = 1):
    """Random decode and mixed steps through a runtime (captured or not), an eager runtime
    and the float64-attention reference; every output compared."""
    rng, _ = rngs(seed)
    cfg = small_cfg(dtype, num_blocks=160, max_num_seqs=8, max_num_tokens=128, max_model_len=256,
                    max_prefix_ranges=3)
    model = ToyModel(cfg, num_layers=2, hidden=128, vocab=64, window=24, seed=seed, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device)
    captured = rt.capture(decode_buckets=[1, 2, 4, 8], mixed_buckets=[16, 64, 128]) if capture else []
    eager = Runtime(cfg, model, num_layers=2, device=device) if capture else None
    ref = ReferenceRunner(cfg, model, num_layers=2, device=device).step
    seen = set()
    pending = []
    for i in range(steps):
        decode = bool(rng.random() < 0.5)
        step = random_step(rng, cfg, num_seqs=int(rng.integers(1, cfg.max_num_seqs + 1)), decode=decode)
        ids = rng.integers(0, 64, step.num_tokens)
        out = rt.step(step, ids)
        seen.add(rt.last.bucket)
        pending.append((step, ids, tuple(o.clone() for o in out)))   # clone: enqueued, no host wait
        if len(pending) < host_ahead and i + 1 < steps:
            continue
        for step, ids, got in pending:
            want = ref(step, ids)
            compare(f"step {i}", got, want, step.num_seqs, step.num_tokens, dtype, seed)
            if eager is not None:
                compare(f"step {i} eager", got, eager.step(step, ids), step.num_seqs, step.num_tokens, dtype, seed)
        pending.clear()
    return rt, captured, seen


def test_eager_runtime_matches_reference(device):
    if device.type == "cuda":
        pytest.skip("the GPU version below covers graphs too")
    run_against_reference(device, torch.float32, 4, capture=False, seed=fresh_seed())


def test_nvtx_ranges_emitted(monkeypatch, device):
    import nvtx

    class Domain:             # records what the runtime pushes and pops
        def __init__(self, name):
            self.name = name

        def get_event_attributes(self, message):
            return message

        def push_range(self, message):
            seen.append((self.name, message))
            stack.append(message)

        def pop_range(self):
            stack.pop()

    seen, stack = [], []
    monkeypatch.setattr(nvtx, "get_domain", Domain)
    cfg = small_cfg()
    rt = Runtime(cfg, ToyModel(cfg, num_layers=1, hidden=64, vocab=50, device=device), num_layers=1, device=device,
                 nvtx=True)
    for _ in range(2):        # the second step reuses the first one's ranges
        rt.step(Step([SeqStep(q_len=2, context_len=0, block_ids=[3])]), [1, 2])
    names = [m.split()[0] for _, m in seen]
    assert names == ["stage", "copy", "eager"] * 2 and {d for d, _ in seen} == {"graphrt"} and stack == []
    assert "seqs=1" in seen[0][1] and "tokens=2" in seen[0][1]
    assert seen[1][1].startswith("copy bytes=") and seen[2][1] == "eager seqs=1 tokens=2"
    assert len(rt.tracer._steps) == 1
    rt.step(Step([SeqStep(q_len=3, context_len=0, block_ids=[3])]), [1, 2, 3])
    assert "tokens=3" in seen[-3][1] and len(rt.tracer._steps) == 2 and stack == []
    with pytest.raises(ValueError):            # refused before anything is pushed
        rt.step(Step([SeqStep(q_len=3, context_len=0, block_ids=[3])]), [1, 2])
    assert stack == [] and len(seen) == 9

    def failing_step(ctx):
        raise RuntimeError("model step failed")

    rt.model_step = failing_step             # a range is popped however its stage ends
    with pytest.raises(RuntimeError, match="model step failed"):
        rt.step(Step([SeqStep(q_len=3, context_len=0, block_ids=[3])]), [1, 2, 3])
    assert stack == [] and [m.split()[0] for _, m in seen[-3:]] == ["stage", "copy", "eager"]


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_replay_matches_eager_and_reference(dtype):
    seed = fresh_seed()
    rt, captured, seen = run_against_reference(torch.device("cuda"), dtype, 200, capture=True, seed=seed)
    assert len(captured) == 7
    assert seen >= {c.bucket for c in captured}, f"buckets never replayed: {set(c.bucket for c in captured) - seen}"
    for c in captured:
        print(f"captured {c.bucket}: {c.seconds * 1e3:.0f} ms, pool +{c.pool_bytes / 2**20:.1f} MiB")


@pytest.mark.gpu
def test_host_runs_ahead():
    """Stage and replay several steps while the GPU is still busy; none is corrupted."""
    seed = fresh_seed()
    torch.cuda._sleep(1)   # load the sleep kernel before timing matters
    device = torch.device("cuda")
    rng, _ = rngs(seed)
    cfg = small_cfg(torch.float32, num_blocks=160, max_num_seqs=8, max_num_tokens=128, max_model_len=256)
    model = ToyModel(cfg, num_layers=2, hidden=128, vocab=64, device=device, seed=seed)
    rt = Runtime(cfg, model, num_layers=2, device=device, ring=2)
    rt.capture(decode_buckets=[8], mixed_buckets=[128])
    ref = ReferenceRunner(cfg, model, num_layers=2, device=device).step
    steps = [random_step(rng, cfg, num_seqs=int(rng.integers(1, 9)), decode=bool(i % 2)) for i in range(6)]
    ids = [rng.integers(0, 64, s.num_tokens) for s in steps]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU time ahead of everything below
    outs = [tuple(o.clone() for o in rt.step(s, i)) for s, i in zip(steps, ids)]
    for step, i, got in zip(steps, ids, outs):
        compare("ahead", got, ref(step, i), step.num_seqs, step.num_tokens, torch.float32, seed)


@pytest.mark.gpu
def test_one_pinned_copy_and_no_sync_per_step():
    from torch.profiler import ProfilerActivity, profile, record_function

    from graphrt.profiling import count_transfers

    seed = fresh_seed()
    device = torch.device("cuda")
    rng, _ = rngs(seed)
    cfg = small_cfg(torch.bfloat16, num_blocks=160, max_num_seqs=8, max_num_tokens=128, max_model_len=256)
    model = ToyModel(cfg, num_layers=2, hidden=128, vocab=64, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device, strict=True)
    rt.capture(decode_buckets=[4, 8], mixed_buckets=[128])
    steps = [random_step(rng, cfg, num_seqs=int(rng.integers(1, 9)), decode=bool(i % 2)) for i in range(20)]
    ids = [rng.integers(0, 64, s.num_tokens) for s in steps]
    rt.step(steps[0], ids[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("graphrt_steps"):
            for s, i in zip(steps, ids):           # strict: set_sync_debug_mode("error") around each step
                rt.step(s, i)
                assert rt.last.mode == "replay"
        torch.cuda.synchronize()
    seen = count_transfers(prof, "graphrt_steps")
    assert seen.regions == 1
    assert seen.h2d_pinned == len(steps), f"{seen.h2d_pinned} pinned HtoD copies over {len(steps)} steps"
    assert seen.h2d_pageable == 0, f"{seen.h2d_pageable} pageable copies"
    assert seen.syncs == 0, f"{seen.syncs} host syncs while stepping"


@pytest.mark.gpu
def test_step_copy_through_the_driver_lands_on_the_current_stream():
    """StepBuffers.copy queues the copy and the slot's event through the driver (after each
    slot's first, torch-made, event): the bytes land, and on a side stream the event waits
    behind that stream's work."""
    from graphrt import buffers

    if buffers._copy_h2d is None:
        pytest.skip("graphrt._fast was not built at install (`graphrt info` says why): steps copy through torch")
    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg = small_cfg()
    buf = StepBuffers(cfg, "cuda", ring=3)
    layout = buf.layout(6, 96)
    side = torch.cuda.Stream()
    for i in range(9):
        step = random_step(rng, cfg, num_seqs=int(rng.integers(1, 7)), decode=bool(i % 2))
        slot = buf.pack(step, layout, rng.integers(0, 64, step.num_tokens))
        nbytes = layout.copy_bytes(step.block_columns)
        if i >= 6:
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)
                buf.copy(slot, nbytes)
            assert not buf._events[slot].query(), "the slot's event did not wait for the side stream's work"
        else:
            buf.copy(slot, nbytes)
        torch.cuda.synchronize()
        got = buf.arena[:nbytes].cpu()
        assert torch.equal(got, buf.staging[slot][:nbytes]), f"step {i} (seed {seed}): the arena differs from the slot"
    assert buf._direct, "the driver refused a copy; torch's path took over"


@pytest.mark.gpu
def test_replaced_cache_refuses_replay():
    device = torch.device("cuda")
    cfg = small_cfg(torch.bfloat16)
    model = ToyModel(cfg, num_layers=1, hidden=64, vocab=50, device=device)
    rt = Runtime(cfg, model, num_layers=1, device=device)
    rt.capture(decode_buckets=[2], mixed_buckets=[16])
    step = Step([SeqStep(q_len=1, context_len=4, block_ids=[0])])
    rt.step(step, [3])
    arena = rt.buffers.arena.clone()
    original = rt.k_caches[0]
    rt.k_caches[0] = original.clone()
    with pytest.raises(RuntimeError, match=r"k_caches\[0\] moved or was replaced"):
        rt.step(step, [3])
    assert torch.equal(rt.buffers.arena, arena), "a refused replay staged its step"
    rt.k_caches[0] = original
    rt.step(step, [3])
    model.w_o = torch.nn.Parameter(model.w_o.detach().clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"w_o moved or was replaced"):
        rt.step(step, [3])
    # capturing again is the way on: the stale graphs are dropped, the new ones replay
    rt.capture(decode_buckets=[2], mixed_buckets=[16], quiet=True)
    rt.step(step, [3])
    assert rt.last.mode == "replay"


@pytest.mark.gpu
def test_given_caches_on_plain_cuda_device():
    cfg = small_cfg(torch.bfloat16)
    model = ToyModel(cfg, num_layers=1, hidden=64, vocab=50, device="cuda")
    shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = ([torch.zeros(shape, dtype=cfg.dtype, device="cuda")], [torch.zeros(shape, dtype=cfg.dtype, device="cuda")])
    rt = Runtime(cfg, model, num_layers=1, device="cuda", kv_caches=caches)
    assert rt.device == caches[0][0].device and rt.k_caches[0] is caches[0][0]


@pytest.mark.gpu
def test_capture_out_of_memory_leaves_a_working_runtime():
    """A bucket that does not fit under a memory cap fails with an error naming it and the
    bytes asked for; the smaller buckets are captured and replay, the rest runs eagerly."""
    from graphrt.capture import CaptureError

    device = torch.device("cuda")
    cfg = small_cfg(torch.float32, max_num_tokens=128)
    model = ToyModel(cfg, num_layers=1, hidden=64, vocab=50, device=device)

    def step_fn(ctx):
        # scratch that grows with the bucket: 64 MiB per token of capacity
        torch.empty(ctx.num_tokens * 64 * 2 ** 20, dtype=torch.uint8, device=device)
        return model(ctx)

    rt = Runtime(cfg, step_fn, num_layers=1, device=device)
    plain = Runtime(cfg, model, num_layers=1, device=device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 3 * 2 ** 30) / total)
    try:
        with pytest.raises(CaptureError, match=r"mixed\[seqs=6,tokens=128\] \(asked for 8\.00 GiB\)") as err:
            rt.capture(decode_buckets=[2], mixed_buckets=[16, 128], quiet=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert [str(b) for b, _ in err.value.failures] == ["mixed[seqs=6,tokens=128]"]
    assert sorted(str(b) for b in rt.graphs.graphs) == ["decode[seqs=2,tokens=2]", "mixed[seqs=6,tokens=16]"]
    steps = [(Step([SeqStep(q_len=1, context_len=9, block_ids=[0])]), "replay"),
             (Step([SeqStep(q_len=12, context_len=0, block_ids=[1])]), "replay"),
             (Step([SeqStep(q_len=40, context_len=3, block_ids=[2, 3, 4])]), "eager")]
    for step, mode in steps:
        ids = np.arange(step.num_tokens) % 50
        got = tuple(t.clone() for t in rt.step(step, ids))
        assert rt.last.mode == mode, f"{step.num_tokens}-token step ran {rt.last.mode}, expected {mode}"
        compare(f"after capture failure ({mode})", got, plain.step(step, ids), step.num_seqs, step.num_tokens,
                torch.float32, 0)


def test_guard_lists_agree_and_name_what_moved():
    """The per-step guard (addresses only) and the named one list the same tensors; a
    replaced cache or weight, or a deleted weight, fails the check and is named. Runs
    without CUDA: the guard is plain Python over tensors."""
    from graphrt.capture import GraphSet

    cfg = small_cfg()
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50)
    rt = Runtime(cfg, model, num_layers=2, device="cpu")
    named = rt._guarded()
    fast = rt._guarded_fast()
    assert len(fast) == len(named) and all(a is b for (_, a), b in zip(named, fast))
    assert [n for n, _ in named] == (["arena", "k_caches[0]", "k_caches[1]", "v_caches[0]", "v_caches[1]"]
                                     + [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()])
    graphs = GraphSet(rt._guarded, rt._guarded_fast)
    graphs._addresses = [t.data_ptr() for _, t in named]
    graphs.check_guard()
    original = rt.v_caches[1]
    rt.v_caches[1] = original.clone()
    with pytest.raises(RuntimeError, match=r"v_caches\[1\] moved or was replaced"):
        graphs.check_guard()
    rt.v_caches[1] = original
    graphs.check_guard()
    w_o = model.w_o
    model.w_o = torch.nn.Parameter(w_o.detach().clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"w_o moved or was replaced"):
        graphs.check_guard()
    model.w_o = w_o
    del model._parameters["embed"]
    with pytest.raises(RuntimeError, match=r"embed moved or was replaced"):
        graphs.check_guard()
