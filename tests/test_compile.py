"""torch.compile over graphrt: the custom ops trace with fullgraph=True and give the same
results as the launchers; a compiled model runs through the Runtime (CPU: aot_eager
backend, eagerly through the interpreter; GPU: Inductor, captured and replayed), by the
user's own torch.compile or the Runtime's compile option (per bucket, checked)."""

from __future__ import annotations

import pytest
import torch

from _cases import TOL, Seq, assert_close, build_meta, fresh_seed, rngs
from _model import random_step
from graphrt import Runtime, SeqStep, Step
from graphrt.capture import Bucket, CompileError, CompileOptions
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


def _options(device: torch.device, pdl: bool = False) -> CompileOptions:
    """Inductor on the GPU; aot_eager on the CPU (traced the same way, no code generation:
    what fits CI's time)."""
    return CompileOptions(backend="inductor" if device.type == "cuda" else "aot_eager", pdl=pdl)


@pytest.mark.parametrize("pdl", [False, True], ids=["no-pdl", "pdl"])
def test_runtime_compile_option_matches_the_uncompiled_step(device, pdl):
    """Runtime(compile=...): each bucket compiled once, checked to run graphrt attention once
    a layer, then (GPU) captured and replayed or (CPU) run over the bucket's buffers; its
    outputs equal the uncompiled runtime's step after step, and a step no bucket fits runs
    the step uncompiled. With ``pdl`` (GPU: every kernel of the compiled steps a
    programmatic dependent launch, the split-KV decode launches and their merges included)
    the same."""
    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg = small_cfg(num_blocks=120, max_num_seqs=4, max_num_tokens=64, max_model_len=160)
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, window=24, seed=seed, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device, compile=_options(device, pdl))
    plain = Runtime(cfg, model, num_layers=2, device=device)
    captured = rt.capture(decode_buckets=[2, 4], mixed_buckets=[32], quiet=True)
    assert len(captured) == 3 and all((g.graph is not None) == (device.type == "cuda") for g in captured)
    records = rt.compiler.records
    assert sorted(records) == sorted(g.bucket for g in captured)
    for record in records.values():
        assert record.attention_ops == 2 and record.graphs >= 1 and record.seconds > 0, str(record)
        want = {"graphrt.paged_attention_new_kv"} if record.bucket.kind == "decode" else \
            {"graphrt.write_kv", "graphrt.paged_attention"}
        assert set(record.ops) == want, f"{record.bucket}: {dict(record.ops)}"
    compiled_mode = "replay" if device.type == "cuda" else "compiled"
    for i in range(5):
        decode, n = i % 2 == 0, int(rng.integers(1, 5))
        max_tokens = 64 if i == 3 else 32          # step 3 may exceed the largest mixed bucket: uncompiled
        step = random_step(rng, cfg, num_seqs=n, decode=decode, max_tokens=max_tokens, max_ctx=90)
        ids = rng.integers(0, 50, step.num_tokens)
        got = tuple(t.clone() for t in rt.step(step, ids))
        mode = rt.last.mode
        want = plain.step(step, ids)
        compare(f"compiled step {i} ({mode})", got, want, step.num_seqs, step.num_tokens, torch.float32, seed)
        assert mode == (compiled_mode if step.num_tokens <= 32 or decode else "eager"), (i, mode, step.num_tokens)
    assert all(r.recompiles == 0 for r in records.values()), [str(r) for r in records.values()]


class _OneLayerOwnAttention(ToyModel):
    """A toy model whose second layer computes attention itself (SDPA over the step's own
    tokens) instead of through graphrt: what a compiled adapter whose switch to graphrt's
    attention was lost looks like."""

    def forward(self, ctx):
        hq, hkv, d = self.cfg.num_q_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        x = self.embed[ctx.input_ids] + self.pos_embed[ctx.positions]
        for i in range(self.num_layers):
            qkv = x @ self.w_qkv[i]
            q = qkv[:, : hq * d].view(-1, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(-1, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
            if i == 0:
                out = ctx.attention(i, q, k, v)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1), k.repeat_interleave(hq // hkv, 1).transpose(0, 1),
                    v.repeat_interleave(hq // hkv, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
            x = x + out.flatten(1) @ self.w_o[i]
        return x[ctx.last_token_index] @ self.embed.T


def test_compiled_step_without_graphrt_attention_is_refused(device):
    cfg = small_cfg(num_blocks=40, max_num_seqs=2, max_num_tokens=16, max_model_len=64)
    model = _OneLayerOwnAttention(cfg, num_layers=2, hidden=64, vocab=50, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device, compile=_options(device))
    with pytest.raises(CompileError, match=r"ran graphrt attention 1 times .* a step makes 2 attention calls"):
        rt.capture(decode_buckets=[2], mixed_buckets=[], quiet=True)
    with pytest.raises(CompileError, match="ran graphrt attention 1 times"):      # refused again, not cached
        rt.capture(decode_buckets=[2], mixed_buckets=[], quiet=True)
    ok = Runtime(cfg, model, num_layers=2, device=device, compile=CompileOptions(
        backend=_options(device).backend, attention_calls=1))     # the step says how many it makes
    assert len(ok.capture(decode_buckets=[2], mixed_buckets=[], quiet=True)) == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="reduce-overhead"), "CUDA graphs"),
    (dict(mode="fastest"), "Inductor's modes"),
    (dict(options={"triton.cudagraphs": True}), "cudagraphs must stay off"),
    (dict(attention_calls=-1), "attention_calls"),
    (dict(backend=""), "backend"),
    (dict(options={"post_grad_custom_pre_pass": None}), "small_linear=False"),
], ids=["reduce-overhead", "unknown-mode", "cudagraphs-option", "negative-calls", "empty-backend", "own-pass"])
def test_compile_options_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompileOptions(**kwargs)
    with pytest.raises(TypeError, match="compile must be"):
        Runtime(small_cfg(), lambda ctx: None, num_layers=1, device="cpu", compile="yes")
    with pytest.raises(TypeError, match="small_linear must be a bool"):
        CompileOptions(small_linear=1)
    CompileOptions(small_linear=False, fuse_rope=False, options={"post_grad_custom_pre_pass": None})   # their own pass
    with pytest.raises(ValueError, match="fuse_rope=False"):
        CompileOptions(small_linear=False, options={"post_grad_custom_pre_pass": None})
    with pytest.raises(TypeError, match="fuse_rope must be a bool"):
        CompileOptions(fuse_rope=None)
    with pytest.raises(TypeError, match="pdl must be a bool"):
        CompileOptions(pdl=1)
    with pytest.raises(TypeError, match="linear_fusions must be a bool"):
        CompileOptions(linear_fusions="no")


def test_pdl_launches_sets_the_switch_for_its_block_only(monkeypatch):
    """``pdl_launches`` (what CompileOptions(pdl=True) wraps a compiled step in) decides for
    launchers not told otherwise, above GRAPHRT_PDL, and only inside its block; CPU tensors
    never launch with PDL."""
    from graphrt.kernels import _checks

    seen = []
    monkeypatch.setattr(_checks, "_PDL", {0: True})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("GRAPHRT_PDL", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)      # read at each call; kernels are loaded already
    cuda = torch.device("cuda", 0)
    seen.append(_checks.pdl_supported(cuda))
    with _checks.pdl_launches(True):
        seen.append(_checks.pdl_supported(cuda))
        seen.append(_checks.pdl_supported(cuda, False))          # a launcher told otherwise
        with _checks.pdl_launches(False):
            seen.append(_checks.pdl_supported(cuda))
        seen.append(_checks.pdl_supported(cuda))
        seen.append(_checks.pdl_supported(torch.device("cpu")))
    seen.append(_checks.pdl_supported(cuda))
    monkeypatch.setenv("GRAPHRT_PDL", "1")
    seen.append(_checks.pdl_supported(cuda))
    assert seen == [False, True, False, False, True, False, False, True]
    with pytest.raises(TypeError, match="takes a bool"):
        with _checks.pdl_launches("yes"):
            pass


def _llama_loops(batch: int, compiles: list) -> tuple[list, list, list]:
    """The bench's bf16 tiny Llama on the GPU, one loop per ``compile`` setting (prompts of
    24 tokens), each prefilled and decoded six greedy steps: (loops, first ids, tokens)."""
    from graphrt.bench.model import QUICK, GraphrtLoop, build, prompts

    dev = torch.device("cuda")
    hf = build("llama-tiny", QUICK["llama-tiny"], dev, torch.bfloat16)
    ids, _ = prompts(hf, batch, 24, 0)
    loops = [GraphrtLoop(hf, batch, 24, 8, dev, chunk=64, compile=c) for c in compiles]
    firsts = [loop.prefill(ids, None) for loop in loops]
    return loops, firsts, [loop.decode(first, 6) for loop, first in zip(loops, firsts)]


def _decode_kernels(loop, first) -> list:
    """The profiler's CUDA kernel entries of one replayed decode step of ``loop``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop.decode(first, 1)
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("small_linear,fusions", [(True, True), (True, False), (False, False)],
                         ids=["small-linear", "small-linear-unfused", "cublas"])
def test_compiled_decoder_runs_small_linear(small_linear, fusions):
    """A bf16 Llama compiled by the Runtime, one sequence: with ``small_linear`` (the default)
    its replayed decode step runs graphrt's linear kernel (q/k/v and gate/up grouped: fewer
    matmul launches than without) and gives the uncompiled loop's greedy tokens; with its
    fusions (``linear_fusions``, the default; one row only) the step makes fewer launches than
    without them (norms, residual adds and the SwiGLU product inside the linear launches)."""
    options = [CompileOptions(small_linear=small_linear, linear_fusions=fusions)]
    if fusions:
        options.append(CompileOptions(linear_fusions=False))
    loops, firsts, tokens = _llama_loops(1, [*options, False])
    assert torch.equal(tokens[0], tokens[-1]), f"compiled {tokens[0].tolist()} != eager {tokens[-1].tolist()}"
    kernels = [_decode_kernels(loop, first) for loop, first in zip(loops[:-1], firsts)]
    launches = [sum(e.count for e in k) for k in kernels]
    names = [e.key for e in kernels[0]]
    linear = [n for n in names if "_linear_kernel" in n]
    assert bool(linear) == small_linear, names
    if fusions:
        assert launches[0] < launches[1], launches      # fused, unfused
    record = loops[0].rt.compiler.records
    assert all(r.attention_ops == 2 for r in record.values()), [str(r) for r in record.values()]


@pytest.mark.gpu
def test_compiled_decoder_with_pdl_matches_without():
    """``CompileOptions(pdl=True)``: the compiled bf16 Llama's kernels (Inductor's and
    graphrt's) launch as programmatic dependents; its replayed steps give the same greedy
    tokens and the same last logits as the compiled loop without it, bit for bit (the
    kernels are the same but for the wait at their start)."""
    from graphrt.kernels._checks import pdl_supported

    if not pdl_supported(torch.device("cuda"), True):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    loops, firsts, tokens = _llama_loops(4, [CompileOptions(pdl=pdl) for pdl in (True, False)])
    assert torch.equal(tokens[0], tokens[1]), f"pdl {tokens[0].tolist()} != without {tokens[1].tolist()}"
    logits = []
    for loop, first in zip(loops, firsts):       # the first decode step again, its logits kept
        logits.append(loop.step_logits(first))
        assert loop.rt.last.mode == "replay", loop.rt.last.mode
    assert torch.equal(logits[0], logits[1]), (logits[0] - logits[1]).abs().max().item()


@pytest.mark.gpu
def test_compiled_decoder_rope_in_attention():
    """``CompileOptions(fuse_rope=True)`` (the default) on a bf16 Llama, two sequences: each
    decode bucket's two layers give the attention launch their rotary embedding, the
    replayed decode step makes fewer launches than with ``fuse_rope=False``, and both give
    the same greedy tokens and last logits within bf16 rounding of each other (the same
    rotation in fp32, rounded once, in another kernel)."""
    loops, firsts, tokens = _llama_loops(2, [CompileOptions(fuse_rope=f) for f in (True, False)])
    assert torch.equal(tokens[0], tokens[1]), f"fused {tokens[0].tolist()} != unfused {tokens[1].tolist()}"
    ropes = [{r.bucket.kind: r.ropes for r in loop.rt.compiler.records.values()} for loop in loops]
    assert ropes[0].get("decode") == 2 and not any(ropes[1].values()), ropes
    launches = [sum(e.count for e in _decode_kernels(loop, first)) for loop, first in zip(loops, firsts)]
    logits = [loop.step_logits(first).float() for loop, first in zip(loops, firsts)]
    assert launches[0] < launches[1], launches
    worst = (logits[0] - logits[1]).abs().max().item() / logits[1].abs().max().item()
    assert worst < 2e-2, worst


def test_compiled_steps_sample_and_place_speculative_tokens(device):
    """graphrt's sampling and speculative placement trace as custom ops: a compiled step that
    samples draws the uncompiled step's tokens, and a compiled speculative loop gives the
    uncompiled loop's tokens."""
    from graphrt import SamplingParams
    from graphrt.toy import ToyModel as Toy

    cfg = small_cfg(num_blocks=40, max_num_seqs=2, max_num_tokens=32, max_model_len=96, sampling=True)
    model = Toy(cfg, num_layers=2, hidden=64, vocab=50, seed=3, device=device)

    def step_fn(ctx):
        return ctx.sample(model(ctx)[1])
    compiled = Runtime(cfg, step_fn, num_layers=2, device=device, compile=_options(device))
    plain = Runtime(cfg, step_fn, num_layers=2, device=device)
    compiled.capture(decode_buckets=[2], mixed_buckets=[32], quiet=True)
    settings = [SamplingParams(0.9, top_k=10, seed=1), SamplingParams(1.1, top_p=0.8, seed=2)]
    step = Step([SeqStep(q_len=5, context_len=0, block_ids=[1]), SeqStep(q_len=3, context_len=0, block_ids=[2])])
    got = compiled.step(step, list(range(8)), sampling=settings)
    assert compiled.last.mode in ("compiled", "replay")
    assert got[:2].tolist() == plain.step(step, list(range(8)), sampling=settings).tolist()
    assert any("graphrt.sample" in r.ops for r in compiled.compiler.records.values()), \
        [dict(r.ops) for r in compiled.compiler.records.values()]


def test_compiled_speculative_loop_matches_the_uncompiled_one(device):
    pytest.importorskip("transformers")
    import numpy as np

    from test_speculative import run_speculative, speculative_setup

    outs = {}
    for name, options in (("plain", None), ("compiled", _options(device))):
        cfg, state, runtimes, _ = speculative_setup(device, torch.float32, 0, 2, 0.1, compile=options)
        prompts = [np.arange(3, 10), np.arange(20, 31)]
        blocks = [list(range(16 * r, 16 * r + 16)) for r in range(2)]
        if options is not None:     # the verify runtime with a verify bucket (2 sequences of 2 drafts + 1)
            for i, rt in enumerate(runtimes):
                rt.capture(decode_buckets=[2], mixed_buckets=[8, 32], quiet=True,
                           **(dict(verify_buckets=[2], drafts=2) if i == 1 else {}))
        outs[name] = [(e.tolist(), c.tolist()) for e, c in run_speculative(runtimes, prompts, blocks, 2, 3, state)]
        if options is not None:
            assert runtimes[1].last.mode in ("compiled", "replay")
            assert runtimes[1].last.bucket == Bucket(6, 2, "verify", 3), runtimes[1].last
            ops = {op for r in runtimes[1].compiler.records.values() for op in r.ops}
            assert "graphrt.place_tokens" in ops, ops
    assert outs["compiled"] == outs["plain"]


def test_compile_options_kinds_compiles_only_those_buckets(device):
    """CompileOptions(kinds=("decode",)): decode buckets compiled, mixed ones captured from the
    uncompiled step; both give the uncompiled runtime's outputs."""
    import dataclasses

    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg = small_cfg(num_blocks=120, max_num_seqs=4, max_num_tokens=64, max_model_len=160)
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, seed=seed, device=device)
    options = dataclasses.replace(_options(device), kinds=("decode",))
    rt = Runtime(cfg, model, num_layers=2, device=device, compile=options)
    plain = Runtime(cfg, model, num_layers=2, device=device)
    rt.capture(decode_buckets=[4], mixed_buckets=[32], quiet=True)
    assert [b.kind for b in rt.compiler.records] == ["decode"]
    for decode in (True, False):
        step = random_step(rng, cfg, num_seqs=3, decode=decode, max_tokens=32, max_ctx=90)
        ids = rng.integers(0, 50, step.num_tokens)
        got = tuple(t.clone() for t in rt.step(step, ids))
        want = {True: "compiled", False: "eager"}[decode] if device.type == "cpu" else "replay"
        assert rt.last.mode == want, (decode, rt.last)
        compare(f"kinds step (decode {decode})", got, plain.step(step, ids), step.num_seqs, step.num_tokens,
                torch.float32, seed)
    with pytest.raises(ValueError, match="CompileOptions.kinds"):
        CompileOptions(kinds=("prefill",))
    with pytest.raises(ValueError, match="CompileOptions.kinds"):
        CompileOptions(kinds=())
