"""graphrt.capture.rope_pass: the rotary embedding of a compiled decode step's q and k moved
into the attention launch, on graphs of hand-written steps (the forms it takes and the
ones it leaves) and on transformers' decoders (how many launches it rewrites per family;
their logits against transformers' forward with the pass on are test_transformers'
``test_family_compiled_matches_transformers_cpu``)."""

from __future__ import annotations

import functools

import pytest
import torch

from _cases import TOL, Seq, assert_close, build_meta, fresh_seed, rngs
from graphrt import Runtime
from graphrt.capture import CompileOptions
from graphrt.capture.passes import PrePasses
from graphrt.capture.rope_pass import RopePass, fuse_rope


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def interleaved(x: torch.Tensor) -> torch.Tensor:      # Cohere's rotate_every_two: not the form the launch takes
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rotate(x, cos, sin, form):
    """x ([1, H, T, D]) rotated by the [T, R] tables in one of the forms a model's code takes."""
    c, s = cos[None, None], sin[None, None]
    if form == "partial":
        r = cos.shape[-1]
        return torch.cat((x[..., :r] * c + rotate_half(x[..., :r]) * s, x[..., r:]), dim=-1)
    if form == "operands-swapped":
        return s * rotate_half(x) + c * x
    if form == "interleaved":
        return x * c + interleaved(x) * s
    if form == "fp32":                                 # rotated in fp32, then back to x's dtype
        return (x.float() * c.float() + rotate_half(x.float()) * s.float()).to(x.dtype)
    return x * c + rotate_half(x) * s


FORMS = {   # form, q and k share the tables, decode launch -> rewritten
    "plain": ("plain", True, True, True),
    "partial": ("partial", True, True, True),
    "operands-swapped": ("operands-swapped", True, True, True),
    "interleaved": ("interleaved", True, True, False),
    "fp32-rotation": ("fp32", True, True, False),
    "tables-differ": ("plain", False, True, False),
    "not-decode": ("plain", True, False, False),
}


def inductor_available(device: torch.device) -> None:
    """Skip unless Inductor can generate code here (a C++ compiler for the CPU)."""
    import shutil

    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        pytest.skip("Inductor's CPU code needs a C++ compiler")


@pytest.mark.parametrize("backend,case", [("aot_eager", c) for c in sorted(FORMS)]
                         + [("inductor", c) for c in ("plain", "partial", "tables-differ")])
def test_rope_pass_on_hand_written_steps(backend, case, device):
    """A step that rotates q and k ([1, H, T, D], as transformers does) and hands them to
    ``paged_attention_new_kv`` as [T, H, D], compiled with the pass (in aot_eager's forward
    compiler, or in Inductor's pre-pass slot, where the op's call is traced again from the
    values recorded with it): the forms the launch takes are rewritten (one launch, given
    the tables), the others left as they were; either way the output and the caches equal
    the uncompiled step's (fp16; the rewritten launch rounds the rotation once, the
    uncompiled step after each op, so within fp16's tolerance)."""
    if backend == "inductor":
        inductor_available(device)
    form, shared, decode, rewritten = FORMS[case]
    dtype = torch.float16
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [Seq(1, 37, ((3, 20),)), Seq(1, 5), Seq(1, 90)] if decode else [Seq(1, 37), Seq(6, 5), Seq(1, 90)]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=16, max_ranges=1, rng=rng, device=device, num_seqs=4,
                         num_tokens=total + 2)
    t, hq, hkv, d = total + 2, 4, 2, 32
    width = d // 2 if form == "partial" else d
    angle = torch.rand(t, width // 2, generator=gen, dtype=torch.float64) * 6.3
    angle = torch.cat((angle, angle), dim=-1)
    tables = [(torch.cos(a), torch.sin(a)) for a in (angle, angle.flip(0))]
    (cos, sin), (cos_k, sin_k) = [tuple(x.to(device, dtype) for x in pair) for pair in tables]
    if shared:
        cos_k, sin_k = cos, sin
    xq = torch.randn(1, hq, t, d, generator=gen).to(device, dtype)
    xk, v = (torch.randn(1, hkv, t, d, generator=gen).to(device, dtype) for _ in range(2))
    caches = [torch.randn(16, 16, hkv, d, generator=gen).to(device, dtype) for _ in range(2)]
    empty = (torch.empty(0, device=device), torch.empty(0, device=device), torch.empty(0, device=device,
                                                                                      dtype=torch.int32))

    def step(xq, xk, v, cos, sin, cos_k, sin_k, k_cache, v_cache):
        q = rotate(xq, cos, sin, form)[0].transpose(0, 1)
        k = rotate(xk, cos_k, sin_k, form)[0].transpose(0, 1)
        out = torch.empty(t, hq, d, device=xq.device, dtype=xq.dtype)
        torch.ops.graphrt.paged_attention_new_kv(
            q, k, v[0].transpose(0, 1), k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
            meta.block_table, meta.prefix_ranges, meta.slot_mapping, *empty, max_query_len=1 if decode else None)
        return out

    rewrites = []

    def forward(gm, inputs):
        from torch._dynamo.backends.debugging import boxed_nop

        rewrites.append(fuse_rope(gm.graph))
        gm.recompile()
        return boxed_nop(gm, inputs)

    def inductor(gm, inputs):
        from torch._inductor.compile_fx import compile_fx

        rope = RopePass()
        # (Inductor's disk cache off: a cached graph would skip the pass, and the count)
        compiled = compile_fx(gm, inputs, config_patches={"post_grad_custom_pre_pass": PrePasses([rope]),
                                                          "fx_graph_cache": False})
        rewrites.append(rope.replaced)
        return compiled

    torch._dynamo.reset()
    backend = functools.partial(torch._dynamo.lookup_backend("aot_eager"), fw_compiler=forward) \
        if backend == "aot_eager" else inductor
    want_caches = [c.clone() for c in caches]
    want = step(xq, xk, v, cos, sin, cos_k, sin_k, *want_caches)
    got = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(xq, xk, v, cos, sin, cos_k, sin_k,
                                                                             *caches)
    torch._dynamo.reset()
    assert rewrites == [1 if rewritten else 0], rewrites
    atol, rtol = TOL[dtype]
    assert_close("out", got[:total], want[:total], atol, rtol, seed)
    for name, a, b in zip(("k_cache", "v_cache"), caches, want_caches):
        assert_close(name, a, b, atol, rtol, seed)


FAMILIES = {   # family -> launches rewritten per decode step (of its layers)
    "llama": 2,
    "phi3": 2,            # partial rotary (half the columns)
    "gpt-neox": 2,        # partial rotary, fused q/k/v
    "gemma3": 4,          # sliding and global layers, q/k norms, images in the prompt
    "qwen2-vl": 2,        # multimodal RoPE: the sections merged into one table before the rotation
    "smollm3": 2,         # three layers, one of them without RoPE
    "cohere": 0,          # interleaved rotary (rotate_every_two): left to Inductor
    "gpt2": 0,            # learned positions: nothing to move
}


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_rope_pass_on_transformers_families(kind, device):
    """The pass on the compiled decode bucket of each family's tiny model (aot_eager, which
    runs it too): the launches it rewrites; the mixed bucket (prompt chunks) keeps its own
    rotation."""
    pytest.importorskip("transformers")
    from graphrt.integrations.tiny import tiny_model
    from graphrt.integrations.transformers import TransformersModel

    if device.type == "cuda":
        pytest.skip("the GPU's compiled family tests run the pass under Inductor")
    model = TransformersModel(tiny_model(kind, fresh_seed()))
    cfg = model.runtime_config(block_size=16, num_blocks=64, max_num_seqs=4, max_num_tokens=48, max_model_len=128,
                               max_prefix_ranges=2)
    rt = Runtime(cfg, model, num_layers=model.num_layers, device=device, compile=CompileOptions(backend="aot_eager"))
    rt.capture(decode_buckets=[2], mixed_buckets=[16], quiet=True)
    got = {r.bucket.kind: r.ropes for r in rt.compiler.records.values()}
    assert got == {"decode": FAMILIES[kind], "mixed": 0}, got


def test_rope_pass_under_inductor_matches_transformers(device):
    """A Llama compiled by Inductor (here; on the GPU the family tests do it in bf16 and
    fp16) with the pass on: every decode bucket's two layers rewritten, and the loop's
    logits within 1e-5 of transformers' fp32 forward, as the uncompiled step's are."""
    pytest.importorskip("transformers")
    from test_transformers import run_and_compare

    if device.type == "cuda":
        pytest.skip("the GPU's family tests compile with Inductor")
    inductor_available(device)
    seed = fresh_seed()
    seen = []
    options = CompileOptions(backend="inductor", options={"fx_graph_cache": False})
    worst = run_and_compare("llama", device, torch.float32, capture=False, seed=seed, compile=options,
                            on_runtime=lambda rt: seen.append(rt))
    ropes = {r.bucket.kind: r.ropes for r in seen[0].compiler.records.values()}
    assert ropes.get("decode", 0) == 2 and ropes.get("mixed", 0) == 0, ropes
    assert worst < 1e-5, f"logits off by {worst:.2e} of max |logit| (seed={seed})"
