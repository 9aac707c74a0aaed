"""Run a Hugging Face ``transformers`` decoder's own modeling code on the graphrt runtime.

The model's layers and weights are used as they are: graphrt registers an attention
function with transformers' ``AttentionInterface`` (name ``"graphrt"``) and points the text
model at it, so each attention module still projects, normalises (qk-norm) and rotates
(RoPE) its own q/k/v, then hands them to ``StepContext.attention`` (KV-cache write + paged
attention) with the module's own scale, sliding window and soft-cap. No transformers cache
object and no dense mask are built: positions come from the step, the mask from graphrt's
metadata.

    hf = transformers.Gemma3ForConditionalGeneration(config).eval()   # or any *ForCausalLM
    model = TransformersModel(hf)
    cfg = model.runtime_config(block_size=16, num_blocks=4096, max_num_seqs=16,
                               max_num_tokens=2048, max_model_len=8192, max_prefix_ranges=4)
    rt = graphrt.Runtime(cfg, model, num_layers=model.num_layers)
    rt.capture()
    features = model.image_features(pixel_values)       # eager, once per image, on the device
    logits = rt.step(step, token_ids, embeds=features, embed_rows=image_token_rows)   # [S, vocab]

What is captured: token embedding, merging the given image embeddings
(``ctx.merge_embeds``), every decoder layer, the final norm, the LM head on each
sequence's last token and a final logit soft-cap. What runs outside the graphs: the
vision tower (its output is a per-image device tensor that enters the step through
``embeds``). transformers' RoPE variants that update their tables from the largest
position seen ("dynamic", "longrope") read a device value on the host every call and are
refused; the others are computed from the step's positions inside the graph.

Mask rules (checked against transformers' own forward in tests/test_transformers.py):
image tokens form prefix ranges; on sliding layers the window clips them
(``window_rule="clip"``: Gemma3's ``AND(sliding_window, OR(causal, blockwise))``); Gemma3's
global layers see them too, Gemma4's global layers are causal only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphrt.config import RuntimeConfig

ATTENTION_NAME = "graphrt"
_DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class MaskSettings:
    """How one model family's reference code masks image tokens (README, "Mask rules")."""

    window_rule: str = "clip"           # how a sliding window and an image's range combine
    global_ranges: bool = True          # whether layers without a window see image ranges


# model_type -> settings; anything else gets the defaults (ranges wherever a step has them)
MASK_SETTINGS = {
    "gemma3": MaskSettings("clip", True),
    "gemma3_text": MaskSettings("clip", True),
    "gemma4": MaskSettings("clip", False),
    "gemma4_text": MaskSettings("clip", False),
}


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
               sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention-function signature: q [1, Hq, T, D], k/v [1, Hkv, T, D] for the
    step's new tokens (no transformers cache); returns ([1, T, Hq, D], None)."""
    call = kwargs.get(ATTENTION_NAME)
    if call is None:
        raise RuntimeError("graphrt attention called outside a graphrt step: run the model through "
                           "graphrt.integrations.transformers.TransformersModel on a Runtime")
    ctx, settings = call
    if query.shape[0] != 1:
        raise ValueError(f"graphrt attention takes the step's tokens as one row (batch 1), got batch {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))          # [T, H, D]
    ranges = settings.global_ranges or sliding_window is not None
    out = ctx.attention(module.layer_idx, q, k, v, scale=scaling, window=sliding_window,
                        window_rule=settings.window_rule, ranges=ranges, softcap=softcap)
    return out[None], None


def register() -> None:
    """Register graphrt's attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


class TransformersModel(nn.Module):
    """A transformers causal LM as a graphrt model step: ``model(ctx)`` returns the logits
    of each sequence's last new token, [S, vocab].

    hf_model: a ``*ForCausalLM`` (Llama family, Mistral, Qwen2, Gemma, Gemma2, Gemma3 text, ...)
        or ``Gemma3ForConditionalGeneration``; in eval mode, on its device and dtype. Its
        text model is switched to graphrt attention (the vision tower keeps its own).
    mask: the image-range rules (default: ``MASK_SETTINGS`` by model type).
    """

    def __init__(self, hf_model: nn.Module, *, mask: MaskSettings | None = None):
        super().__init__()
        register()
        config = hf_model.config
        self.hf = hf_model
        self.text_config = config.get_text_config()
        self.mask = mask or MASK_SETTINGS.get(config.model_type, MaskSettings())
        inner = hf_model.model
        self.decoder = getattr(inner, "language_model", inner)      # multimodal wrappers hold it there
        self.embed_tokens = self.decoder.get_input_embeddings()
        self.lm_head = hf_model.get_output_embeddings()
        self.final_softcap = getattr(self.text_config, "final_logit_softcapping", None)
        self.image_token_id = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
        rope = getattr(self.text_config, "rope_parameters", None) or getattr(self.text_config, "rope_scaling", None)
        kinds = {(r or {}).get("rope_type", "default") for r in (rope.values() if _nested(rope) else [rope])}
        if kinds & set(_DYNAMIC_ROPE):
            raise ValueError(f"RoPE type {sorted(kinds & set(_DYNAMIC_ROPE))} updates its tables from a host read of "
                             f"the largest position on every call, which a CUDA graph cannot hold; graphrt runs "
                             f"default, linear, llama3 and yarn RoPE")
        if getattr(self.text_config, "use_bidirectional_attention", None) is True:
            raise ValueError("text models with bidirectional attention everywhere are not causal decoders")
        if config is self.text_config:
            hf_model.set_attn_implementation(ATTENTION_NAME)
        else:
            key = next(k for k in config.sub_configs if getattr(config, k) is self.text_config)
            hf_model.set_attn_implementation({key: ATTENTION_NAME})

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    def runtime_config(self, **capacities) -> RuntimeConfig:
        """A RuntimeConfig with this model's attention shape, dtype and (for multimodal
        models) ``embed_dim``; ``capacities`` are RuntimeConfig's remaining fields."""
        c = self.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        embed_dim = c.hidden_size if self.image_token_id is not None else 0
        fields = dict(num_q_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
                      head_dim=head_dim, dtype=self.embed_tokens.weight.dtype, embed_dim=embed_dim)
        return RuntimeConfig(**{**fields, **capacities})

    @torch.no_grad()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower + projector of a multimodal model, run eagerly: [images x
        tokens_per_image, hidden], in the order of the images' placeholder tokens."""
        features = self.hf.model.get_image_features(pixel_values)
        features = getattr(features, "pooler_output", features)
        return features.reshape(-1, features.shape[-1]).to(self.embed_tokens.weight.dtype)

    def image_ranges(self, token_ids) -> list[tuple[int, int]]:
        """Half-open (start, end) of each run of image placeholder tokens in ``token_ids``
        (a sequence's ids from position 0): the sequence's prefix ranges."""
        ranges, start = [], None
        for pos, tok in enumerate(list(token_ids) + [None]):
            if tok == self.image_token_id and start is None:
                start = pos
            elif tok != self.image_token_id and start is not None:
                ranges.append((start, pos))
                start = None
        return ranges

    @torch.no_grad()
    def forward(self, ctx) -> torch.Tensor:
        ids = ctx.input_ids                                                  # [T]
        if ctx.embed_index is not None:       # placeholder ids may lie past the vocabulary: look up 0 there
            ids = torch.where(ctx.embed_index >= 0, 0, ids)
        x = ctx.merge_embeds(self.embed_tokens(ids[None]))                   # [1, T, hidden]
        out = self.decoder(inputs_embeds=x, position_ids=ctx.positions[None], use_cache=False,
                           **{ATTENTION_NAME: (ctx, self.mask)})
        hidden = out.last_hidden_state[0]                                    # [T, hidden]
        logits = self.lm_head(hidden[ctx.last_token_index])                  # [S, vocab]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _nested(rope) -> bool:
    """transformers 5 may key RoPE parameters by layer type ({"sliding_attention": {...}})."""
    return isinstance(rope, dict) and bool(rope) and all(isinstance(v, dict) for v in rope.values())
