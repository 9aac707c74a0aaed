"""Model steps compiled per bucket with ``torch.compile``, inside graphrt's own graphs.

``Runtime(cfg, model, ..., compile=True)`` (or a ``CompileOptions``) hands each bucket's
step to ``torch.compile`` when it is captured: Inductor fuses what surrounds graphrt's
attention (norms, rotary embeddings, activations, residual adds; graph passes move the
decode steps' small matmuls, their norms and adds, and their rotary embeddings into graphrt's
launches: ``linear_pass``, ``rope_pass``), graphrt's custom ops
(``torch.ops.graphrt.*``) stay opaque calls inside the compiled code, and graphrt's capture
records the result as the bucket's CUDA graph (Inductor's own CUDA graphs stay off: one
owner per graph). Shapes are static per bucket (``dynamic=False``): each bucket is one
compile of its own, and steps that fit no bucket run the model uncompiled, so an odd step
size never triggers a compile.

Each bucket's compile is checked: its first run must run graphrt's attention ops
(``graphrt.kernels.ops.ATTENTION_OPS``) from the compiled code as many times as the step
has attention calls (by default once per layer of the runtime). A model whose attention was traced as
something else, or fell out of the graph, is refused with ``CompileError`` rather than
captured wrong. ``StepCompiler.records`` says per bucket how long the compile took, how
many graphs it made and what Inductor's on-disk caches served (a second process with a
warm cache skips Inductor's code generation; dynamo still traces each bucket).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graphrt.kernels._checks import pdl_launches

from .buckets import KINDS, Bucket

# Inductor options graphrt sets: CUDA graphs belong to graphrt's capture
_FIXED = {"triton.cudagraphs": False}
_RECOMPILE_LIMIT = 4096
_CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                   ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))


class CompileError(RuntimeError):
    """A compiled step does not run graphrt's attention as the step would (see the message)."""


@dataclass(frozen=True)
class CompileOptions:
    """How ``Runtime(..., compile=...)`` compiles a bucket's step.

    backend:   a ``torch.compile`` backend name: "inductor" (default), or "aot_eager"
               (traced but not code-generated: what the CPU tests use for speed).
    mode:      Inductor's mode ("max-autotune-no-cudagraphs", ...); modes that turn on
               Inductor's CUDA graphs are refused (graphrt captures the step itself).
    fullgraph: refuse graph breaks (``torch.compile(fullgraph=True)``).
    options:   Inductor config overrides (``torch.compile(options=...)``).
    attention_calls: graphrt attention calls one step makes (default: the runtime's
               number of layers); the compiled graphs must hold exactly that many.
    small_linear: with Inductor, run the step's fp16/bf16 matmuls of at most 32 rows
               through graphrt's ``small_linear`` where it measured faster than cuBLAS, the
               ones that share an input in one launch (``graphrt.capture.linear_pass``).
    linear_fusions: with small_linear, also move the RMSNorms before those launches, the
               residual adds after them and gated (SwiGLU, GeGLU) products into them, in
               steps of one row (the same pass; see docs/compile.md for what it measured).
               On by default; False keeps them as Inductor's kernels.
    fuse_rope: the decode buckets' rotary embedding of q and k moved into the attention
               launch, which rotates them as it loads them (``graphrt.capture.rope_pass``:
               the rotate-half form transformers' decoders trace to; other forms stay as
               they were). With Inductor, and with aot_eager too (its graphs then run the
               pass, so that CPU runs check it).
    pdl:       launch the compiled steps' kernels as programmatic dependents of the kernel
               before them (sm_90+): Inductor's (``triton.enable_pdl``) and graphrt's own
               (attention, KV write, small_linear), so that a kernel of a decode step is set
               up while the one before drains. Off by default.
    kinds:     the bucket kinds compiled, of "decode", "verify" and "mixed" (default all);
               the others are captured from the uncompiled step. ("decode",) skips the prompt buckets'
               compiles, about 45 % of a Llama-3.2-1B's compile + capture on the H100
               (22.7 of 51.3 s, results/h100/model.json), where prefill is matmul-bound.
    """

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    options: dict | None = None
    attention_calls: int | None = None
    small_linear: bool = True
    kinds: tuple = KINDS
    linear_fusions: bool = True
    pdl: bool = False
    fuse_rope: bool = True

    def __post_init__(self):
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"CompileOptions.backend must be a backend name, got {self.backend!r}")
        if self.mode is not None and self.backend == "inductor":
            from torch._inductor import list_mode_options

            if self.mode not in list_mode_options():
                raise ValueError(f"CompileOptions.mode must be one of Inductor's modes {sorted(list_mode_options())}, "
                                 f"got {self.mode!r}")
        if self.mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"CompileOptions.mode {self.mode!r} turns on Inductor's CUDA graphs; graphrt captures "
                             f"the step itself: use 'default' or 'max-autotune-no-cudagraphs'")
        if (self.options or {}).get("triton.cudagraphs"):
            raise ValueError("CompileOptions.options: triton.cudagraphs must stay off (graphrt captures the step)")
        if not isinstance(self.pdl, bool):
            raise TypeError(f"CompileOptions.pdl must be a bool, got {type(self.pdl).__name__}")
        if self.pdl and self.backend == "inductor":
            from torch._inductor import config as inductor_config

            if not hasattr(inductor_config.triton, "enable_pdl"):
                raise ValueError(f"CompileOptions.pdl needs Inductor's triton.enable_pdl, which torch "
                                 f"{torch.__version__} lacks")
        for name in ("small_linear", "linear_fusions", "fuse_rope"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CompileOptions.{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if (self.small_linear or self.fuse_rope) and "post_grad_custom_pre_pass" in (self.options or {}):
            raise ValueError("CompileOptions.options sets post_grad_custom_pre_pass, which small_linear and "
                             "fuse_rope use: pass small_linear=False and fuse_rope=False to run your own pass there")
        if (not isinstance(self.kinds, tuple) or not self.kinds
                or any(k not in KINDS for k in self.kinds) or len(set(self.kinds)) != len(self.kinds)):
            raise ValueError(f"CompileOptions.kinds must be a tuple of distinct bucket kinds of {KINDS}, "
                             f"got {self.kinds!r}")
        calls = self.attention_calls
        if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0):
            raise ValueError(f"CompileOptions.attention_calls must be an int >= 0, got {calls!r}")

    @classmethod
    def of(cls, value: "bool | CompileOptions | None") -> "CompileOptions | None":
        """``Runtime``'s ``compile`` argument as options (None: not compiled)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"compile must be a bool or graphrt.capture.CompileOptions, got {type(value).__name__}")


@dataclass
class CompileRecord:
    """One bucket's compile."""

    bucket: Bucket
    seconds: float = 0.0           # the first call: dynamo's trace, the backend's compile and one run
    graphs: int = 0                # graphs dynamo made (more than one: graph breaks; 0: an earlier bucket's fit)
    attention_ops: int = 0         # graphrt attention ops the compiled code ran in that call
    ops: Counter = field(default_factory=Counter)      # graphrt's ops in them, by name
    recompiles: int = 0            # later calls that compiled again (a guard of the first compile failed)
    small_linears: int = 0         # matmuls the small_linear pass rewrote (0 where Inductor's disk cache served)
    ropes: int = 0                 # attention launches the rope pass gave their rotary embedding (likewise)
    caches: dict = field(default_factory=dict)          # Inductor's / AOTAutograd's disk caches: hits and misses

    def __str__(self) -> str:
        cached = ", ".join(f"{k} {v}" for k, v in self.caches.items() if v) or "no disk cache use"
        again = f", {self.recompiles} recompile(s)" if self.recompiles else ""
        linears = f", {self.small_linears} matmul(s) to small_linear" if self.small_linears else ""
        ropes = f", {self.ropes} rotary embedding(s) into attention" if self.ropes else ""
        return f"{self.bucket}: {self.seconds:.2f} s, {self.graphs} graph(s){again}{linears}{ropes}, {cached}"


class StepCompiler:
    """Compiles ``step_fn(ctx)`` once per bucket, with ``options`` (a ``CompileOptions``);
    ``attention_calls``: how many graphrt attention calls a step makes when the options do
    not say."""

    def __init__(self, step_fn: Callable[[Any], Any], options: CompileOptions, *, attention_calls: int):
        self.options = options
        self.expected = options.attention_calls if options.attention_calls is not None else attention_calls
        self.records: dict[Bucket, CompileRecord] = {}
        self._failed: dict[Bucket, str] = {}             # buckets refused, with why
        self._recording: CompileRecord | None = None     # the bucket whose step is being called
        self._linear_pass = self._rope_pass = None
        if options.backend == "inductor" and options.small_linear:
            from .linear_pass import SmallLinearPass

            self._linear_pass = SmallLinearPass(fusions=options.linear_fusions)
        if options.fuse_rope:
            from .rope_pass import RopePass

            self._rope_pass = RopePass()
        self._compiled = torch.compile(step_fn, backend=self._backend, dynamic=False, fullgraph=options.fullgraph)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        from graphrt.kernels.ops import ATTENTION_OPS

        ops = Counter(str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function")
        graphrt_ops = {k: v for k, v in ops.items() if k.startswith("graphrt.")}
        attention = sum(ops[name] for name in ATTENTION_OPS)
        if self._recording is not None:
            self._recording.graphs += 1
            self._recording.ops.update(graphrt_ops)
        if self.options.backend == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = {**list_mode_options(self.options.mode or "default"), **(self.options.options or {}), **_FIXED}
            passes = [p for p in (self._rope_pass, self._linear_pass) if p is not None]
            if passes:
                from .passes import PrePasses

                patches["post_grad_custom_pre_pass"] = PrePasses(passes)
            if self.options.pdl:
                patches["triton.enable_pdl"] = True
            inner = compile_fx(gm, example_inputs, config_patches=patches)
        elif self.options.backend == "aot_eager" and self._rope_pass is not None:
            from torch._dynamo.backends.debugging import boxed_nop

            def forward(graph_module, inputs):
                self._rope_pass(graph_module.graph)
                graph_module.recompile()
                return boxed_nop(graph_module, inputs)
            inner = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs, fw_compiler=forward)
        else:
            inner = torch._dynamo.lookup_backend(self.options.backend)(gm, example_inputs)

        def counted(*args):
            # during a bucket's first call (not yet in records), count the attention ops that
            # run: a graph that a graph break made reusable (one per decoder layer) counts
            # once per call
            record = self._recording
            if record is not None and record.bucket not in self.records:
                record.attention_ops += attention
            return inner(*args)
        counted._boxed_call = getattr(inner, "_boxed_call", False)      # dynamo's calling convention for it
        return counted

    def for_bucket(self, bucket: Bucket, ctx: Any) -> Callable[[], Any]:
        """The function that runs one step of ``bucket`` on ``ctx`` compiled; its first call
        compiles (and checks what it compiled), later calls run the compiled code."""
        return lambda: self._call(bucket, ctx)

    def _call(self, bucket: Bucket, ctx: Any) -> Any:
        if bucket in self._failed:           # refused before: the same answer, not a silent cache hit
            raise CompileError(self._failed[bucket])
        record = self.records.get(bucket)
        if record is None:
            return self._first_call(bucket, ctx)
        graphs = record.graphs
        outputs = self._run(record, ctx)
        record.recompiles += record.graphs > graphs     # a later call compiled again: a guard failed
        return outputs

    def _run(self, record: CompileRecord, ctx: Any) -> Any:
        self._recording = record
        try:
            # one compile per bucket (and per model: every TransformersModel shares its methods'
            # code) on the same code objects: lift dynamo's limit on how many it keeps (8 by
            # default, past which it would run the step uncompiled) while graphrt compiles
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT,
                                            accumulated_recompile_limit=_RECOMPILE_LIMIT), \
                    pdl_launches(True) if self.options.pdl else contextlib.nullcontext():
                return self._compiled(ctx)
        finally:
            self._recording = None

    def _first_call(self, bucket: Bucket, ctx: Any) -> Any:
        from torch._dynamo.utils import counters

        record = CompileRecord(bucket)
        before = {name: counters[group][name] for group, name in _CACHE_COUNTERS}
        linears = self._linear_pass.replaced if self._linear_pass is not None else 0
        ropes = self._rope_pass.replaced if self._rope_pass is not None else 0
        t0 = time.perf_counter()
        outputs = self._run(record, ctx)
        record.seconds = time.perf_counter() - t0
        if self._linear_pass is not None:
            record.small_linears = self._linear_pass.replaced - linears
        if self._rope_pass is not None:
            record.ropes = self._rope_pass.replaced - ropes
        record.caches = {name: counters[group][name] - before[name] for group, name in _CACHE_COUNTERS}
        if record.attention_ops != self.expected:
            self._failed[bucket] = (
                f"graphrt: the compiled step of {bucket} ran graphrt attention {record.attention_ops} times "
                f"({record.graphs} graph(s) traced, graphrt ops in them: {dict(record.ops) or 'none'}), where a step "
                f"makes {self.expected} attention calls: its attention was traced as something else or left out, "
                f"and its outputs would not be graphrt's. (CompileOptions(attention_calls=N) if the step makes N.)")
            raise CompileError(self._failed[bucket])
        self.records[bucket] = record
        return outputs
