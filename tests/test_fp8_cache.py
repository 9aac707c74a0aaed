"""fp8 (e4m3) KV cache: write_kv quantizes with per-KV-head scales, attention dequantizes.

The kernels must match the float64 reference on the same fp8 codes (the reference
dequantizes them: ``reference.quantize`` / ``dequantize`` define the format), byte for
byte in the write, to the query dtype's tolerance in attention; and the fp8 cache's
error against an unquantized cache stays at what e4m3 allows.
"""

from __future__ import annotations

import pytest
import torch

from _cases import TOL, Seq, assert_close, build_meta, fresh_seed, rngs
from graphrt import Runtime, RuntimeConfig, SeqStep, Step
from graphrt.checking import ReferenceRunner
from graphrt.kernels import paged_attention, reference, write_kv
from graphrt.toy import ToyModel

FP8 = torch.float8_e4m3fn
SEQS = [Seq(20, 9, ((2, 12),)), Seq(1, 40), Seq(5, 33), Seq(1, 0), Seq(40, 0, ((0, 30),))]


def per_head_scales(x: torch.Tensor) -> torch.Tensor:
    """[Hkv] scales that map each head's largest |x| to e4m3's largest value, 448."""
    return (x.float().abs().amax(dim=(0, 1, 3)) / 448).clamp_min(1e-8)


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
OPTS = {"plain": (1, {}), "split-window-softcap": (3, dict(window=17, softcap=20.0)),
        "unclipped": (1, dict(window=9, window_rule="ranges_unclipped"))}
# every dtype with every option at head_dim 64; a head_dim of 12 (padded to 16 in the
# kernel) with two of them
CASES = [(o, d, 64) for d in DTYPES for o in OPTS] + [("plain", "fp16", 12), ("split-window-softcap", "bf16", 12)]


@pytest.mark.parametrize("opt,dt,head_dim", CASES, ids=[f"{o}-{d}-d{h}" for o, d, h in CASES])
def test_fp8_cache_matches_reference(opt, dt, head_dim, device):
    dtype = DTYPES[dt]
    splits, opts = OPTS[opt]
    seed = fresh_seed()
    rng, gen = rngs(seed)
    total = sum(s.q_len for s in SEQS)
    meta, _ = build_meta(SEQS, block_size=16, num_blocks=20, max_ranges=1, rng=rng, device=device, num_seqs=6,
                         num_tokens=total + 3)
    k_exact = (torch.randn(20, 16, 2, head_dim, generator=gen) * torch.tensor([0.5, 4.0])[:, None]).to(device)
    v_exact = (torch.randn(20, 16, 2, head_dim, generator=gen) * torch.tensor([2.0, 0.1])[:, None]).to(device)
    k_new = (torch.randn(total + 3, 2, head_dim, generator=gen) * torch.tensor([0.5, 4.0])[:, None]).to(device, dtype)
    v_new = (torch.randn(total + 3, 2, head_dim, generator=gen) * torch.tensor([2.0, 0.1])[:, None]).to(device, dtype)
    # calibrated as a user would: each head's largest |K| (|V|) over what the cache will hold
    k_scale = per_head_scales(torch.cat([k_exact.flatten(0, 1), k_new.float()])[None])
    v_scale = per_head_scales(torch.cat([v_exact.flatten(0, 1), v_new.float()])[None])
    q = torch.randn(total + 3, 8, head_dim, generator=gen).to(device, dtype)
    k_cache = reference.quantize(k_exact.flatten(0, 1), k_scale).view(k_exact.shape)
    v_cache = reference.quantize(v_exact.flatten(0, 1), v_scale).view(v_exact.shape)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv(k_new, v_new, k_cache, v_cache, meta, k_scale=k_scale, v_scale=v_scale)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out, meta, num_splits=splits, k_scale=k_scale, v_scale=v_scale, **opts)

    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8)), f"fp8 K codes differ (seed={seed})"
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8)), f"fp8 V codes differ (seed={seed})"
    ref = reference.paged_attention(q, k_ref, v_ref, meta, k_scale=k_scale, v_scale=v_scale, **opts)
    assert_close("out", out[:total], ref, *TOL[dtype], seed)
    assert torch.isnan(out[total:]).all(), "padded rows were written"

    # against the unquantized cache: e4m3 keeps 3 mantissa bits (relative step 1/8 to
    # 1/16), so K and V carry a few percent of error each; the output follows
    reference.write_kv(k_new, v_new, k_exact, v_exact, meta.slot_mapping)
    exact = reference.paged_attention(q, k_exact, v_exact, meta, **opts)
    worst = float((ref - exact).abs().max() / exact.abs().max())
    rms = float((ref - exact).norm() / exact.norm())
    print(f"fp8 cache vs exact cache ({dtype}, {opts}): max |err| / max |out| = {worst:.3g}, rms {rms:.3g}")
    assert rms < 0.04 and worst < 0.1, f"fp8 cache error: rms {rms:.3g}, worst {worst:.3g} of max |out| (seed={seed})"


@pytest.mark.parametrize("launch", ["decode", "mixed"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_fp8_launch_writes_new_kv(dt, splits, launch, device):
    """A launch given ``new_kv`` quantizes and writes the new K/V itself: the same codes as
    the reference write, and attention over them as the reference's (a mixed launch reads
    the new keys from k/v, rounded to the codes the cache gets)."""
    dtype = DTYPES[dt]
    seed = fresh_seed()
    rng, gen = rngs(seed)
    if launch == "decode":
        seqs = [Seq(1, 40, ((2, 30),)), Seq(1, 0), Seq(1, 200), Seq(1, 15), Seq(1, 63)]
    else:
        seqs = [Seq(1, 40, ((2, 30),)), Seq(17, 150), Seq(1, 15), Seq(3, 60), Seq(30, 0, ((5, 20),))]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=30, max_ranges=1, rng=rng, device=device, num_seqs=6,
                         num_tokens=total + 2)
    spread = torch.tensor([0.5, 4.0])[:, None]
    old_scale = torch.full((2,), 0.01, device=device)      # what the cached context was written with
    k_cache, v_cache = (reference.quantize(torch.randn(480, 2, 64, generator=gen).to(device), old_scale)
                        .view(30, 16, 2, 64) for _ in range(2))
    k_new, v_new = ((torch.randn(total + 2, 2, 64, generator=gen) * spread).to(device, dtype) for _ in range(2))
    k_scale, v_scale = per_head_scales(k_new[None]), per_head_scales(v_new[None])
    k_new[total:] = v_new[total:] = float("nan")        # rows of no token: must reach no output
    q = torch.randn(total + 2, 8, 64, generator=gen).to(device, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    out = torch.full_like(q, float("nan"))

    paged_attention(q, k_cache, v_cache, out, meta, num_splits=splits, max_query_len=1 if launch == "decode" else None,
                    k_scale=k_scale, v_scale=v_scale, new_kv=(k_new, v_new))

    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8)), f"fp8 K codes differ (seed={seed})"
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8)), f"fp8 V codes differ (seed={seed})"
    ref = reference.paged_attention(q, k_ref, v_ref, meta, k_scale=k_scale, v_scale=v_scale)
    assert_close("out", out[:total], ref, *TOL[dtype], seed)
    assert torch.isnan(out[total:]).all(), "padded rows were written"


@pytest.mark.parametrize("launch", ["decode", "mixed"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_fp8_launch_applies_rope(dt, launch, device):
    """``rope`` with an fp8 cache: the new k is rotated (rounded to q's dtype) before it is
    quantized, as ``apply_rope`` then the reference write do; q is rotated alike. The codes
    equal the reference's where the rotation rounds alike (Triton may contract the rotation's
    multiply-adds on a GPU, which can move a rounding by one step: at most 1 % of the codes,
    each within one e4m3 step), and attention over them matches the reference's."""
    from graphrt.kernels.paged_attention import apply_rope

    dtype = DTYPES[dt]
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = [Seq(1, 40, ((2, 30),)), Seq(1, 0), Seq(1, 200), Seq(1, 15)] if launch == "decode" else \
        [Seq(1, 40, ((2, 30),)), Seq(17, 150), Seq(3, 60), Seq(30, 0, ((5, 20),))]
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=30, max_ranges=1, rng=rng, device=device, num_seqs=5,
                         num_tokens=total + 2)
    old_scale = torch.full((2,), 0.01, device=device)
    k_cache, v_cache = (reference.quantize(torch.randn(480, 2, 64, generator=gen).to(device), old_scale)
                        .view(30, 16, 2, 64) for _ in range(2))
    k_new, v_new = ((torch.randn(total + 2, 2, 64, generator=gen)).to(device, dtype) for _ in range(2))
    q = torch.randn(total + 2, 8, 64, generator=gen).to(device, dtype)
    angle = torch.rand(total + 2, 16, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = (f(torch.cat((angle, angle), dim=1)).to(device, dtype) for f in (torch.cos, torch.sin))  # 32 of 64
    k_rot, q_rot = apply_rope(k_new, cos, sin), apply_rope(q, cos, sin)
    k_scale, v_scale = per_head_scales(k_rot[None]), per_head_scales(v_new[None])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_rot, v_new, k_ref, v_ref, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    out = torch.full_like(q, float("nan"))

    paged_attention(q, k_cache, v_cache, out, meta, max_query_len=1 if launch == "decode" else None,
                    k_scale=k_scale, v_scale=v_scale, new_kv=(k_new, v_new), rope=(cos, sin))

    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8)), f"fp8 V codes differ (seed={seed})"
    differ = k_cache.view(torch.uint8) != k_ref.view(torch.uint8)
    got, want = (reference.dequantize(c.flatten(0, 1), k_scale).double() for c in (k_cache, k_ref))
    step = want.abs() / 8 + 2.0 ** -9 * k_scale.double().max()     # one e4m3 step (3 mantissa bits; subnormals)
    assert differ.float().mean() <= 0.01 and ((got - want).abs() <= step).all(), \
        f"fp8 K codes differ: {int(differ.sum())} (seed={seed})"
    ref = reference.paged_attention(q_rot, k_cache, v_cache, meta, k_scale=k_scale, v_scale=v_scale)
    assert_close("out", out[:total], ref, *TOL[dtype], seed)


@pytest.mark.parametrize("how", ["write_kv", "decode-launch", "mixed-launch"])
def test_fp8_codes_of_non_finite_values(how, device):
    """A NaN K/V value is stored as e4m3's NaN (of its sign), as a bf16 cache keeps it and
    as the reference quantizes it, not saturated to -448 * scale (a finite value that would
    hide it); +-inf saturate to +-448 * scale. The write alone and the launches that write
    the new K/V themselves (the mixed one reads them from k/v in bulk copies too)."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    seqs = ([Seq(1, 40), Seq(1, 7), Seq(1, 0)] if how == "decode-launch" else
            [Seq(1, 40), Seq(30, 0, ((5, 20),)), Seq(17, 20)])
    total = sum(s.q_len for s in seqs)
    meta, _ = build_meta(seqs, block_size=16, num_blocks=12, max_ranges=1, rng=rng, device=device, num_seqs=4,
                         num_tokens=total)
    k_new, v_new = (torch.randn(total, 2, 64, generator=gen) for _ in range(2))
    for t in (k_new, v_new):          # NaN of both signs and both infinities, at random places
        flat = t.view(-1)
        picks = torch.randperm(flat.numel(), generator=gen)[:8]
        flat[picks] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")] * 2)
    k_new, v_new = k_new.to(device, torch.bfloat16), v_new.to(device, torch.bfloat16)
    scale = torch.full((2,), 0.02, device=device)
    k_cache, v_cache = (torch.zeros(12, 16, 2, 64, device=device, dtype=FP8) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_new, v_new, k_ref, v_ref, meta.slot_mapping, k_scale=scale, v_scale=scale)
    if how == "write_kv":
        write_kv(k_new, v_new, k_cache, v_cache, meta, k_scale=scale, v_scale=scale)
    else:
        q = torch.randn(total, 8, 64, generator=gen).to(device, torch.bfloat16)
        paged_attention(q, k_cache, v_cache, torch.empty_like(q), meta, k_scale=scale, v_scale=scale,
                        max_query_len=1 if how == "decode-launch" else None, new_kv=(k_new, v_new))
    assert bool(k_ref.float().isnan().any()), "the case holds no NaN"
    for name, got, want in (("K", k_cache, k_ref), ("V", v_cache, v_ref)):
        nan = want.float().isnan()        # (which of e4m3's two NaNs the hardware gives is its own)
        assert torch.equal(got.float().isnan(), nan), \
            f"fp8 {name}: NaN codes not where the reference has them (seed={seed})"
        assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), \
            f"fp8 {name} codes differ (seed={seed})"


@pytest.mark.parametrize("magnitude", [1e-7, 1.0, 1e5], ids=["tiny", "unit", "huge"])
def test_fp8_cache_bf16_query_any_magnitude(magnitude, device):
    """With an fp8 cache a bf16 query is taken to fp16 for the dots, scaled by a power of
    two that fits its largest value: queries far outside fp16's range (|q| ~ 1e5) or deep
    below its subnormals (~1e-7) still match the reference."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    total = sum(s.q_len for s in SEQS)
    meta, _ = build_meta(SEQS, block_size=16, num_blocks=20, max_ranges=1, rng=rng, device=device, num_seqs=6,
                         num_tokens=total)
    k_cache = reference.quantize(torch.randn(320, 2, 64, generator=gen).to(device), torch.full((2,), 0.01,
                                 device=device)).view(20, 16, 2, 64)
    v_cache = reference.quantize(torch.randn(320, 2, 64, generator=gen).to(device), torch.full((2,), 0.01,
                                 device=device)).view(20, 16, 2, 64)
    scales = dict(k_scale=torch.full((2,), 0.01, device=device), v_scale=torch.full((2,), 0.01, device=device))
    q = (torch.randn(total, 8, 64, generator=gen) * magnitude).to(device, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    # a scale ~1/magnitude (within the accepted [1e-6, 1e6]) keeps the logits' spread near
    # unit magnitude's: the softmax stays soft
    scale = min(0.125 / magnitude, 1e6)
    paged_attention(q, k_cache, v_cache, out, meta, scale=scale, **scales)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, scale=scale, **scales)
    assert_close(f"out (|q| ~ {magnitude:g})", out, ref, *TOL[torch.bfloat16], seed)


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_fp8_cache_non_finite_query_stays_in_its_row(value, device):
    """With an fp8 cache a bf16 query tile is scaled by a power of two from its largest
    |value|: one inf (or NaN) in one query row must not set that factor for the rows beside
    it (other query heads of the KV head, other tokens of the sequence), which must match
    the reference as if it were not there."""
    seed = fresh_seed()
    rng, gen = rngs(seed)
    total = sum(s.q_len for s in SEQS)
    meta, _ = build_meta(SEQS, block_size=16, num_blocks=20, max_ranges=1, rng=rng, device=device, num_seqs=6,
                         num_tokens=total)
    scale = torch.full((2,), 0.01, device=device)
    k_cache, v_cache = (reference.quantize(torch.randn(320, 2, 64, generator=gen).to(device), scale)
                        .view(20, 16, 2, 64) for _ in range(2))
    q = torch.randn(total, 8, 64, generator=gen).to(device, torch.bfloat16)
    bad = [(20, 1, 5), (3, 6, 0), (total - 3, 2, 63)]     # (token, head, dim): a decode, prefill tokens
    for t, h, d in bad:
        q[t, h, d] = value
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out, meta, k_scale=scale, v_scale=scale)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, k_scale=scale, v_scale=scale)
    clean = torch.ones(total, 8, dtype=torch.bool)
    for t, h, _ in bad:
        clean[t, h] = False
    assert_close("out (rows without the non-finite value)", out[clean], ref[clean], *TOL[torch.bfloat16], seed)


def test_fp8_write_rounds_like_torch(device):
    """Every e4m3 rounding case (ties, subnormals, saturation, signed zero) as torch's cast."""
    values = torch.cat([torch.linspace(-500, 500, 2003), torch.linspace(-0.03, 0.03, 1001),
                        torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 31.99, 2 ** -9 * 1.5, 2 ** -9 * 2.5])])
    n = values.numel() // 2 * 2
    k = values[:n].reshape(-1, 2, 1).expand(-1, 2, 16).contiguous().to(device)     # [T, Hkv=2, D=16]
    slots = torch.arange(k.shape[0], dtype=torch.int64, device=device)
    cache_blocks = -(-k.shape[0] // 16)
    k_cache = torch.zeros(cache_blocks, 16, 2, 16, dtype=FP8, device=device)
    v_cache = k_cache.clone()
    scale = torch.tensor([1.0, 0.5], device=device)
    write_kv(k, k, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    want = (k.float() / scale[:, None]).clamp(-448, 448).to(FP8)
    got = k_cache.flatten(0, 1)[: k.shape[0]]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fp8_runtime_matches_reference_runner(device):
    """A toy model on an fp8-cache runtime, scales set per layer and head, over prefill then
    decode steps: matches the reference runner with the same scales."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=32, max_num_seqs=4,
                        max_num_tokens=64, max_model_len=128, max_prefix_ranges=2, dtype=dtype,
                        kv_cache_dtype=FP8)
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, device=device)
    rt = Runtime(cfg, model, num_layers=2, device=device)
    rt.set_kv_scales([[0.004, 0.006], [0.005, 0.003]], 0.004)
    ref = ReferenceRunner(cfg, model, num_layers=2, device=device, kv_scales=(rt.k_scales, rt.v_scales))
    rt.capture(decode_buckets=[2], mixed_buckets=[64], quiet=True)
    steps = [Step([SeqStep(q_len=20, context_len=0, block_ids=[0, 1], prefix_ranges=[(3, 10)]),
                   SeqStep(q_len=9, context_len=0, block_ids=[2])])]
    steps += [Step([SeqStep(q_len=1, context_len=20 + i, block_ids=[0, 1]),
                    SeqStep(q_len=1, context_len=9 + i, block_ids=[2])]) for i in range(3)]
    seed = fresh_seed()
    rng, _ = rngs(seed)
    for step in steps:
        ids = rng.integers(0, 50, step.num_tokens)
        _, logits = rt.step(step, ids)
        _, want = ref.step(step, ids)
        scale = float(want.abs().max())
        err = float((logits[: step.num_seqs].double().cpu() - want.double().cpu()).abs().max()) / scale
        assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"{rt.last.mode} step: {err:.3g} (seed={seed})"


@pytest.mark.parametrize("call,err,match", [
    (lambda a: paged_attention(a["q"], a["kc"], a["vc"], a["out"], a["meta"]), TypeError,
     r"^k_scale must be a \[2\] float32 tensor for fp8 caches"),
    (lambda a: paged_attention(a["q"], a["kc"], a["vc"], a["out"], a["meta"], k_scale=a["s"][:1], v_scale=a["s"]),
     ValueError, r"^k_scale must be a contiguous \[2\] float32 tensor"),
    (lambda a: paged_attention(a["q"], a["kc"], a["vc"].float(), a["out"], a["meta"], k_scale=a["s"], v_scale=a["s"]),
     TypeError, r"^k_cache is torch.float8_e4m3fn but q is torch.float32"),
    (lambda a: paged_attention(a["q"], a["kc"].float(), a["vc"].float(), a["out"], a["meta"], k_scale=a["s"],
                               v_scale=a["s"]), ValueError, r"^k_scale is for fp8 caches"),
    (lambda a: write_kv(a["q"][:, :2], a["q"][:, :2], a["kc"], a["vc"], a["meta"], k_scale=a["s"].double(),
                        v_scale=a["s"]), ValueError, r"^k_scale must be a contiguous \[2\] float32 tensor"),
], ids=["no-scales", "scale-shape", "mixed-caches", "scales-without-fp8", "scale-dtype"])
def test_fp8_arguments_refused(call, err, match, device):
    rng, _ = rngs(0)
    meta, _ = build_meta([Seq(3, 5)], block_size=16, num_blocks=4, max_ranges=1, rng=rng, device=device)
    args = dict(q=torch.randn(3, 4, 32, device=device), kc=torch.zeros(4, 16, 2, 32, dtype=FP8, device=device),
                vc=torch.zeros(4, 16, 2, 32, dtype=FP8, device=device), meta=meta, s=torch.ones(2, device=device))
    args["out"] = torch.empty_like(args["q"])
    with pytest.raises(err, match=match):
        call(args)


def test_fp8_config_and_scales_refused():
    fields = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=8, max_num_seqs=2,
                  max_num_tokens=8, max_model_len=64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^RuntimeConfig.kv_cache_dtype must be None"):
        RuntimeConfig(kv_cache_dtype=torch.float16, **fields)
    rt = Runtime(RuntimeConfig(kv_cache_dtype=FP8, **fields), lambda ctx: None, num_layers=3, device="cpu")
    assert rt.k_caches[0].dtype == FP8 and tuple(rt.k_scales.shape) == (3, 2)
    with pytest.raises(ValueError, match=r"^k_scales must be finite and > 0"):
        rt.set_kv_scales(0.0, 1.0)
    with pytest.raises(ValueError, match=r"^v_scales must broadcast to \(3, 2\)"):
        rt.set_kv_scales(1.0, [1.0, 2.0, 3.0])
    rt.set_kv_scales([0.5, 0.25], 2.0)
    assert rt.k_scales.tolist() == [[0.5, 0.25]] * 3 and rt.v_scales.tolist() == [[2.0, 2.0]] * 3
    plain = Runtime(RuntimeConfig(**fields), lambda ctx: None, num_layers=1, device="cpu")
    with pytest.raises(ValueError, match=r"^set_kv_scales is for fp8 caches"):
        plain.set_kv_scales(1.0, 1.0)
