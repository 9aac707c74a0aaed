"""A real decoder end to end: ``TransformersModel`` on a captured ``Runtime`` against
transformers' own ``generate`` (eager, and with its static cache compiled), same weights and
prompts, in one process.

Models (random bf16 weights built on the GPU from a config, no downloads): a
Llama-3.2-1B-shaped decoder (16 layers, hidden 2048, 32/8 heads of 64, vocabulary 128256,
tied head), a Llama-3.1-8B-shaped one (32 layers, hidden 4096, 32/8 heads of 128), and a
Gemma3-4B-shaped multimodal one (34 layers, hidden 2560, 8/4 heads of 256, sliding layers,
one 256-token image in every prompt, its embeddings from a small SigLIP tower).

Per cell (model, batch, prompt length; 128 new tokens): graphrt's ms per decoded token in a
loop whose next ids stay on the device (``Runtime.step(step, device_ids)``), the same with
each bucket's step compiled by Inductor (``Runtime(compile=True)``: ``graphrt_compiled_ms``,
``compiled_capture_s`` for compiling and capturing its two buckets in this process), its time to the
first token (the batch's prompts prefilled in chunks of the mixed bucket), the same two for
transformers' ``generate``, and the floor: the bytes a decode step must read (every weight
once, each sequence's KV) over the device-to-device copy bandwidth measured in the same
run (``graphrt.bench.kernels.ceilings``). ``attention_share``: the share of a replayed decode step's kernel time spent in
graphrt's attention and KV-write kernels. ``tokens_agree``: of the first 8 greedy tokens,
how many graphrt and transformers' eager generate share, from the first on (mean over the
batch; random weights make near ties, so a late divergence is expected in bf16). The
logits judge exactness where tokens cannot: of the first decode step after the prompts
(the eager loop's first ids fed to both loops), ``compiled_eager_logit_diff`` is the worst
|compiled - eager| / max |eager| over the batch, and ``eager_logit_error`` /
``compiled_logit_error`` / ``hf_logit_error`` the first sequence's worst error / max |logit|
against transformers' forward of an fp32 copy of the model, for graphrt's eager and compiled
steps and for transformers' own forward in the bench's dtype (``--no-logits`` skips the
fp32 copy).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import default_out, plot, sync, write

CONFIGS = {
    "llama-1b": dict(family="llama", num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     tie_word_embeddings=True),
    "llama-8b": dict(family="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     tie_word_embeddings=False),
    "gemma3-4b": dict(family="gemma3", num_hidden_layers=34, hidden_size=2560, intermediate_size=10240,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                      sliding_window=1024, query_pre_attn_scalar=256),
}
QUICK = {
    "llama-tiny": dict(family="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
                       tie_word_embeddings=True),
    "gemma3-tiny": dict(family="gemma3", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96, sliding_window=6,
                        query_pre_attn_scalar=32),
}
IMAGE_TOKENS = 256
COMPARE_TOKENS = 8
# graphrt's kernels in a profile (graphrt.kernels._attention_jit, _kv_write_jit)
ATTENTION_KERNELS = ("_attn_kernel", "_merge_kernel", "_write_kv_kernel")


def build(name: str, spec: dict, device, dtype):
    """A random-weight transformers model of ``spec`` on ``device`` (weights drawn there)."""
    import transformers

    spec = dict(spec)
    family = spec.pop("family")
    quick = spec["hidden_size"] < 256
    with torch.device(device):
        if family == "llama":
            cfg = transformers.LlamaConfig(**spec, max_position_embeddings=8192, rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192))
            model = transformers.LlamaForCausalLM(cfg)
        else:
            layers = spec["num_hidden_layers"]
            text = transformers.Gemma3TextConfig(**spec, max_position_embeddings=32768, layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
            tokens = 16 if quick else IMAGE_TOKENS
            side = int(math.isqrt(tokens))
            vision = transformers.SiglipVisionConfig(hidden_size=64 if quick else 256, intermediate_size=128,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     image_size=side * 4, patch_size=4)
            cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens,
                                            image_token_index=spec["vocab_size"] - 1,
                                            boi_token_index=spec["vocab_size"] - 3,
                                            eoi_token_index=spec["vocab_size"] - 2)
            model = transformers.Gemma3ForConditionalGeneration(cfg)
    if quick:       # drawn wide and seeded: greedy tokens far from ties, the same on every run
        from graphrt.integrations.tiny import widen

        widen(model, 0)
    return model.to(dtype).eval()


def prompts(model, batch: int, length: int, seed: int):
    """[batch, length] token ids (a multimodal model's prompts hold one image after 8 text
    tokens) and, for it, the pixel values."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    vocab = cfg.get_text_config().vocab_size
    ids = torch.randint(0, vocab - 8, (batch, length), generator=gen)
    pixels = None
    if getattr(cfg, "image_token_id", None) is not None:
        tokens = cfg.mm_tokens_per_image
        ids[:, 8] = cfg.boi_token_index
        ids[:, 9: 9 + tokens] = cfg.image_token_id
        ids[:, 9 + tokens] = cfg.eoi_token_index
        size = cfg.vision_config.image_size
        pixels = torch.randn(batch, 3, size, size, generator=gen)
    return ids, pixels


def decode_bytes(hf, batch: int, context: int) -> int:
    """What one decode step of ``batch`` sequences at ``context`` tokens must read: every
    weight of the language model once (the input embedding only where the LM head does
    not share it: a lookup reads a row a sequence), and each sequence's K and V in every
    layer (a sliding layer's window of them)."""
    text = hf.config.get_text_config()
    embed, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    weights = sum(p.numel() * p.element_size() for n, p in hf.named_parameters()
                  if not any(k in n for k in ("vision", "multi_modal_projector")) and (p is not embed or p is head))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_key_value_heads * head_dim * embed.element_size()
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    tokens = sum(min(context, window) if kind == "sliding_attention" and window else context for kind in kinds)
    return weights + batch * tokens * per_token



class GraphrtLoop:
    """``TransformersModel`` on a Runtime sized for one cell: prompts prefilled in steps of
    up to ``chunk`` tokens (several sequences a step, an image never cut), then greedy
    decodes of the whole batch whose next ids stay on the device. ``nvtx``: the runtime's
    NVTX ranges on (what an Nsight Compute filter selects a decode step's kernels by)."""

    def __init__(self, hf, batch: int, prompt: int, new_tokens: int, device, *, chunk: int, compile=False,
                 nvtx: bool = False):
        from graphrt import Runtime
        from graphrt.integrations.transformers import TransformersModel

        self.lm = TransformersModel(hf)
        self.block = 16
        self.per_seq = -(-(prompt + new_tokens + 1) // self.block)
        self.chunk = max(chunk, batch)
        self.cfg = self.lm.runtime_config(block_size=self.block, num_blocks=batch * self.per_seq,
                                          max_num_seqs=batch, max_num_tokens=self.chunk,
                                          max_model_len=self.per_seq * self.block, max_prefix_ranges=1)
        self.rt = Runtime(self.cfg, self.lm, num_layers=self.lm.num_layers, device=device, compile=compile,
                          nvtx=nvtx)
        self.batch, self.prompt, self.device = batch, prompt, device
        self.capture_s = 0.0
        if device.type == "cuda" or compile:       # (without CUDA a compiled loop runs its compiled buckets)
            t0 = time.perf_counter()
            self.rt.capture(decode_buckets=[batch], mixed_buckets=[self.chunk], quiet=True)
            self.capture_s = time.perf_counter() - t0
        self.table = np.arange(batch * self.per_seq).reshape(batch, self.per_seq)

    def prefill(self, ids: torch.Tensor, features: list | None) -> torch.Tensor:
        """All prompts ([batch, prompt] host ids): the first generated tokens [batch], on the
        device, with no host sync."""
        from graphrt.serve import Request, serve

        reqs = []
        for i, row in enumerate(ids.tolist()):
            r = Request(rid=i, arrival=0, prompt=row, new_tokens=1, ranges=self.lm.prefix_ranges(row),
                        images=self.lm.image_ranges(row), features=None if features is None else features[i])
            r.blocks = self.table[i].tolist()
            reqs.append(r)
        self.ranges = reqs[0].ranges
        serve(self.rt, reqs, chunk=self.chunk, free_blocks=[], read_back=False)
        return torch.stack([r.generated[0] for r in reqs])

    def _decode_step(self, i: int):
        """The batch's ``i``-th decode step after the prompts (one token each, context prompt + i)."""
        from graphrt import Step

        ranges = np.tile(np.asarray(self.ranges or [(0, 0)], np.int64)[None], (self.batch, 1, 1))
        return Step.from_arrays(q_lens=np.ones(self.batch, np.int64),
                                context_lens=np.full(self.batch, self.prompt + i, np.int64),
                                block_table=self.table, prefix_ranges=ranges)

    def step_logits(self, first: torch.Tensor) -> torch.Tensor:
        """The first decode step's logits [batch, vocab] (float) from ``first`` (the ids after
        the prompts, on the device), as ``decode`` makes it."""
        return self.rt.step(self._decode_step(0), first)[: self.batch].float()

    def decode(self, first: torch.Tensor, steps: int) -> torch.Tensor:
        """``steps`` greedy decodes of the whole batch from ``first`` ([batch] ids on the
        device); returns the tokens [batch, steps + 1] (first included). No host sync. The
        token is ``graphrt.kernels.greedy`` of the logits (the first maximum, as ``argmax``,
        in two launches: torch's ``argmax`` of one 128k row took 36 us of a 1.07 ms step on
        the H200, benchmarks/results/h200/probe_model_step_llama-1b_b1b8_0802a1e.json)."""
        from graphrt.kernels import greedy

        tokens, ids = [first], first
        for i in range(steps):
            ids = greedy(self.rt.step(self._decode_step(i), ids)[: self.batch])
            tokens.append(ids)
        return torch.stack(tokens, 1)


class _FirstToken:
    """A logits processor that notes when generate first asks for a token (the prefill
    done: the GPU is synchronised there, once) and changes nothing."""

    def __init__(self, device):
        self.device, self.at = device, None

    def __call__(self, input_ids, scores):
        if self.at is None:
            sync(self.device)
            self.at = time.perf_counter()
        return scores


def hf_generate(hf, ids, pixels, new_tokens: int, static: bool) -> tuple[torch.Tensor, float, float]:
    """transformers' greedy generate of exactly ``new_tokens``: (tokens [batch, new_tokens],
    ms to the first token, ms per later token), from one call (a static cache of one size,
    so its compiled step is reused from the warm-up)."""
    from transformers import LogitsProcessorList

    clock = _FirstToken(ids.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  logits_processor=LogitsProcessorList([clock]))
    if pixels is not None:
        kwargs.update(pixel_values=pixels, token_type_ids=(ids == hf.config.image_token_id).long())
    if static:
        kwargs["cache_implementation"] = "static"
    sync(ids.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, **kwargs)[:, ids.shape[1]:]
    sync(ids.device)
    end = time.perf_counter()
    return out, 1e3 * (clock.at - t0), 1e3 * (end - clock.at) / max(new_tokens - 1, 1)


def timed(fn, device) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0), out


def last_logits(model, ids: torch.Tensor, first: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
    """transformers' own forward over one prompt ([length] ids) and its first generated id:
    the last position's logits [vocab], float."""
    seq = torch.cat([ids.to(first.device), first.view(1)]).view(1, -1)
    kwargs = {}
    if pixels is not None:
        kwargs = dict(pixel_values=pixels.to(device=first.device, dtype=model.dtype),
                      token_type_ids=(seq == model.config.image_token_id).long())
    with torch.no_grad():
        return model(input_ids=seq, **kwargs).logits[0, -1].float()


def worst_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst |got - want| / max |want|."""
    return float((got.float() - want).abs().max() / want.abs().max())


def attention_share(loop: GraphrtLoop, first: torch.Tensor) -> float | None:
    """Share of one replayed decode step's kernel time in graphrt's attention/KV kernels."""
    if loop.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    loop.decode(first, 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop.decode(first, 4)
        torch.cuda.synchronize()
    total = attn = 0.0
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.self_device_time_total
            total += us
            attn += us if any(k in e.key for k in ATTENTION_KERNELS) else 0.0
    return attn / total if total else None


def run_cell(name, hf, batch, prompt, new_tokens, device, *, chunk, hf_modes, seed, compiled=None,
             reference=None) -> dict:
    """One (model, batch, prompt) row: graphrt first, then each transformers mode.
    ``reference``: a callable making an fp32 copy of ``hf`` (freed after use), against which
    the first decode step's logits of the first sequence are judged (graphrt eager, compiled, and
    transformers' own forward in the bench's dtype)."""
    ids, pixels = prompts(hf, batch, prompt, seed)
    dev_ids = ids.to(device)
    dev_pixels = None if pixels is None else pixels.to(device=device, dtype=hf.dtype)
    row = dict(bench="model", model=name, batch=batch, prompt=prompt, new_tokens=new_tokens)
    loop = GraphrtLoop(hf, batch, prompt, new_tokens, device, chunk=chunk)
    features = None
    if dev_pixels is not None:
        features = [loop.lm.image_features(dev_pixels[i: i + 1]) for i in range(batch)]
    loop.prefill(ids, features)                                   # warm-up (and the eager compiles)
    row["first_token_ms"], first = timed(lambda: loop.prefill(ids, features), device)
    loop.decode(first, 4)
    decode_ms, tokens = timed(lambda: loop.decode(first, new_tokens - 1), device)
    row["graphrt_ms"] = decode_ms / (new_tokens - 1)
    row["capture_s"] = loop.capture_s
    row["attention_share"] = attention_share(loop, first)
    graphrt_tokens = tokens[:, :COMPARE_TOKENS].cpu()
    eager_first, eager_logits = first, loop.step_logits(first)
    loop = None                                                   # its caches and graphs go before the next loop
    gc.collect()
    if compiled:      # the same loop with each bucket's step compiled (Runtime(compile=compiled))
        loop = GraphrtLoop(hf, batch, prompt, new_tokens, device, chunk=chunk, compile=compiled)
        row["compiled_capture_s"] = loop.capture_s              # compile + capture of the loop's two buckets
        row["compile_kinds"] = list(compiled.kinds)
        row["compile_pdl"] = compiled.pdl
        row["compile_linear_fusions"] = compiled.linear_fusions
        row["compile_fuse_rope"] = compiled.fuse_rope
        row["compile_records"] = [str(r) for r in loop.rt.compiler.records.values()]
        if features is not None:
            features = [loop.lm.image_features(dev_pixels[i: i + 1]) for i in range(batch)]
        loop.prefill(ids, features)
        row["compiled_first_token_ms"], first = timed(lambda: loop.prefill(ids, features), device)
        loop.decode(first, 4)
        decode_ms, tokens = timed(lambda: loop.decode(first, new_tokens - 1), device)
        row["graphrt_compiled_ms"] = decode_ms / (new_tokens - 1)
        row["compiled_attention_share"] = attention_share(loop, first)
        same = (tokens[:, :COMPARE_TOKENS].cpu() == graphrt_tokens).int().cumprod(1).sum(1).float()
        row["compiled_tokens_agree"] = float(same.mean())      # with the eager graphrt loop's
        compiled_logits = loop.step_logits(eager_first)          # the eager loop's inputs, the compiled step
        row["compiled_eager_logit_diff"] = worst_error(compiled_logits, eager_logits)
        loop = None
        gc.collect()
    if reference is not None:
        # the first sequence's first decode step against transformers' fp32 forward
        pixels0 = None if dev_pixels is None else dev_pixels[:1]
        fp32 = reference()                                        # made for this comparison, freed after it
        want = last_logits(fp32, ids[0], eager_first[0], pixels0)
        del fp32
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row["eager_logit_error"] = worst_error(eager_logits[0], want)
        if compiled:
            row["compiled_logit_error"] = worst_error(compiled_logits[0], want)
        row["hf_logit_error"] = worst_error(last_logits(hf, ids[0], eager_first[0], pixels0), want)
    for mode in hf_modes:
        static = mode == "static"
        hf_generate(hf, dev_ids, dev_pixels, new_tokens, static)       # warm-up (compiles, with a static cache)
        out, first_ms, per_token_ms = hf_generate(hf, dev_ids, dev_pixels, new_tokens, static)
        row[f"hf_{mode}_ms"] = per_token_ms
        row[f"hf_{mode}_first_token_ms"] = first_ms
        if mode == "eager":
            want = out[:, :COMPARE_TOKENS].cpu()
            same = (graphrt_tokens == want).int().cumprod(1).sum(1).float()
            row["tokens_agree"] = float(same.mean())
    return row


def run(*, quick: bool, out: Path, models: list[str] | None = None, batches: list[int] | None = None,
        prompt_lens: list[int] | None = None, new_tokens: int | None = None, hf_modes: list[str] | None = None,
        static_batches: list[int] | None = None, quiet: bool = False, compile: bool = True,
        compile_kinds: tuple = ("decode", "mixed"), pdl: bool = False, logits: bool = True,
        linear_fusions: bool = True, fuse_rope: bool = True) -> list[dict]:
    """Every (model, prompt, batch) cell; transformers' static-cache generate (a compile per
    cell) only at ``static_batches`` where given; ``compile_kinds``: the bucket kinds the
    compiled loop compiles (``CompileOptions.kinds``); ``pdl``: its kernels launched as
    programmatic dependents (``CompileOptions.pdl``, CUDA only); ``linear_fusions``: norms,
    residual adds and gated products inside its linear launches (``CompileOptions.linear_fusions``,
    CUDA only); ``fuse_rope``: the decode steps' rotary embedding inside the attention launch
    (``CompileOptions.fuse_rope``); ``logits``: judge the first
    decode step's logits against an fp32 copy of the model, made per cell after graphrt's loops
    are freed."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    small = quick or not cuda
    specs = QUICK if small else CONFIGS
    models = models or list(specs)
    batches = batches or ([1, 2] if small else [1, 8, 32, 128])
    prompt_lens = prompt_lens or ([32] if small else [512, 4096])
    new_tokens = new_tokens or (4 if small else 128)
    hf_modes = hf_modes if hf_modes is not None else (["eager"] if small else ["eager", "static"])
    import transformers
    dtype = torch.bfloat16 if cuda else torch.float32
    from graphrt.bench.kernels import ceilings

    # the kernels bench's copy ceiling (the better of a memcpy and a copy kernel: on the
    # H200 a graph's memcpy node alone moved 2.68 TB/s where the kernel reaches ~4.25)
    tbps = ceilings(small)["copy_tbps"]
    from graphrt.capture import CompileOptions

    # Inductor on a GPU; on the CPU (the quick test) dynamo's trace without code generation
    compiled = None
    if compile:
        compiled = (CompileOptions(kinds=compile_kinds, pdl=pdl, linear_fusions=linear_fusions, fuse_rope=fuse_rope)
                    if cuda else CompileOptions(backend="aot_eager", kinds=compile_kinds, fuse_rope=fuse_rope))
    rows = []
    for name in models:
        hf = build(name, specs[name], device, dtype)
        for prompt in prompt_lens:
            for batch in batches:
                try:
                    modes = [m for m in hf_modes if m != "static" or static_batches is None or batch in static_batches]
                    row = run_cell(name, hf, batch, prompt, new_tokens, device, chunk=64 if small else 4096,
                                   hf_modes=modes, seed=batch * 7 + prompt, compiled=compiled,
                                   reference=(lambda: copy.deepcopy(hf).float()) if logits else None)
                except torch.OutOfMemoryError as exc:
                    row = dict(bench="model", model=name, batch=batch, prompt=prompt, new_tokens=new_tokens,
                               skipped=f"out of memory: {str(exc)[:120]}")
                else:
                    row["copy_tbps"] = tbps      # the floor at the decode's middle context
                    row["floor_ms"] = decode_bytes(hf, batch, prompt + new_tokens // 2) / tbps / 1e9
                    row["of_floor"] = row["graphrt_ms"] / row["floor_ms"]
                    if "graphrt_compiled_ms" in row:
                        row["compiled_of_floor"] = row["graphrt_compiled_ms"] / row["floor_ms"]
                    for mode in modes:
                        row[f"hf_{mode}_over_graphrt"] = row[f"hf_{mode}_ms"] / row["graphrt_ms"]
                        if "graphrt_compiled_ms" in row:
                            row[f"hf_{mode}_over_compiled"] = row[f"hf_{mode}_ms"] / row["graphrt_compiled_ms"]
                rows.append(row)
                if not quiet:
                    print(_line(row), flush=True)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        del hf
        gc.collect()
    path = write(out, "model_quick" if small else "model", rows,
                 dict(copy_tbps=tbps, transformers=transformers.__version__))
    if not quiet:
        print(f"wrote {path}")
    _plot(rows, out / ("model_quick.png" if small else "model.png"))
    return rows


def _line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['model']:>10} b={r['batch']:<4d} p={r['prompt']:<5d} skipped: {r['skipped']}"
    hf = " ".join(f"hf_{m} {r[f'hf_{m}_ms']:.2f}" for m in ("eager", "static") if f"hf_{m}_ms" in r)
    if "graphrt_compiled_ms" in r:
        hf = (f"compiled {r['graphrt_compiled_ms']:.3f} (x{r['compiled_of_floor']:.2f}, compile+capture "
              f"{r['compiled_capture_s']:.1f} s, agree {r['compiled_tokens_agree']}); {hf}")
    share = r.get("attention_share")
    return (f"{r['model']:>10} b={r['batch']:<4d} p={r['prompt']:<5d} graphrt {r['graphrt_ms']:.3f} ms/token "
            f"(floor {r['floor_ms']:.3f}, x{r['of_floor']:.2f}) first {r['first_token_ms']:.1f} ms; {hf}; "
            f"attention {'-' if share is None else f'{share:.2f}'}; agree {r.get('tokens_agree', '-')}"
            + "".join(f"; {k} {r[k]:.2e}" for k in ("compiled_eager_logit_diff", "eager_logit_error",
                                                   "compiled_logit_error", "hf_logit_error") if k in r))


def _plot(rows: list[dict], path: Path) -> None:
    panels = []
    for name in sorted({r["model"] for r in rows}):
        for prompt in sorted({r["prompt"] for r in rows if r["model"] == name}):
            cell = sorted((r for r in rows if r["model"] == name and r["prompt"] == prompt and "skipped" not in r),
                          key=lambda r: r["batch"])
            if not cell:
                continue
            series = {"graphrt": ([r["batch"] for r in cell], [r["graphrt_ms"] for r in cell]),
                      **({"graphrt compiled": ([r["batch"] for r in cell], [r["graphrt_compiled_ms"] for r in cell])}
                         if all("graphrt_compiled_ms" in r for r in cell) else {}),
                      "floor": ([r["batch"] for r in cell], [r["floor_ms"] for r in cell])}
            for mode in ("eager", "static"):
                pts = [(r["batch"], r[f"hf_{mode}_ms"]) for r in cell if f"hf_{mode}_ms" in r]
                if pts:
                    series[f"transformers {mode}"] = ([p[0] for p in pts], [p[1] for p in pts])
            panels.append(dict(title=f"{name}, prompt {prompt}", xlabel="batch", ylabel="ms per decoded token",
                               series=series, logx=True, logy=True))
    if panels:
        plot(path, "A decoder end to end: graphrt against transformers' generate", panels)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models (what the CPU test runs)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--batches", default=None)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--hf", default=None, help="transformers generate modes: eager,static (or none)")
    parser.add_argument("--static-batches", default=None, help="batches at which to run the static (compiled) mode")
    parser.add_argument("--no-compile", action="store_true", help="skip graphrt's compiled loop")
    parser.add_argument("--compile-kinds", default="decode,mixed",
                        help="bucket kinds the compiled loop compiles (decode: prompt buckets uncompiled)")
    parser.add_argument("--no-logits", action="store_true",
                        help="skip the logits' comparison with an fp32 copy of each model (memory: 4 bytes a weight)")
    parser.add_argument("--pdl", action="store_true",
                        help="the compiled loop's kernels as programmatic dependent launches (CompileOptions.pdl)")
    parser.add_argument("--linear-fusions", nargs="?", const="on", default="on", choices=("on", "off"),
                        help="norms, residual adds and gated products inside the compiled loop's linear launches "
                             "(CompileOptions.linear_fusions, on by default)")
    parser.add_argument("--fuse-rope", nargs="?", const="on", default="on", choices=("on", "off"),
                        help="the decode steps' rotary embedding inside the attention launch "
                             "(CompileOptions.fuse_rope, on by default)")
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")] if s else None
    run(quick=args.quick, out=args.out or default_out(), models=args.models.split(",") if args.models else None,
        batches=ints(args.batches), prompt_lens=ints(args.prompts), new_tokens=args.new_tokens,
        hf_modes=None if args.hf is None else [m for m in args.hf.split(",") if m and m != "none"],
        static_batches=ints(args.static_batches), compile=not args.no_compile,
        compile_kinds=tuple(args.compile_kinds.split(",")), pdl=args.pdl, logits=not args.no_logits,
        linear_fusions=args.linear_fusions == "on", fuse_rope=args.fuse_rope == "on")


if __name__ == "__main__":
    main()
