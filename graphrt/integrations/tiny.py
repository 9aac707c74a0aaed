"""Tiny random-weight transformers models of many families, built in code (no downloads),
with a few requests (images where the family has them) and transformers' own forward over
whole sequences: what the demo and the adapter tests run.

Weights are drawn wide (each matrix with standard deviation 1/sqrt(fan-in), norms and biases
off their defaults) so that attention is far from uniform and logits far from zero: a wrong
mask, scale or head shows in the logits. A mixture of experts' router is drawn eight times
wider still: its logits then rarely come within bf16's rounding of a tie between the last
expert chosen and the next, where a bf16 forward and an fp32 one (or two bf16 ones that
round at different points) would route a token to different experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import transformers

from graphrt.integrations.transformers import TransformersModel
from graphrt.serve import Request

VOCAB, IMAGE, BOI, EOI, VIDEO = 96, 95, 93, 94, 92
TOKENS_PER_IMAGE = 16
ROUTER = ".gate.weight"          # a mixture of experts' router (Mixtral, Qwen3-MoE), not a gate_proj
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, pad_token_id=0)


@dataclass(frozen=True)
class Family:
    """One family of the test matrix: its transformers class, what it exercises, how its
    prompts hold images (None: text only; "ranges": each image a prefix range; "prefix":
    image + prompt one range; "mrope": causal, three position rows), a builder, and the
    first transformers release whose code of it graphrt runs (older ones: refused)."""

    cls: str
    exercises: str
    images: str | None
    build: Callable[[], torch.nn.Module]
    since: str = "5.17"

    def runs_on(self, version: str) -> bool:
        """Whether transformers ``version`` runs this family's attention through the interface."""
        from packaging.version import Version

        return Version(version) >= Version(self.since)


def _lm(name: str, **config) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**config))


def _gemma3(text_only: bool) -> torch.nn.Module:
    text = transformers.Gemma3TextConfig(num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=24,
                                         layer_types=["sliding_attention", "full_attention"] * 2, head_dim=32,
                                         **_COMMON)
    if text_only:
        return transformers.Gemma3ForCausalLM(text)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=_siglip(), mm_tokens_per_image=TOKENS_PER_IMAGE,
                                    image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    return transformers.Gemma3ForConditionalGeneration(cfg)


def _siglip():
    return transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8)


def _paligemma() -> torch.nn.Module:
    text = transformers.GemmaConfig(num_hidden_layers=2, head_dim=32, **{**_COMMON, "num_key_value_heads": 1})
    cfg = transformers.PaliGemmaConfig(text_config=text, vision_config=_siglip(), image_token_index=IMAGE,
                                       projection_dim=64, hidden_size=64, vocab_size=VOCAB)
    return transformers.PaliGemmaForConditionalGeneration(cfg)


def _qwen2_vl() -> torch.nn.Module:
    # head_dim 16: mrope_section splits its 8 rotary frequencies over time, height and width
    text = dict(**_COMMON, num_hidden_layers=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                     mrope_section=[2, 3, 3]))
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                     video_token_id=VIDEO, vision_start_token_id=BOI, vision_end_token_id=EOI)
    return transformers.Qwen2VLForConditionalGeneration(cfg)


def _qwen2_5_vl() -> torch.nn.Module:
    text = dict(**_COMMON, num_hidden_layers=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                     mrope_section=[2, 3, 3]))
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16,
                  fullatt_block_indexes=[1])
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                        video_token_id=VIDEO, vision_start_token_id=BOI, vision_end_token_id=EOI)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


_WINDOWED = ["sliding_attention", "full_attention"]
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "GQA, llama3 RoPE scaling", None, _lm(
        "Llama", num_hidden_layers=2, head_dim=32, **_COMMON, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))),
    "mistral": Family("MistralForCausalLM", "a sliding window on every layer", None,
                      _lm("Mistral", num_hidden_layers=2, sliding_window=7, head_dim=32, **_COMMON)),
    "qwen2": Family("Qwen2ForCausalLM", "q/k/v biases", None, _lm("Qwen2", num_hidden_layers=2, **_COMMON)),
    "qwen3": Family("Qwen3ForCausalLM", "q/k norms", None,
                    _lm("Qwen3", num_hidden_layers=2, head_dim=32, **_COMMON)),
    "qwen3-moe": Family("Qwen3MoeForCausalLM", "mixture of experts, q/k norms", None, _lm(
        "Qwen3Moe", num_hidden_layers=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        **_COMMON)),
    "mixtral": Family("MixtralForCausalLM", "mixture of experts", None, _lm(
        "Mixtral", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **_COMMON)),
    "phi3": Family("Phi3ForCausalLM", "fused qkv, partial rotary (half), sliding window", None, _lm(
        "Phi3", num_hidden_layers=2, sliding_window=7, **_COMMON,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "phi": Family("PhiForCausalLM", "parallel attention and MLP, partial rotary, q/k layer norms, LM-head bias", None,
                  _lm("Phi", num_hidden_layers=2, qk_layernorm=True, **_COMMON)),
    "olmo2": Family("Olmo2ForCausalLM", "norms after attention and MLP, q/k norms over all heads", None,
                    _lm("Olmo2", num_hidden_layers=2, **_COMMON)),
    "olmo3": Family("Olmo3ForCausalLM", "sliding and global layers", None,
                    _lm("Olmo3", num_hidden_layers=2, sliding_window=5, layer_types=_WINDOWED, **_COMMON)),
    "granite": Family("GraniteForCausalLM", "embedding, attention, residual multipliers; logits divided by "
                      "logits_scaling", None, _lm(
                          "Granite", num_hidden_layers=2, logits_scaling=8.0, embedding_multiplier=3.0,
                          residual_multiplier=0.5, attention_multiplier=0.3, **_COMMON)),
    "cohere": Family("CohereForCausalLM", "parallel attention and MLP, q/k norms, logits times logit_scale", None,
                     _lm("Cohere", num_hidden_layers=2, logit_scale=0.25, use_qk_norm=True, **_COMMON)),
    "cohere2": Family("Cohere2ForCausalLM", "sliding layers with RoPE, global layers without; logit_scale", None,
                      _lm("Cohere2", num_hidden_layers=2, sliding_window=5, layer_types=_WINDOWED, logit_scale=4.0,
                          head_dim=32, **_COMMON)),
    "gpt-neox": Family("GPTNeoXForCausalLM", "multi-head (no KV-head field), partial rotary (quarter), base model "
                       "named gpt_neox", None, _lm(
                           "GPTNeoX", num_hidden_layers=2, **{k: v for k, v in _COMMON.items()
                                                               if k != "num_key_value_heads"})),
    "falcon": Family("FalconForCausalLM", "decoder layers that pass no attention arguments on, base model named "
                     "transformer", None, _lm(
                         "Falcon", num_hidden_layers=2, new_decoder_architecture=True, num_kv_heads=2, alibi=False,
                         **{k: v for k, v in _COMMON.items() if k not in ("num_key_value_heads", "intermediate_size")}),
                     # before 5.25 Falcon's attention was its own code, which needs transformers' dense mask
                     since="5.25"),
    "smollm3": Family("SmolLM3ForCausalLM", "a layer without RoPE, sliding layers", None, _lm(
        "SmolLM3", num_hidden_layers=3, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], **_COMMON)),
    "gpt2": Family("GPT2LMHeadModel", "learned absolute positions, Conv1D projections, multi-head", None,
                   lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
                       n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=512))),
    "opt": Family("OPTForCausalLM", "learned positions offset by 2, ReLU MLP", None,
                  lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
                      num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=96, vocab_size=VOCAB,
                      word_embed_proj_dim=64, max_position_embeddings=512, pad_token_id=1))),
    "gemma": Family("GemmaForCausalLM", "scaled embeddings, (1 + w) norms, GeGLU", None,
                    _lm("Gemma", num_hidden_layers=2, head_dim=32, **_COMMON)),
    "gemma2": Family("Gemma2ForCausalLM", "attention and final logit soft-caps, query_pre_attn_scalar, sliding "
                     "layers", None, _lm(
                         "Gemma2", num_hidden_layers=2, sliding_window=6, query_pre_attn_scalar=24,
                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0, head_dim=32, **_COMMON)),
    "gemma3-text": Family("Gemma3ForCausalLM", "sliding and global layers, two RoPE bases, q/k norms", None,
                          lambda: _gemma3(True)),
    "gemma3": Family("Gemma3ForConditionalGeneration", "images as prefix ranges clipped by the window, their "
                     "SigLIP embeddings given per step", "ranges", lambda: _gemma3(False)),
    "paligemma": Family("PaliGemmaForConditionalGeneration", "prefix-LM (image and prompt one range), positions "
                        "from 1", "prefix", _paligemma),
    "qwen2-vl": Family("Qwen2VLForConditionalGeneration", "multimodal RoPE (three position rows in the step's "
                       "copy), images cut across chunks", "mrope", _qwen2_vl),
    "qwen2.5-vl": Family("Qwen2_5_VLForConditionalGeneration", "multimodal RoPE, a windowed vision tower",
                         "mrope", _qwen2_5_vl),
}
KINDS = tuple(FAMILIES)


def tiny_model(kind: str, seed: int) -> torch.nn.Module:
    """A random-weight model of the named family (one of KINDS), small enough for the
    interpreter, weights drawn wide (module doc)."""
    if kind not in FAMILIES:
        raise ValueError(f"model kind must be one of {KINDS}, got {kind!r}")
    torch.manual_seed(seed)
    return widen(FAMILIES[kind].build(), seed).eval()


@torch.no_grad()
def widen(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw a language model's weights wide (module doc), from ``seed``; the vision
    tower's are left as they are. The draws are made on the CPU (the same weights on any
    device) and copied to each parameter's device."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if any(part in name for part in ("vision", "visual")):
            continue
        if p.dim() >= 2:                 # matrices (and stacked experts): unit-variance outputs
            wide = 8.0 if name.endswith(ROUTER) else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * wide / p.shape[-1] ** 0.5)   # drawn on the CPU, copied over
        else:                            # norms' weights, biases: off their defaults
            p.add_((0.1 * torch.randn(p.shape, generator=gen)).to(p.device))
    return model


@torch.no_grad()
def nudge(model: torch.nn.Module, share: float, seed: int) -> torch.nn.Module:
    """Move every weight matrix and vector of ``model`` by ``share`` of its own spread, from
    ``seed`` (drawn on the CPU): a model that agrees with the original some of the time (a
    speculative draft of it, say)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.numel() > 1:
            p.add_((torch.randn(p.shape, generator=gen) * p.std().cpu() * share).to(p.device, p.dtype))
    return model


def make_requests(rng: np.random.Generator, model: TransformersModel, *, kind: str, device,
                  new_tokens: int = 4) -> list[Request]:
    """Three requests joining at steps 0, 1 and 3; where the family takes images, the first
    holds two (one where the image leads a prefix-LM's prompt) and the third one, of 16
    tokens each (longer than the sliding windows)."""
    images = FAMILIES[kind].images
    reqs = []
    for rid, (arrival, n_images) in enumerate([(0, 2), (1, 0), (3, 1)]):
        text = lambda lo, hi: rng.integers(0, VIDEO, int(rng.integers(lo, hi))).tolist()
        n_images = n_images if images else 0
        if images == "prefix":           # PaliGemma: the image first, then the prompt
            n_images = min(n_images, 1)
            prompt = [IMAGE] * TOKENS_PER_IMAGE * n_images + text(3, 9)
        else:
            prompt = text(3, 9)
            for _ in range(n_images):
                prompt += [BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI] + text(2, 6)
        req = Request(rid=rid, arrival=arrival, prompt=prompt, new_tokens=new_tokens + rid)
        req.ranges, req.images = model.prefix_ranges(prompt), model.image_ranges(prompt)
        if n_images:
            gen = torch.Generator().manual_seed(int(rng.integers(1e9)))
            if images == "mrope":        # flattened patches of an 8 x 8 grid; 2 x 2 merged: 16 tokens
                patch = 3 * 2 * 4 * 4
                req.pixels = torch.randn(n_images * 64, patch, generator=gen)
                req.image_grid_thw = torch.tensor([[1, 8, 8]] * n_images)
                extra = dict(image_grid_thw=req.image_grid_thw.to(device))
            else:
                req.pixels = torch.randn(n_images, 3, 32, 32, generator=gen)
                extra = {}
            req.features = model.image_features(req.pixels.to(device=device, dtype=model.hf.dtype), **extra)
        req.positions, req.position_delta = model.prompt_positions(prompt, image_grid_thw=req.image_grid_thw)
        reqs.append(req)
    return reqs


def reference_logits(hf, req: Request, device) -> torch.Tensor:
    """transformers' own forward over the whole sequence (prompt + generated): [L, vocab]."""
    ids = torch.tensor([req.prompt + req.generated[:-1]], device=device)
    kwargs = {}
    kind = hf.config.model_type
    if kind == "paligemma":              # the prompt is the prefix (type 0), generated tokens the suffix
        types = torch.ones_like(ids)
        types[:, : len(req.prompt)] = 0
        kwargs["token_type_ids"] = types
    if getattr(req, "pixels", None) is not None:
        kwargs["pixel_values"] = req.pixels.to(device=device, dtype=hf.dtype)
        if kind == "gemma3":
            kwargs["token_type_ids"] = (ids == IMAGE).long()
        if req.image_grid_thw is not None:
            kwargs.update(image_grid_thw=req.image_grid_thw.to(device), mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        return hf(input_ids=ids, **kwargs).logits[0].float()


def logit_error(hf, requests: list[Request], device) -> float:
    """Worst |graphrt - transformers| / max |logit| over every position the requests sampled
    at (``logit_errors``' first figure)."""
    return logit_errors(hf, requests, device)[0]


def logit_errors(hf, requests: list[Request], device) -> tuple[float, float]:
    """(worst, root mean square) of |graphrt - transformers| / max |logit| (a request's
    largest reference logit) over every logit of every position the requests sampled at,
    transformers' forward running with its eager attention, the library's reference
    (transformers 5.17's default SDPA path drops Gemma2's attention soft-cap: 4e-2 off);
    the model's own implementation is put back afterwards."""
    configs = _configs(hf.config)
    before = [c._attn_implementation_internal for c in configs]
    hf.set_attn_implementation("eager")
    try:
        errs = []
        for req in requests:
            want = reference_logits(hf, req, device)
            if req.logits:
                got = torch.stack([g for _, g in req.logits])                     # [positions, vocab]
                errs.append(((got - want[[pos for pos, _ in req.logits]]).abs() / want.abs().max()).flatten())
    finally:
        for c, impl in zip(configs, before):
            c._attn_implementation_internal = impl
    if not errs:
        return 0.0, 0.0
    err = torch.cat(errs).double()
    return err.max().item(), err.square().mean().sqrt().item()


def _configs(config) -> list:
    """A config and its sub-configs, at any depth."""
    out = [config]
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            out += _configs(sub)
    return out
