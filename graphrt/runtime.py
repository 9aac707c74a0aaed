"""The runtime: stage -> one pinned copy -> replay (or run eagerly), per step.

    rt = graphrt.Runtime(cfg, model_step, num_layers=2)
    rt.capture()                          # CUDA only; without it every step runs eagerly
    out = rt.step(step, input_ids)        # the first step.num_tokens rows are this step's
    out = rt.step(step, input_ids, embeds=image_features, embed_rows=rows)   # cfg.embed_dim > 0

``model_step(ctx)`` is the user's forward: it reads ``ctx.input_ids`` / ``ctx.positions``
(static [T] int64 tensors of the bucket; positions [P, T] with ``cfg.position_rows = P``
rows, as multimodal RoPE takes them), puts given embeddings in with
``ctx.merge_embeds(x)``, calls ``ctx.attention(layer, q, k, v, ...)`` in each layer
(KV-cache write + paged attention) and returns its outputs. Under a graph the
outputs are static tensors, overwritten by the next replay of the same bucket: consume
them (on the same stream) before then.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from graphrt.buffers import DeviceViews, Layout, StepBuffers
from graphrt.config import RuntimeConfig
from graphrt.kernels import decode_splits, paged_attention, split_workspace, write_kv
from graphrt.kernels.paged_attention import key_tile
from graphrt.kernels.ops import attention_op
from graphrt.kernels.ops import sample as sample_op
from graphrt.kernels.ops import sample_kept as sample_kept_op
from graphrt.kernels.sampling import kept_probs
from graphrt.sampling import SamplingParams
from graphrt.step import Step
from graphrt.tracing import Tracer
from graphrt.capture import (Bucket, CapturedGraph, CompileOptions, GraphSet, StepCompiler, default_buckets,
                             make_buckets)


def precompile_by_default() -> bool:
    """``Runtime.capture``'s precompile when not given: on unless GRAPHRT_PRECOMPILE is "0"."""
    return os.environ.get("GRAPHRT_PRECOMPILE", "1") != "0"


class StepContext:
    """What a model step sees: the bucket's static device inputs and graphrt attention (a
    ``graphrt.context.ModelContext``, as the reference runner's context is)."""

    def __init__(self, runtime: "Runtime", views: DeviceViews, *, max_query_len: int | None, num_splits: int):
        self.meta = views.meta                    # AttentionMetadata of the bucket
        self.input_ids = views.input_ids          # [T] int64
        self.positions = views.positions          # [T] int64 ([P, T] with cfg.position_rows = P > 1)
        self.embed_index = views.embed_index      # [T] int32 row of inputs_embeds, -1 = none; None without
        self.inputs_embeds = views.inputs_embeds  # [T, embed_dim] given embeddings, rows packed from 0
        self.num_tokens = views.layout.num_tokens  # T: token capacity of this bucket
        self.num_seqs = views.layout.num_seqs     # S: sequence capacity of this bucket
        self.sampling = views.sampling            # [S] settings per field (cfg.sampling), else None
        self.speculative = views.speculative      # request, offset [S] int32 (cfg.speculative), else None
        self.block_size = runtime.cfg.block_size
        self._rt = runtime
        self._max_query_len = max_query_len
        self._num_splits = num_splits
        cfg = runtime.cfg
        self._workspace = (split_workspace(self.num_tokens, cfg.num_q_heads, cfg.head_dim, num_splits, runtime.device,
                                           max_num_seqs=self.num_seqs)
                           if num_splits > 1 else None)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[S] int64 row of each sequence's last new token (where its next token is sampled);
        padded sequences point at row 0 or the step's last row."""
        return (self.meta.query_start_loc[1:] - 1).clamp_min(0).long()

    def sample(self, logits: torch.Tensor, *, probs: bool = False):
        """[S] int64: each sequence's next token, drawn from its row of ``logits`` ([S, V],
        its last token's) with the settings the step staged (``Runtime.step(..., sampling=)``)
        and its length (context + new tokens) as the draw's counter: a request draws the
        same token at the same length in any batch, eagerly or replayed. Needs
        ``RuntimeConfig(sampling=True)``; padded sequences draw greedily. ``probs``: also
        return the distributions drawn from ([S, V] float32: the kept tokens' softmax at the
        temperature; one-hot for greedy rows), as a speculative draft keeps them."""
        if self.sampling is None:
            raise RuntimeError("StepContext.sample needs RuntimeConfig(sampling=True): the settings travel in the "
                               "step's copy")
        if logits.dim() != 2 or logits.shape[0] != self.num_seqs:
            raise ValueError(f"logits must be [{self.num_seqs}, vocab] (one row per sequence of the bucket), got "
                             f"{tuple(logits.shape)}")
        s = self.sampling
        if not probs:
            return sample_op(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seed"], self.meta.seq_lens)
        ids, lowest = sample_kept_op(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seed"],
                                     self.meta.seq_lens)
        return ids, kept_probs(logits, s["temperature"], lowest)

    def merge_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ([..., T, E] token embeddings) with the rows of tokens that brought an input
        embedding this step replaced by it; ``x`` itself without embedding inputs."""
        return merge_embeds(x, self.inputs_embeds, self.embed_index)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  window: int | None = None, window_rule: str = "clip", ranges: bool = True,
                  softcap: float | None = None) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) into layer's cache, then attend q ([T, Hq, D]) over it.
        Returns [T, Hq, D]; rows past the step's tokens are unspecified. Checked here (at
        capture, or per call when eager; a replay runs none of this): layer in
        [0, num_layers), q/k/v of the runtime's dtype, device and shapes with T rows."""
        rt = self._rt
        self._check_attention_inputs(layer, q, k, v)
        k_cache, v_cache = rt.k_caches[layer], rt.v_caches[layer]
        out = torch.empty_like(q)
        opts = dict(scale=scale, window=window, window_rule=window_rule, ranges=ranges, softcap=softcap,
                    num_splits=self._num_splits, max_query_len=self._max_query_len)
        scales = dict(k_scale=rt.k_scales[layer], v_scale=rt.v_scales[layer]) if rt.k_scales is not None else {}
        decode = self._max_query_len == 1     # a decode bucket's launch writes k, v itself: one kernel fewer a layer
        if torch.compiler.is_compiling():       # torch.compile traces the custom ops (graphrt.kernels.ops)
            if decode:
                return attention_op(q, k_cache, v_cache, out, self.meta, workspace=self._workspace, new_kv=(k, v),
                                    **opts, **scales)
            torch.ops.graphrt.write_kv(k, v, k_cache, v_cache, self.meta.slot_mapping, **scales)
            return attention_op(q, k_cache, v_cache, out, self.meta, workspace=self._workspace, **opts, **scales)
        if decode:
            return paged_attention(q, k_cache, v_cache, out, self.meta, workspace=self._workspace, new_kv=(k, v),
                                   **opts, **scales)
        # Mixed buckets keep the separate write. Given new_kv, their launch would read the new
        # keys from k, v in bulk copies (1.2-1.3x on prefills, H200), a path compute-sanitizer
        # has not yet passed.
        write_kv(k, v, k_cache, v_cache, self.meta, **scales)
        return paged_attention(q, k_cache, v_cache, out, self.meta, workspace=self._workspace, **opts, **scales)

    def _check_attention_inputs(self, layer: Any, q: Any, k: Any, v: Any) -> None:
        rt, cfg = self._rt, self._rt.cfg
        num_layers = len(rt.k_caches)
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer must be in [0, {num_layers}) (the runtime's num_layers; negative indices are "
                             f"not taken), got {layer}")
        for name, t, heads in (("q", q, cfg.num_q_heads), ("k", k, cfg.num_kv_heads), ("v", v, cfg.num_kv_heads)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != cfg.dtype:
                raise TypeError(f"{name} is {t.dtype}, the runtime's KV cache {cfg.dtype} (RuntimeConfig.dtype): "
                                f"cast {name} first")
            if t.device != rt.device:
                raise ValueError(f"{name} is on {t.device}, the runtime on {rt.device}")
            want = (self.num_tokens, heads, cfg.head_dim)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be [{want[0]}, {want[1]}, {want[2]}] (the bucket's token capacity "
                                 f"ctx.num_tokens, heads, head_dim), got {tuple(t.shape)}")


@dataclass
class StepInfo:
    """How the last step ran."""

    mode: str                   # "replay", "eager", or "compiled" (a compiled bucket's step without CUDA graphs)
    bucket: Bucket | None
    num_seqs: int
    num_tokens: int
    copy_bytes: int


class Runtime:
    """Static buffers + KV caches + captured graphs for one model step function.

    cfg:        capacities and attention shape. num_layers: KV caches to allocate.
    device:     "cuda" (default when available) or "cpu" (eager, Triton interpreter).
    kv_caches:  optional (k_caches, v_caches) lists to use instead of allocating.
    ring:       pinned staging slots (>= 2): how many steps the host may run ahead.
    strict:     run stage + copy + replay under ``torch.cuda.set_sync_debug_mode("error")``
                and refuse a pageable copy source (off by default).
    nvtx:       emit NVTX ranges in the ``graphrt`` domain (off by default).
    compile:    True or a ``graphrt.capture.CompileOptions``: ``capture`` compiles the model
                step per bucket with ``torch.compile`` (Inductor by default) before capturing
                it (``graphrt.capture.compiled``; ``rt.compiler.records`` says what each
                compile cost). Steps no bucket fits run the step uncompiled. Without CUDA,
                steps that fit a bucket run its compiled step over the bucket's buffers.
    """

    def __init__(self, cfg: RuntimeConfig, model_step: Callable[[StepContext], Any], *, num_layers: int,
                 device: torch.device | str | None = None,
                 kv_caches: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None, ring: int = 3,
                 strict: bool = False, nvtx: bool = False, compile: bool | CompileOptions = False):
        if not isinstance(cfg, RuntimeConfig):
            raise TypeError(f"cfg must be a RuntimeConfig, got {type(cfg).__name__}")
        if not callable(model_step):
            raise TypeError("model_step must be callable as model_step(ctx)")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.cfg = cfg
        self.model_step = model_step
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:      # "cuda" means the current device: cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.buffers = StepBuffers(cfg, self.device, ring=ring)
        shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        cache_dtype = cfg.cache_dtype
        if kv_caches is None:
            self.k_caches = [torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(num_layers)]
            self.v_caches = [torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(num_layers)]
        else:
            self.k_caches, self.v_caches = list(kv_caches[0]), list(kv_caches[1])
            for name, caches in (("k_caches", self.k_caches), ("v_caches", self.v_caches)):
                if len(caches) != num_layers:
                    raise ValueError(f"kv_caches {name} has {len(caches)} layers, num_layers is {num_layers}")
                for i, c in enumerate(caches):
                    if tuple(c.shape) != shape or c.dtype != cache_dtype or c.device != self.device:
                        raise ValueError(f"kv_caches {name}[{i}] must be {shape} {cache_dtype} on {self.device}, "
                                         f"got {tuple(c.shape)} {c.dtype} on {c.device}")
        # fp8 caches: [num_layers, Hkv] float32 scales, read by the kernels on the device, so
        # set_kv_scales takes effect in captured graphs without a new capture
        self.k_scales = self.v_scales = None
        if cfg.fp8_cache:
            self.k_scales = torch.ones(num_layers, cfg.num_kv_heads, dtype=torch.float32, device=self.device)
            self.v_scales = torch.ones(num_layers, cfg.num_kv_heads, dtype=torch.float32, device=self.device)
        options = CompileOptions.of(compile)
        self.compiler = (StepCompiler(model_step, options, attention_calls=num_layers)
                         if options is not None else None)
        self.strict = strict
        self.tracer = Tracer(nvtx)
        cuda = self.device.type == "cuda"
        self.graphs = (GraphSet(self._guarded, self._guarded_fast, cuda_graphs=cuda)
                       if cuda or self.compiler is not None else None)
        self._weight_slots: list[tuple[str, dict, str]] | None = None
        self._weight_lookup: tuple[list[dict], list[str]] | None = None   # owners and keys of _weight_slots
        self.last: StepInfo | None = None
        self._checked_sampling: tuple | None = None   # the last tuple of SamplingParams checked
        self._prepared: dict[Bucket, tuple[Layout, StepContext]] = {}    # what a replay of the bucket stages into

    def set_kv_scales(self, k_scales: Any, v_scales: Any) -> None:
        """Scales of an fp8 cache: K is stored as K / k_scale and read back as code * k_scale,
        per layer and KV head. Each argument is a float, or anything that broadcasts to
        [num_layers, num_kv_heads] (a tensor is copied on its device's stream; host values
        are copied once here, a setup-time call). Values must be finite and > 0; a good
        choice is each head's largest |K| (|V|) over calibration data divided by 448."""
        if self.k_scales is None:
            raise ValueError("set_kv_scales is for fp8 caches: RuntimeConfig.kv_cache_dtype is not torch.float8_e4m3fn")
        for name, value, target in (("k_scales", k_scales, self.k_scales), ("v_scales", v_scales, self.v_scales)):
            t = torch.as_tensor(value, dtype=torch.float32)
            if t.device.type == "cpu" and not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise ValueError(f"{name} must be finite and > 0")
            try:
                target.copy_(torch.broadcast_to(t.to(target.device), target.shape))
            except RuntimeError as exc:
                raise ValueError(f"{name} must broadcast to {tuple(target.shape)} (num_layers, num_kv_heads), got "
                                 f"{tuple(t.shape)}") from exc

    # ---------------------------------------------------------------- capture
    def capture(self, decode_buckets: Sequence[int] | None = None, mixed_buckets: Sequence[int] | None = None, *,
                verify_buckets: Sequence[int] = (), drafts: int | None = None,
                progress: Callable[[CapturedGraph], None] | None = None, quiet: bool = False,
                precompile: bool | None = None) -> list[CapturedGraph]:
        """Capture one graph per bucket (defaults: ``capture.default_buckets``), largest
        first, in one memory pool. Decode buckets count sequences, mixed buckets tokens.
        ``verify_buckets`` (none by default) count sequences of ``drafts`` + 1 tokens each,
        a speculative verify step's shape: a step whose sequences all bring that many
        tokens replays one (its attention split over the keys like a decode's) before any
        mixed bucket.
        A progress bar shows on an interactive terminal unless ``quiet``; ``progress`` is
        called with each captured graph. A no-op returning [] on CPU, except for a
        compiled step (``compile=``): there it compiles each bucket's step and returns
        the buckets with no graph (``CapturedGraph.graph`` None).

        ``precompile`` (default on; None: off only where the environment's
        GRAPHRT_PRECOMPILE is "0") first finds the Triton kernel variants of every bucket
        and compiles those missing from memory in parallel processes, or loads the list a
        previous capture wrote (``capture.precompile``; ``rt.graphs.precompile_report`` says
        what it did). H200, 24 buckets of a 32-layer model from a cold cache: 7.8 s with
        it, 25.3 s without.

        Raises ``graphrt.capture.CaptureError`` naming the buckets that ran out of GPU
        memory (and the bytes asked for); the other buckets are captured and usable."""
        if verify_buckets and (isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1):
            raise ValueError(f"drafts must be an int >= 1 with verify_buckets, got {drafts!r}")
        if self.graphs is None:
            return []
        if precompile is None:
            precompile = precompile_by_default()
        self._weight_slots = self._weight_lookup = None     # the model may have changed since the last capture
        cfg = self.cfg
        default_decode, default_mixed = default_buckets(cfg.max_num_seqs, cfg.max_num_tokens)
        buckets = make_buckets(list(default_decode if decode_buckets is None else decode_buckets),
                               list(default_mixed if mixed_buckets is None else mixed_buckets),
                               cfg.max_num_seqs, cfg.max_num_tokens, verify=list(verify_buckets),
                               verify_q_len=drafts + 1 if verify_buckets else None)

        def prepare(bucket: Bucket) -> Callable[[], Any]:
            prepared = self._prepared.get(bucket)
            layout = prepared[0] if prepared else self.buffers.layout(bucket.num_seqs, bucket.num_tokens)
            self.buffers.stage_empty(layout)
            ctx = StepContext(self, self.buffers.device_views(layout), max_query_len=bucket.max_query_len,
                              num_splits=self._splits(bucket))
            self._prepared[bucket] = (layout, ctx)
            if self.compiler is not None and bucket.kind in self.compiler.options.kinds:
                return self.compiler.for_bucket(bucket, ctx)
            return lambda: self.model_step(ctx)

        from tqdm.auto import tqdm

        # disable=None: tqdm shows the bar only on a terminal
        with tqdm(total=len(buckets), desc="graphrt capture", unit="graph", disable=True if quiet else None,
                  leave=False, dynamic_ncols=True) as bar:
            def captured(graph: CapturedGraph) -> None:
                record = self.compiler.records.get(graph.bucket) if self.compiler is not None else None
                compiled = f" (compile {record.seconds:.1f} s)" if record is not None else ""
                bar.set_postfix_str(f"{graph.bucket} {graph.seconds:.2f} s{compiled}", refresh=False)
                bar.update(1)
                if progress:
                    progress(graph)

            self.graphs.capture(buckets, prepare, trace=self.tracer, progress=captured,
                                precompile=precompile, precompile_key=self._precompile_key() if precompile else None)
        return [self.graphs.graphs[b] for b in sorted(buckets, reverse=True)]

    def _precompile_key(self) -> str:
        """What decides the kernel variants besides the buckets: the config, the model step,
        the layer count, the device, torch and the PDL switch (the precompile manifest's
        name; a capture that meets a variant the manifest lacks removes it anyway)."""
        step = self.model_step
        name = f"{getattr(step, '__module__', '')}.{getattr(step, '__qualname__', type(step).__qualname__)}"
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return repr((self.cfg, name, len(self.k_caches), gpu, torch.__version__,
                     os.environ.get("GRAPHRT_PDL"), self.compiler.options if self.compiler is not None else None))

    def _weights(self) -> list[tuple[str, dict, str]]:
        """(qualified name, owning dict, key) of every parameter and buffer of the model
        step, deduplicated as ``named_parameters`` does; walked once (at capture), so the
        per-step guard only looks the tensors up."""
        if self._weight_slots is None:
            slots, seen = [], set()
            if isinstance(self.model_step, torch.nn.Module):
                for kind in ("_parameters", "_buffers"):
                    for prefix, module in self.model_step.named_modules():
                        owner = getattr(module, kind)
                        for key, t in owner.items():
                            if t is not None and id(t) not in seen:
                                seen.add(id(t))
                                slots.append((f"{prefix}.{key}" if prefix else key, owner, key))
            self._weight_slots = slots
        return self._weight_slots

    def _guarded(self) -> list[tuple[str, torch.Tensor]]:
        pairs = [("arena", self.buffers.arena)]
        pairs += [("inputs_embeds", self.buffers.inputs_embeds)] if self.buffers.inputs_embeds is not None else []
        pairs += [(f"k_caches[{i}]", t) for i, t in enumerate(self.k_caches)]
        pairs += [(f"v_caches[{i}]", t) for i, t in enumerate(self.v_caches)]
        pairs += [("k_scales", self.k_scales), ("v_scales", self.v_scales)] if self.k_scales is not None else []
        pairs += [(name, _weight(owner, key)) for name, owner, key in self._weights()]
        return pairs

    def _guarded_fast(self) -> list[torch.Tensor]:
        embeds = [self.buffers.inputs_embeds] if self.buffers.inputs_embeds is not None else []
        scales = [self.k_scales, self.v_scales] if self.k_scales is not None else []
        if self._weight_lookup is None:
            slots = self._weights()
            self._weight_lookup = ([owner for _, owner, _ in slots], [key for _, _, key in slots])
        # one C-level pass (dict.get over the owners and keys); a deleted weight shows as None,
        # which the guard's address pass refuses (TypeError) and the named pass reports
        return [self.buffers.arena, *embeds, *self.k_caches, *self.v_caches, *scales,
                *map(dict.get, *self._weight_lookup)]

    def _splits(self, bucket) -> int:
        """A bucket's split-KV factor (1 where its attention does not split the keys): as
        ``decode_splits`` picks for its sequences, and no more than the key tiles of the
        longest context the config allows (``max_model_len``)."""
        if not bucket.splits_kv:
            return 1
        cfg = self.cfg
        keys = key_tile(cfg.head_dim, cfg.dtype, cfg.num_q_heads // cfg.num_kv_heads,
                        max_query_len=bucket.max_query_len, num_tokens=bucket.num_tokens)
        return decode_splits(bucket.num_seqs, cfg.num_kv_heads, self.device,
                             max_key_tiles=-(-cfg.max_model_len // keys))

    def _uniform_q(self, step: Step) -> int | None:
        """Every sequence's query length where they are all one length that a verify bucket
        was captured for (only then is the step's q_lens read), else None."""
        verify = self.graphs.index.verify
        n = step.num_seqs
        if not verify or step.is_decode or n == 0 or step.num_tokens % n:
            return None
        q = step.num_tokens // n
        return q if q in verify and bool((step.q_lens == q).all()) else None

    # ---------------------------------------------------------------- step
    def step(self, step: Step, input_ids: Any = None, *, embeds: torch.Tensor | None = None,
             embed_rows: Any = None, positions: Any = None, sampling: Sequence[SamplingParams] | None = None,
             requests: Any = None, offsets: Any = None) -> Any:
        """Run one step. ``input_ids``: the step's token ids, [num_tokens] ints on the host
        (list, numpy, CPU tensor) or a device tensor (copied device-to-device), or None.
        ``embeds``: [n, cfg.embed_dim] input embeddings for n of the step's tokens, a tensor
        on the runtime's device (copied device-to-device into ``ctx.inputs_embeds``; host
        tensors are refused: that would be a second host copy); ``embed_rows``: the n
        tokens (indices into the step's tokens, in step order) they belong to.
        ``positions``: the tokens' positions where they are not each token's sequence
        position (``context_len + i``), host ints [cfg.position_rows, num_tokens] ([num_tokens]
        also taken with one row) in [0, 2**31); they travel in the step's one pinned copy.
        Default: the sequence position, in every row.
        ``sampling``: one ``SamplingParams`` per sequence, for ``ctx.sample`` in the step
        (needs ``RuntimeConfig(sampling=True)``; default: greedy); they travel in the one copy.
        ``requests`` / ``offsets``: one int per sequence, its row of a
        ``graphrt.speculative.SpecState`` and its first token's position against that row's
        length (needs ``RuntimeConfig(speculative=True)``; default -1 / 0); in the one copy.
        Validates everything before touching a buffer; returns the step function's outputs."""
        if not isinstance(step, Step):
            raise TypeError(f"step must be a graphrt.Step, got {type(step).__name__}")
        step.validate(self.cfg)
        host_ids, device_ids = _check_input_ids(input_ids, step.num_tokens, self.device)
        rows = _check_embeds(embeds, embed_rows, step.num_tokens, self.cfg, self.device)
        host_positions = _check_positions(positions, step.num_tokens, self.cfg)
        if sampling is None or sampling is not self._checked_sampling or len(sampling) != step.num_seqs:
            _check_sampling(sampling, step.num_seqs, self.cfg)   # (a tuple passed again was checked: immutable)
            self._checked_sampling = sampling if isinstance(sampling, tuple) else None
        requests, offsets = _check_speculative(requests, offsets, step.num_seqs, self.cfg)
        n_seqs, n_tokens = step.num_seqs, step.num_tokens
        captured = self.graphs.pick(n_seqs, n_tokens, step.is_decode, self._uniform_q(step)) if self.graphs else None
        if captured is not None:
            self.graphs.check_guard()
        strict = self.strict and self.device.type == "cuda"
        sync_mode = _sync_debug_error() if strict else _NULL
        with sync_mode:
            if captured is not None:
                bucket = captured.bucket
                layout, ctx = self._prepared[bucket]
            else:
                bucket, layout = None, self.buffers.layout(n_seqs, n_tokens)
                ctx = StepContext(self, self.buffers.device_views(layout), max_query_len=None, num_splits=1)
            nbytes = layout.copy_bytes(step.block_columns)
            tr = self.tracer
            if not tr.enabled:      # the same three stages with no range calls (a few us a step)
                slot = self.buffers.pack(step, layout, host_ids, rows, host_positions, sampling, requests,
                                              offsets)
                self._copy(ctx, slot, nbytes, strict, n_tokens, device_ids, embeds, rows)
                outputs = self.graphs.replay(captured) if captured is not None else self.model_step(ctx)
            else:                   # three ranges, prebuilt per step shape, pushed here
                stage_range, copy_range, run_range = tr.step_ranges(bucket, n_seqs, n_tokens, nbytes)
                domain = tr.domain
                domain.push_range(stage_range)
                try:
                    slot = self.buffers.pack(step, layout, host_ids, rows, host_positions, sampling, requests,
                                              offsets)
                finally:
                    domain.pop_range()
                domain.push_range(copy_range)
                try:
                    self._copy(ctx, slot, nbytes, strict, n_tokens, device_ids, embeds, rows)
                finally:
                    domain.pop_range()
                domain.push_range(run_range)
                try:
                    outputs = self.graphs.replay(captured) if captured is not None else self.model_step(ctx)
                finally:
                    domain.pop_range()
        mode = ("eager" if captured is None else "replay" if captured.graph is not None else
                "compiled" if self.compiler is not None and captured.bucket in self.compiler.records else "eager")
        self.last = StepInfo(mode, bucket, n_seqs, n_tokens, nbytes)
        return outputs

    def _copy(self, ctx: StepContext, slot: int, nbytes: int, strict: bool, n_tokens: int,
              device_ids: torch.Tensor | None, embeds: torch.Tensor | None, rows: np.ndarray | None) -> None:
        """The step's one host-to-device copy, then its device-to-device ones (ids, embeddings)."""
        self.buffers.copy(slot, nbytes, strict=strict)
        if device_ids is not None:
            ctx.input_ids[:n_tokens].copy_(device_ids, non_blocking=True)
        if rows is not None:
            ctx.inputs_embeds[: rows.shape[0]].copy_(embeds, non_blocking=True)


_NULL = contextlib.nullcontext()
_MISSING = torch.empty(0)     # stands for a deleted weight: address 0, which nothing captured has


def _weight(owner: dict, key: str) -> torch.Tensor:
    t = owner.get(key)
    return _MISSING if t is None else t


def _check_sampling(sampling: Any, num_seqs: int, cfg: RuntimeConfig) -> None:
    if sampling is None:
        return
    if not cfg.sampling:
        raise ValueError("sampling settings need RuntimeConfig(sampling=True) (their fields in the step's copy)")
    if not isinstance(sampling, (list, tuple)) or len(sampling) != num_seqs:
        raise ValueError(f"sampling must be a list of {num_seqs} SamplingParams (one per sequence), got "
                         f"{len(sampling) if isinstance(sampling, (list, tuple)) else type(sampling).__name__}")
    try:
        SamplingParams.check(sampling, num_seqs)
    except TypeError as e:          # named as the step's argument
        raise TypeError(f"sampling{str(e).removeprefix('params')}".replace("a SamplingParams", "a graphrt.SamplingParams")) from None


def _check_speculative(requests: Any, offsets: Any, num_seqs: int, cfg: RuntimeConfig):
    if requests is None and offsets is None:
        return None, None
    if not cfg.speculative:
        raise ValueError("requests / offsets need RuntimeConfig(speculative=True) (their fields in the step's copy)")
    out = []
    for name, values, low in (("requests", requests, 0), ("offsets", offsets, -2 ** 31)):
        if values is None:
            out.append(None)
            continue
        a = np.asarray(values)
        if a.shape != (num_seqs,) or (a.size and a.dtype.kind not in "iu"):
            raise ValueError(f"{name} must be {num_seqs} ints (one per sequence), got shape {a.shape} {a.dtype}")
        if a.size and (a.min() < low or a.max() >= 2 ** 31):
            raise ValueError(f"{name} must be ints in [{low}, 2**31), got {a.min()}..{a.max()}")
        out.append(a)
    return out[0], out[1]


def _check_input_ids(input_ids: Any, num_tokens: int, device: torch.device):
    """(host array or None, device tensor or None), after checking length and dtype."""
    if input_ids is None:
        return None, None
    if isinstance(input_ids, torch.Tensor) and input_ids.device.type != "cpu":
        if input_ids.device != device:
            raise ValueError(f"input_ids is on {input_ids.device}, the runtime on {device}")
        if input_ids.dtype not in (torch.int32, torch.int64) or input_ids.shape != (num_tokens,):
            raise ValueError(f"input_ids must be [{num_tokens}] int32/int64, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        return None, input_ids
    ids = input_ids.numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids)
    if ids.dtype.kind not in "iu" or ids.shape != (num_tokens,):
        raise ValueError(f"input_ids must be {num_tokens} integers (the step's tokens), got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    return ids, None


def _check_positions(positions: Any, num_tokens: int, cfg: RuntimeConfig) -> np.ndarray | None:
    """Given positions as a [position_rows, num_tokens] int array (None when not given),
    after checking where they are, their shape, type and range."""
    if positions is None:
        return None
    if isinstance(positions, torch.Tensor):
        if positions.device.type != "cpu":
            raise ValueError(f"positions is on {positions.device}: positions are host ints that travel in the step's "
                             f"one pinned copy")
        positions = positions.numpy()
    pos = np.asarray(positions)
    rows = cfg.position_rows
    if pos.ndim == 1 and rows == 1:
        pos = pos[None]
    if pos.dtype.kind not in "iu" or pos.shape != (rows, num_tokens):
        raise ValueError(f"positions must be ints of shape [{rows}, {num_tokens}] (RuntimeConfig.position_rows, the "
                         f"step's tokens), got shape {pos.shape} dtype {pos.dtype}")
    if pos.size and (pos.min() < 0 or pos.max() >= 2 ** 31):
        raise ValueError(f"positions must be in [0, 2**31), got {pos.min()}..{pos.max()}")
    return pos


def _check_embeds(embeds: Any, embed_rows: Any, num_tokens: int, cfg: RuntimeConfig,
                  device: torch.device) -> np.ndarray | None:
    """The rows as an int array (None without embeddings), after checking both arguments."""
    if embeds is None and embed_rows is None:
        return None
    if embeds is None or embed_rows is None:
        raise ValueError("embeds and embed_rows go together: pass both or neither")
    if not cfg.embed_dim:
        raise ValueError("this runtime takes no input embeddings: RuntimeConfig.embed_dim is 0")
    if not isinstance(embeds, torch.Tensor):
        raise TypeError(f"embeds must be a torch.Tensor, got {type(embeds).__name__}")
    if embeds.device != device:
        raise ValueError(f"embeds is on {embeds.device}, the runtime on {device}: input embeddings are copied "
                         f"device-to-device only (move them with .to({str(device)!r}) first)")
    if not embeds.is_floating_point() or embeds.dim() != 2 or embeds.shape[1] != cfg.embed_dim:
        raise ValueError(f"embeds must be a [n, embed_dim={cfg.embed_dim}] float tensor, got "
                         f"{tuple(embeds.shape)} {embeds.dtype}")
    rows = embed_rows.numpy() if isinstance(embed_rows, torch.Tensor) and embed_rows.device.type == "cpu" \
        else np.asarray(embed_rows)
    if rows.dtype.kind not in "iu" or rows.shape != (embeds.shape[0],):
        raise ValueError(f"embed_rows must be {embeds.shape[0]} host ints (one per row of embeds), got shape "
                         f"{rows.shape} dtype {rows.dtype}")
    if rows.size and (rows.min() < 0 or rows.max() >= num_tokens):
        raise ValueError(f"embed_rows must be token indices in [0, {num_tokens}) (the step's tokens), got "
                         f"{rows.min()}..{rows.max()}")
    if rows.size > 1 and np.unique(rows).size != rows.size:
        raise ValueError("embed_rows has a token twice: each token takes at most one embedding")
    return rows


def merge_embeds(x: torch.Tensor, inputs_embeds: torch.Tensor | None, embed_index: torch.Tensor | None) -> torch.Tensor:
    """x ([..., T, E]) with row t replaced by ``inputs_embeds[embed_index[t]]`` wherever
    ``embed_index[t] >= 0``; no host sync (a gather and a select)."""
    if inputs_embeds is None or embed_index is None:
        return x
    given = inputs_embeds.index_select(0, embed_index.clamp_min(0))        # [T, E]
    return torch.where((embed_index >= 0)[:, None], given.to(x.dtype), x)


@contextlib.contextmanager
def _sync_debug_error():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
