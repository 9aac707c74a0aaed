"""The transformers adapter against transformers' own forward: tiny random models built in
code (no downloads), a multi-step serving loop (chunked prefill, decodes, requests joining
and finishing at different steps, images as prefix ranges with their embeddings given per
step), each sampled position's logits compared with the library's forward over the full
sequence. CPU: fp32 through the interpreter. GPU: every step a graph replay, bf16/fp16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from _cases import fresh_seed  # noqa: E402
from graphrt import Runtime  # noqa: E402
from graphrt.integrations.transformers import TransformersModel  # noqa: E402
from graphrt.serve import Request, serve  # noqa: E402

VOCAB, IMAGE, BOI, EOI = 96, 95, 93, 94
TOKENS_PER_IMAGE = 16


def tiny_model(kind: str, seed: int) -> torch.nn.Module:
    """A random-weight model of the named family, small enough for the interpreter."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64), **common)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "mistral":                         # a sliding window on every layer
        return transformers.MistralForCausalLM(transformers.MistralConfig(num_hidden_layers=2, sliding_window=7,
                                                                          **common))
    if kind == "gemma2":                          # attention and final logit soft-caps
        cfg = transformers.Gemma2Config(num_hidden_layers=2, sliding_window=6, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **common)
        return transformers.Gemma2ForCausalLM(cfg)
    text = transformers.Gemma3TextConfig(num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=24,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         **common)
    if kind == "gemma3-text":
        return transformers.Gemma3ForCausalLM(text)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                                    image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    return transformers.Gemma3ForConditionalGeneration(cfg)


def make_requests(rng, model: TransformersModel, *, images: bool, device, new_tokens: int = 4) -> list[Request]:
    """Three requests joining at steps 0, 1 and 3; with images, the first holds two and the
    third one (16 tokens each: longer than the sliding window)."""
    reqs = []
    for rid, (arrival, n_images) in enumerate([(0, 2), (1, 0), (3, 1)]):
        parts = [rng.integers(0, BOI, int(rng.integers(3, 9))).tolist()]
        for _ in range(n_images if images else 0):
            parts += [[BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI], rng.integers(0, BOI, int(rng.integers(2, 6))).tolist()]
        prompt = sum(parts, [])
        req = Request(rid=rid, arrival=arrival, prompt=prompt, new_tokens=new_tokens + rid)
        if images and n_images:
            req.ranges = model.image_ranges(prompt)
            req.pixels = torch.randn(n_images, 3, 32, 32, generator=torch.Generator().manual_seed(int(rng.integers(1e9))))
            req.features = model.image_features(req.pixels.to(device=device, dtype=model.hf.dtype))
        reqs.append(req)
    return reqs


def reference_logits(hf, req: Request, device) -> torch.Tensor:
    """transformers' own forward over the whole sequence (prompt + generated): [L, vocab]."""
    ids = torch.tensor([req.prompt + req.generated[:-1]], device=device)
    kwargs = {}
    if getattr(req, "pixels", None) is not None:
        kwargs = dict(pixel_values=req.pixels.to(device=device, dtype=hf.dtype), token_type_ids=(ids == IMAGE).long())
    with torch.no_grad():
        return hf(input_ids=ids, **kwargs).logits[0].float()


def run_and_compare(kind: str, device, dtype, *, capture: bool, seed: int, chunk: int = 12) -> float:
    """Worst |graphrt - transformers| / max |logit| over every sampled position."""
    rng = np.random.default_rng(seed)
    hf = tiny_model(kind, seed).to(device=device, dtype=dtype).eval()
    model = TransformersModel(hf)
    cfg = model.runtime_config(block_size=16, num_blocks=64, max_num_seqs=4, max_num_tokens=48, max_model_len=128,
                               max_prefix_ranges=2)
    rt = Runtime(cfg, model, num_layers=model.num_layers, device=device, strict=capture)
    if capture:
        rt.capture(decode_buckets=[1, 2, 4], mixed_buckets=[16, 48], quiet=True)
    reqs = make_requests(rng, model, images=kind == "gemma3", device=device)
    modes = []
    serve(rt, reqs, chunk=chunk, free_blocks=rng.permutation(cfg.num_blocks).tolist(), never=(BOI, EOI, IMAGE),
          on_step=lambda *_: modes.append(rt.last.mode))
    if capture:
        assert set(modes) == {"replay"}, f"steps ran {modes}"
    hf.set_attn_implementation({k: "eager" for k in hf.config.sub_configs} | {"": "eager"}
                               if hf.config.sub_configs else "eager")
    worst = 0.0
    for req in reqs:
        want = reference_logits(hf, req, device)
        scale = want.abs().max().item()
        for pos, got in req.logits:
            worst = max(worst, (got - want[pos]).abs().max().item() / scale)
    return worst


KINDS = ["llama", "mistral", "gemma2", "gemma3-text", "gemma3"]


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_matches_transformers_cpu(kind, device):
    if device.type == "cuda":
        pytest.skip("the GPU test below runs the same loop from graphs")
    seed = fresh_seed()
    worst = run_and_compare(kind, device, torch.float32, capture=False, seed=seed)
    print(f"{kind}: worst logit error / max |logit| = {worst:.2e}")
    assert worst < 1e-5, f"{kind}: logits off by {worst:.2e} of max |logit| (seed={seed})"


@pytest.mark.parametrize("rule,global_ranges", [("ranges_unclipped", True), ("clip", False)],
                         ids=["ranges-unclipped", "global-layers-causal"])
def test_gemma3_other_mask_settings_are_caught(monkeypatch, device, rule, global_ranges):
    """The check above tells mask settings apart: with images longer than the sliding
    window, the rule older transformers and vLLM used (ranges past the window), or
    Gemma4's causal-only global layers, put Gemma3's logits off by ~1e-2 (2e-2..6e-2 seen)."""
    from graphrt.integrations import transformers as adapter

    monkeypatch.setitem(adapter.MASK_SETTINGS, "gemma3", adapter.MaskSettings(rule, global_ranges))
    seed = fresh_seed()
    worst = run_and_compare("gemma3", device, torch.float32, capture=False, seed=seed)
    assert worst > 1e-3, f"wrong mask settings went unnoticed: {worst:.2e} (seed={seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adapter_matches_transformers_replayed(kind, dtype):
    seed = fresh_seed()
    worst = run_and_compare(kind, torch.device("cuda"), dtype, capture=True, seed=seed)
    print(f"{kind} {dtype}: worst logit error / max |logit| = {worst:.2e}")
    assert worst < (5e-2 if dtype == torch.bfloat16 else 1e-2), f"{kind}: off by {worst:.2e} (seed={seed})"


def test_dynamic_rope_is_refused():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="dynamic"):
        TransformersModel(transformers.LlamaForCausalLM(cfg))


def test_image_ranges():
    model = TransformersModel(tiny_model("gemma3", 0))
    ids = [1, BOI, IMAGE, IMAGE, EOI, IMAGE, 2, IMAGE]
    assert model.image_ranges(ids) == [(2, 4), (5, 6), (7, 8)]
