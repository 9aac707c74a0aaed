"""torch.compile over graphrt: the custom ops trace with fullgraph=True and give the same
results as the launchers; a compiled model runs through the Runtime (CPU: aot_eager
backend, eagerly through the interpreter; GPU: Inductor, captured and replayed)."""

from __future__ import annotations

import pytest
import torch

from _cases import TOL, Seq, assert_close, build_meta, fresh_seed, rngs
from _model import random_step
from graphrt import Runtime
from graphrt.kernels import paged_attention, reference, split_workspace, write_kv
from graphrt.kernels.ops import attention_op
from graphrt.toy import ToyModel
from test_runtime import compare, small_cfg


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _backend(device: torch.device, seen: list[str]):
    """The backend (Inductor on GPU, aot_eager on CPU), noting the ops dynamo captured."""
    inner = torch._dynamo.lookup_backend("inductor" if device.type == "cuda" else "aot_eager")

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return inner(gm, example_inputs)
    return backend


def test_custom_ops_trace_fullgraph(device):
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [Seq(1, 40, ((3, 30),)), Seq(20, 9, ((12, 25),)), Seq(1, 70)]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=12, max_ranges=2, rng=rng, device=device,
                         num_seqs=4, num_tokens=total + 3)
    splits = 2
    workspace = split_workspace(total + 3, 4, 64, splits, device)
    k_cache = torch.randn(12, 16, 2, 64, generator=gen).to(device)
    v_cache = torch.randn(12, 16, 2, 64, generator=gen).to(device)
    q = torch.randn(total + 3, 4, 64, generator=gen).to(device)
    k_new = torch.randn(total + 3, 2, 64, generator=gen).to(device)
    v_new = torch.randn(total + 3, 2, 64, generator=gen).to(device)

    def layer(q, k_new, v_new, k_cache, v_cache):
        torch.ops.graphrt.write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
        out = torch.zeros_like(q)
        attention_op(q, k_cache, v_cache, out, meta, workspace=workspace, window=24, num_splits=splits)
        return out * 2.0          # something for the backend to compute after the op

    seen: list[str] = []
    compiled = torch.compile(layer, fullgraph=True, backend=_backend(device, seen))
    kc, vc = k_cache.clone(), v_cache.clone()
    got = compiled(q, k_new, v_new, kc, vc)

    k_want, v_want = k_cache.clone(), v_cache.clone()
    write_kv(k_new, v_new, k_want, v_want, meta)
    want = torch.zeros_like(q)
    paged_attention(q, k_want, v_want, want, meta, window=24, num_splits=splits, workspace=workspace)
    assert "graphrt.write_kv" in seen and "graphrt.paged_attention" in seen, seen
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want), f"compiled write_kv differs (seed={seed})"
    assert torch.equal(got[:total], 2.0 * want[:total]), f"compiled attention differs from the launcher (seed={seed})"
    ref = reference.paged_attention(q, k_want, v_want, meta, window=24)
    assert_close("compiled out", got[:total] / 2.0, ref, *TOL[torch.float32], seed)


def test_compiled_model_runs_through_runtime(device):
    """A model compiled with fullgraph=True gives what the uncompiled one gives, step after
    step with changing shapes; on the GPU its graphs are captured and replayed."""
    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg = small_cfg(num_blocks=120, max_num_seqs=4, max_num_tokens=64, max_model_len=160)
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, window=24, seed=seed, device=device)
    seen: list[str] = []
    compiled = torch.compile(model, fullgraph=True, backend=_backend(device, seen))
    rt = Runtime(cfg, compiled, num_layers=2, device=device)
    plain = Runtime(cfg, model, num_layers=2, device=device)
    captured = rt.capture(decode_buckets=[4], mixed_buckets=[64])
    for i in range(4 if device.type == "cuda" else 2):
        step = random_step(rng, cfg, num_seqs=int(rng.integers(1, 5)), decode=i % 2 == 0, max_ctx=90)
        ids = rng.integers(0, 50, step.num_tokens)
        got = tuple(t.clone() for t in rt.step(step, ids))
        mode = rt.last.mode
        want = plain.step(step, ids)
        compare(f"compiled step {i} ({mode})", got, want, step.num_seqs, step.num_tokens, torch.float32, seed)
        if device.type == "cuda":
            assert mode == "replay", f"step {i} ran {mode}, not from a captured graph"
    assert (device.type == "cuda") == bool(captured)
    assert seen.count("graphrt.paged_attention") >= 2, f"the compiled model did not trace graphrt ops: {seen}"
