"""Tiny random-weight transformers models, built in code (no downloads), with a few
multimodal requests and transformers' own forward over whole sequences: what the demo and
the adapter tests run."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from graphrt.integrations.transformers import TransformersModel
from graphrt.serve import Request

KINDS = ("llama", "mistral", "gemma2", "gemma3-text", "gemma3")
VOCAB, IMAGE, BOI, EOI = 96, 95, 93, 94
TOKENS_PER_IMAGE = 16


def tiny_model(kind: str, seed: int) -> torch.nn.Module:
    """A random-weight model of the named family (one of KINDS), small enough for the interpreter."""
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
    if kind not in KINDS:
        raise ValueError(f"model kind must be one of {KINDS}, got {kind!r}")
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


def make_requests(rng: np.random.Generator, model: TransformersModel, *, images: bool, device,
                  new_tokens: int = 4) -> list[Request]:
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


def logit_error(hf, requests: list[Request], device) -> float:
    """Worst |graphrt - transformers| / max |logit| over every position the requests sampled
    at, transformers' forward running with its eager attention (switched here)."""
    configs = hf.config.sub_configs
    hf.set_attn_implementation({**{k: "eager" for k in configs}, "": "eager"} if configs else "eager")
    worst = 0.0
    for req in requests:
        want = reference_logits(hf, req, device)
        scale = want.abs().max().item()
        for pos, got in req.logits:
            worst = max(worst, (got - want[pos]).abs().max().item() / scale)
    return worst
