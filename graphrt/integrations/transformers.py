"""Run a Hugging Face ``transformers`` decoder's own modeling code on the graphrt runtime.

The model's layers, weights and head are used as they are: during a graphrt step the text
model dispatches its attention (through transformers' ``AttentionInterface``) to
``StepContext.attention`` (KV-cache write + paged attention), so each attention module
still projects, normalises (qk-norm) and rotates (RoPE) its own q/k/v and passes its own
scale, sliding window and soft-cap; and the logits come from the model's own forward,
asked for each sequence's last new token (``logits_to_keep``), so whatever a family does
after its decoder (Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma's final
soft-cap) is the family's code. No transformers cache object and no dense mask are built:
positions come from the step, the mask from graphrt's metadata. Outside a graphrt step
the model runs as before, with its own attention implementation.

    hf = transformers.Gemma3ForConditionalGeneration(config).eval()   # or a *ForCausalLM
    model = TransformersModel(hf)
    cfg = model.runtime_config(block_size=16, num_blocks=4096, max_num_seqs=16,
                               max_num_tokens=2048, max_model_len=8192, max_prefix_ranges=4)
    rt = graphrt.Runtime(cfg, model, num_layers=model.num_layers)
    rt.capture()
    features = model.image_features(pixel_values)       # eager, once per image, on the device
    logits = rt.step(step, token_ids, embeds=features, embed_rows=image_token_rows)   # [S, vocab]

What is captured: token embedding, merging the given image embeddings
(``ctx.merge_embeds``), every decoder layer and the model's own head on each sequence's
last token. What runs outside the graphs: the vision tower (its output is a per-image
device tensor that enters the step through ``embeds``). transformers' RoPE variants that
update their tables from the largest position seen ("dynamic", "longrope") read a device
value on the host every call and are refused; the others are computed from the step's
positions inside the graph. Multimodal RoPE (the Qwen2-VL family) takes three position
rows per token, which the step brings (``Runtime.step(positions=)``; ``prompt_positions``
computes them with the model's own code).

The adapter runs the model once when it is built, with a stand-in for graphrt's
attention, and refuses (``ValueError`` naming the reason) a model whose attention graphrt
cannot take over: layers that never reach the attention interface or have no layer index,
an attention bias of the model's own (ALiBi), head shapes that differ between layers,
attention arguments graphrt does not implement.

Mask rules (checked against transformers' own forward in tests/test_transformers.py):
image tokens form prefix ranges; on sliding layers the window clips them
(``window_rule="clip"``: Gemma3's ``AND(sliding_window, OR(causal, blockwise))``); Gemma3's
global layers see them too, Gemma4's global layers are causal only; PaliGemma's image and
prompt are one range (a prefix-LM).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from graphrt.config import RuntimeConfig

ATTENTION_NAME = "graphrt"
_DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class MaskSettings:
    """How one model family's reference code masks image tokens (docs/masks.md)."""

    window_rule: str = "clip"           # how a sliding window and an image's range combine
    global_ranges: bool = True          # whether layers without a window see image ranges
    # the whole prompt (image and text) is one range: its tokens attend to each other both
    # ways, the generated tokens causally (PaliGemma's prefix-LM)
    prefix_lm: bool = False


# model_type -> settings; anything else gets the defaults (ranges wherever a step has them)
MASK_SETTINGS = {
    "gemma3": MaskSettings("clip", True),
    "gemma3_text": MaskSettings("clip", True),
    "gemma4": MaskSettings("clip", False),
    "gemma4_text": MaskSettings("clip", False),
    # PaliGemmaModel.forward: block_sequence_ids 0 over token_type_ids == 0 (image + prompt)
    "paligemma": MaskSettings(prefix_lm=True),
}

# model_type -> what the model adds to a token's sequence position (its forward's own
# default when no position_ids are given; PaliGemmaModel.forward: "1-indexed")
POSITION_OFFSET = {"paligemma": 1}

# attention keyword arguments that do not change what attention computes (positions for
# kernels that pack sequences, flags about outputs); any other that a layer passes with a
# value makes the adapter refuse the model
_IGNORED = {"position_ids", "output_attentions", "output_router_logits", "use_cache", "cache_position",
            "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


def _attention(owner: "weakref.ref[TransformersModel]", module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
               sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention-function signature: q [1, Hq, T, D], k/v [1, Hkv, T, D] for the
    step's new tokens (no transformers cache); returns ([1, T, Hq, D], None)."""
    model = owner()
    active = model._active if model is not None else None
    if active is None:
        raise RuntimeError("graphrt attention called outside a graphrt step (its name is switched on only while "
                           "TransformersModel runs a step)")
    ctx, settings = active
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"{name} passes an attention mask or bias of its own (ALiBi?), which graphrt's paged "
                         f"attention cannot apply")
    extra = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v is not None and v is not True)
    if extra:
        raise ValueError(f"{name} passes attention arguments graphrt does not implement: {extra}")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{name} has no layer_idx: graphrt cannot tell which layer's KV cache it uses")
    if query.shape[0] != 1:
        raise ValueError(f"graphrt attention takes the step's tokens as one row (batch 1), got batch {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))          # [T, H, D]
    ranges = settings.global_ranges or sliding_window is not None
    out = ctx.attention(layer, q, k, v, scale=scaling, window=sliding_window, window_rule=settings.window_rule,
                        ranges=ranges, softcap=softcap)
    return out[None], None


@dataclass(frozen=True)
class LayerAttention:
    """What one layer handed graphrt's attention in the check run at construction."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None
    window: int | None
    softcap: float | None


class _Probe:
    """Stands in for a StepContext during the construction check: records each layer's
    attention call and returns zeros."""

    def __init__(self):
        self.calls: dict[int, LayerAttention] = {}
        self.repeated: list[int] = []

    def attention(self, layer, q, k, v, *, scale=None, window=None, window_rule="clip", ranges=True, softcap=None):
        if layer in self.calls:
            self.repeated.append(layer)
        self.calls[layer] = LayerAttention(q.shape[1], k.shape[1], q.shape[2], scale, window, softcap)
        return torch.zeros_like(q)


class TransformersModel(nn.Module):
    """A transformers causal LM as a graphrt model step: ``model(ctx)`` returns the logits
    of each sequence's last new token, [S, vocab], from the model's own head.

    hf_model: a ``*ForCausalLM`` or a vision-language ``*ForConditionalGeneration``
        (Gemma3, PaliGemma, Qwen2-VL, ...) in eval mode, on its device and dtype. It is
        left as it was: outside a graphrt step it runs with its own attention.
    mask: the image-range rules (default: ``MASK_SETTINGS`` by model type).

    The switch to graphrt's attention is made on the model's text config for the length of
    a step's forward (and of the check run at construction): the model's own forward in
    another thread at that moment would meet it too.
    """

    def __init__(self, hf_model: nn.Module, *, mask: MaskSettings | None = None):
        super().__init__()
        from transformers import AttentionInterface

        config = hf_model.config
        self.hf = hf_model
        self.text_config = config.get_text_config()
        self.model_type = config.model_type
        self.mask = mask or MASK_SETTINGS.get(config.model_type, MaskSettings())
        self.position_offset = POSITION_OFFSET.get(config.model_type, 0)
        self.embed_tokens = hf_model.get_input_embeddings()
        self.image_token_id = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
        self._check_config(hf_model)
        rope = self._rope_parameters()
        self.position_rows = 3 if any("mrope_section" in r for r in rope) else 1
        # while a step runs: (ctx, mask settings); the attention function finds it through
        # a weak reference (the interface's registry outlives this object)
        self._active = None
        # a name of its own (a later adapter at this address replaces the entry, whose owner is gone)
        self._attention_name = f"{ATTENTION_NAME}-{id(self):x}"
        ref = weakref.ref(self)
        AttentionInterface.register(self._attention_name,
                                    lambda *args, **kwargs: _attention(ref, *args, **kwargs))
        self.layers = self._check_run()

    # ---------------------------------------------------------------- checks at construction
    def _check_config(self, hf_model: nn.Module) -> None:
        params = inspect.signature(hf_model.forward).parameters
        missing = [p for p in ("inputs_embeds", "position_ids", "logits_to_keep") if p not in params]
        if missing:
            raise ValueError(f"{type(hf_model).__name__}.forward takes no {missing}: graphrt runs a causal LM's "
                             f"forward on given embeddings and positions and asks its head for the last tokens only")
        kinds = {r.get("rope_type", "default") for r in self._rope_parameters()}
        if kinds & set(_DYNAMIC_ROPE):
            raise ValueError(f"RoPE type {sorted(kinds & set(_DYNAMIC_ROPE))} updates its tables from a host read of "
                             f"the largest position on every call, which a CUDA graph cannot hold; graphrt runs "
                             f"default, linear, llama3, yarn and multimodal RoPE")
        if getattr(self.text_config, "alibi", False) or getattr(self.text_config, "position_embedding_type", "") == "alibi":
            raise ValueError("ALiBi models add their position bias to the attention mask, which graphrt's kernels do "
                             "not take (they build the mask from the step's metadata)")
        if getattr(self.text_config, "use_bidirectional_attention", None) is True and not self.mask.prefix_lm:
            raise ValueError("text models with bidirectional attention everywhere are not causal decoders")

    def _rope_parameters(self) -> list[dict]:
        c = self.text_config
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        return [r or {} for r in (rope.values() if _nested(rope) else [rope])]

    @torch.no_grad()
    def _check_run(self) -> dict[int, LayerAttention]:
        """Run the model on two tokens with a stand-in for graphrt attention; refuse it
        (ValueError) unless every decoder layer's attention came through, once, with a
        layer index and one head shape."""
        probe = _Probe()
        device = self.embed_tokens.weight.device
        ids = torch.zeros(2, dtype=torch.long, device=device)
        positions = torch.arange(2, device=device)
        if self.position_rows > 1:
            positions = positions.expand(self.position_rows, -1)
        last = torch.tensor([1], device=device)
        what = f"{type(self.hf).__name__} (model_type {self.model_type!r})"
        try:
            self._run(probe, self.embed_tokens(ids[None]), positions, last)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from exc
        except Exception as exc:      # the model's own code, run without a dense mask or a cache
            if not probe.calls:       # e.g. Falcon before transformers 5.25: attention of its own
                import transformers

                raise ValueError(f"{what}: its attention does not go through transformers' AttentionInterface "
                                 f"(transformers {transformers.__version__}): no layer reached it before its forward "
                                 f"failed without a dense mask: {type(exc).__name__}: {exc}") from exc
            raise ValueError(f"{what}: its forward failed with graphrt's attention in place (no dense mask, no "
                             f"cache object): {type(exc).__name__}: {exc}") from exc
        layers = self.text_config.num_hidden_layers
        if sorted(probe.calls) != list(range(layers)) or probe.repeated:
            raise ValueError(f"{what}: graphrt takes over attention through transformers' AttentionInterface, and "
                             f"expects each of its {layers} decoder layers there once; the layers that came were "
                             f"{sorted(probe.calls)}{f', some twice: {probe.repeated}' if probe.repeated else ''} "
                             f"(layers without attention, or attention of the model's own, hold state or masks "
                             f"graphrt does not manage)")
        shapes = {(a.num_q_heads, a.num_kv_heads, a.head_dim) for a in probe.calls.values()}
        if len(shapes) > 1:
            raise ValueError(f"{what}: layers differ in (query heads, KV heads, head dim): {sorted(shapes)}; a "
                             f"graphrt runtime has one attention shape")
        return dict(sorted(probe.calls.items()))

    # ---------------------------------------------------------------- the step
    @torch.compiler.disable(recursive=False)
    def _run(self, ctx, embeds: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The model's own forward on ``embeds`` [1, T, E] at ``positions`` ([T] or [P, T]),
        its attention through ``ctx``; logits of the rows ``last`` [S]: [S, vocab]. The
        switch to graphrt's attention is made here, in plain Python, around ``_forward``
        (the part ``torch.compile`` traces: see ``forward``)."""
        config = self.text_config
        previous = config._attn_implementation
        config._attn_implementation_internal = self._attention_name
        self._active = (ctx, self.mask)
        try:
            return self._forward(embeds, positions, last)
        finally:
            self._active = None
            config._attn_implementation_internal = previous

    def _forward(self, embeds: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        if self.position_offset:
            positions = positions + self.position_offset
        position_ids = positions[None] if positions.dim() == 1 else positions[:, None]     # [1, T] or [P, 1, T]
        out = self.hf(inputs_embeds=embeds, position_ids=position_ids, logits_to_keep=last, use_cache=False)
        return out.logits[0]

    # Under torch.compile (``Runtime(..., compile=True)``) this frame and ``_run``'s run as
    # Python and the frames they call are compiled: ``_embed`` and ``_forward``. So the
    # attention switch (``_run``: a config attribute and ``_active``) is set before
    # ``_forward`` is traced and read as it is, not changed inside the traced code, where
    # torch 2.11's dynamo read the model's own implementation (SDPA) back on a GPU: the
    # compiled step ran without graphrt's attention. Both frames cost no GPU work.
    @torch.compiler.disable(recursive=False)
    @torch.no_grad()
    def forward(self, ctx) -> torch.Tensor:
        return self._run(ctx, self._embed(ctx), ctx.positions, ctx.last_token_index)       # [S, vocab]

    @torch.compiler.disable(recursive=False)
    @torch.no_grad()
    def all_logits(self, ctx) -> torch.Tensor:
        """[T, vocab]: the logits of every token slot of the step (a speculative verify step
        scores each of its drafts: ``graphrt.speculative.verify_step``)."""
        rows = torch.arange(ctx.num_tokens, device=ctx.input_ids.device)
        return self._run(ctx, self._embed(ctx), ctx.positions, rows)

    def _embed(self, ctx) -> torch.Tensor:
        ids = ctx.input_ids                                                  # [T]
        if ctx.embed_index is not None:       # placeholder ids may lie past the vocabulary: look up 0 there
            ids = torch.where(ctx.embed_index >= 0, 0, ids)
        return ctx.merge_embeds(self.embed_tokens(ids[None]))                # [1, T, hidden]

    # ---------------------------------------------------------------- set-up
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def runtime_config(self, **capacities) -> RuntimeConfig:
        """A RuntimeConfig with this model's attention shape (as its layers handed it to
        attention), dtype, position rows and, for multimodal models, ``embed_dim``;
        ``capacities`` are RuntimeConfig's remaining fields."""
        first = next(iter(self.layers.values()))
        embed_dim = self.embed_tokens.weight.shape[1] if self.image_token_id is not None else 0
        fields = dict(num_q_heads=first.num_q_heads, num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
                      dtype=self.embed_tokens.weight.dtype, embed_dim=embed_dim, position_rows=self.position_rows)
        return RuntimeConfig(**{**fields, **capacities})

    @torch.no_grad()
    def image_features(self, pixel_values: torch.Tensor, **kwargs) -> torch.Tensor:
        """The vision tower + projector of a multimodal model, run eagerly: [image tokens,
        hidden], in the order of the images' placeholder tokens. ``kwargs`` go to the
        model's ``get_image_features`` (``image_grid_thw=`` for the Qwen2-VL family)."""
        get = getattr(self.hf, "get_image_features", None) or self.hf.base_model.get_image_features
        features = get(pixel_values, **kwargs)
        features = getattr(features, "pooler_output", features)
        if isinstance(features, (tuple, list)):               # one tensor per image
            features = torch.cat(list(features))
        return features.reshape(-1, features.shape[-1]).to(self.embed_tokens.weight.dtype)

    def image_ranges(self, token_ids) -> list[tuple[int, int]]:
        """Half-open (start, end) of each run of image placeholder tokens in ``token_ids``
        (a sequence's ids from position 0)."""
        ranges, start = [], None
        for pos, tok in enumerate(list(token_ids) + [None]):
            if tok == self.image_token_id and start is None:
                start = pos
            elif tok != self.image_token_id and start is not None:
                ranges.append((start, pos))
                start = None
        return ranges

    def prefix_ranges(self, prompt_ids) -> list[tuple[int, int]]:
        """The prefix ranges of a sequence whose prompt is ``prompt_ids``, by the family's
        mask: its image runs (Gemma3), the whole prompt (a prefix-LM: PaliGemma), or none
        where the language model attends causally (the Qwen2-VL family). A sequence lists
        a range from the step that completes it on."""
        if self.mask.prefix_lm:
            return [(0, len(prompt_ids))] if len(prompt_ids) else []
        if self.position_rows > 1:
            return []
        return self.image_ranges(prompt_ids)

    @torch.no_grad()
    def prompt_positions(self, prompt_ids, *, image_grid_thw: torch.Tensor | None = None,
                         ) -> tuple[np.ndarray | None, int]:
        """A prompt's positions where the model does not number its tokens 0, 1, ...:
        ``(positions [position_rows, len(prompt)] int64, delta)``, a token generated at
        sequence position p then taking p + delta in every row. Multimodal RoPE (the
        Qwen2-VL family): from the model's own ``get_rope_index`` over the prompt and its
        images' patch grids. Otherwise ``(None, 0)``: the step's default positions."""
        if self.position_rows == 1:
            return None, 0
        base = self.hf.base_model
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
        kwargs = {}
        if "mm_token_type_ids" in inspect.signature(base.get_rope_index).parameters:
            kwargs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        grid = None if image_grid_thw is None else torch.as_tensor(image_grid_thw).cpu()
        positions, delta = base.get_rope_index(ids, image_grid_thw=grid, **kwargs)
        return positions[:, 0].numpy().astype(np.int64), int(delta.reshape(-1)[0])

    def describe(self) -> str:
        """The mask rule, head and position scheme this model runs with, in one line each."""
        layers = self.layers.values()
        windows = sorted({a.window for a in layers if a.window is not None})
        caps = sorted({a.softcap for a in layers if a.softcap is not None})
        first = next(iter(layers))
        ranges = ("the whole prompt is one range (prefix-LM)" if self.mask.prefix_lm else
                  "none (the language model attends causally)" if self.position_rows > 1 else
                  f"each image's tokens, window_rule={self.mask.window_rule!r}, on global layers: "
                  f"{self.mask.global_ranges}")
        positions = ("3 rows (multimodal RoPE: time, height, width), from the model's get_rope_index"
                     if self.position_rows > 1 else
                     f"sequence position + {self.position_offset}" if self.position_offset else "sequence position")
        return "\n".join([
            f"attention: {first.num_q_heads} query / {first.num_kv_heads} KV heads, head_dim {first.head_dim}, "
            f"scale {'head_dim^-1/2' if first.scale is None else f'{first.scale:.4g}'}, sliding windows "
            f"{windows or 'none'}, logit soft-caps {caps or 'none'}",
            f"prefix ranges: {ranges}",
            f"positions: {positions}",
            f"head: {type(self.hf).__name__}.forward with logits_to_keep (the model's own LM head and whatever "
            f"follows it)"])


def _nested(rope) -> bool:
    """transformers 5 may key RoPE parameters by layer type ({"sliding_attention": {...}})."""
    return isinstance(rope, dict) and bool(rope) and all(isinstance(v, dict) for v in rope.values())
