"""Question: where does a replayed decode step of a real decoder spend its GPU time, eager
and compiled (``Runtime(compile=True)``)? The bench model's llama-1b at batch 1 and 8
(prompt 512), four replayed decode steps under the torch profiler, kernel time summed by
kind: graphrt's attention, graphrt's small_linear, cuBLAS GEMMs, Inductor's fused Triton kernels, other; and the step's
wall time over those kernels' sum (what is left is gaps between graph nodes). ``--model`` picks
another of the bench's models (llama-8b, gemma3-4b: its prompts hold an image), ``--compiled-only``
skips the eager loop; ``--fusions both`` runs the compiled loop with the linear pass's fusions
(norms, residual adds, gated products inside its launches) and without, one after the other;
``--pdl both`` with programmatic dependent launches and without; ``--rope both`` with the rotary
embedding moved into the attention launch (``CompileOptions.fuse_rope``) and without (the
switches given as both multiply).
graphrt's small_linear launches are also timed by their place in a layer (``linear_roles``:
q/k/v, o, gate/up, down and the LM head, with the TB/s each streams its weights at).

    python3 benchmarks/probes/probe_model_step.py [--model llama-1b] [--batches 1,8] [--compiled-only]
        [--pdl [on|off|both]] [--fusions on|off|both] [--rope on|off|both] [--out DIR] [--ncu]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def kind_of(name: str) -> str:
    if any(k in name for k in ("_attn_kernel", "_merge_kernel", "_write_kv_kernel")):
        return "graphrt attention"
    if "_linear_kernel" in name:
        return "graphrt linear"
    if any(k in name.lower() for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")):
        return "gemm"
    if name.startswith("triton_"):
        return "inductor fused"
    return "other"


def linear_roles(durations_us: list[float], steps: int, layers: int, config) -> list[dict]:
    """graphrt's small_linear launches of ``steps`` replayed steps, in launch order
    (``durations_us``), by their place in a layer: per place the µs a launch (median over
    the layers and steps) and, where the places are a Llama-like layer's (q/k/v, o, gate/up,
    down at one row, where o and down are small_linear; q/k/v and gate/up past it, where they
    go to cuBLAS) and the last launch is the LM head, the weights' bytes and the TB/s they
    stream at. Empty where the launches do not divide into steps and layers."""
    import statistics

    n = len(durations_us)
    if steps < 1 or n % steps or layers < 1 or (n // steps - 1) % layers:
        return []
    per_step = n // steps
    per_layer = (per_step - 1) // layers
    h = config.hidden_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    i, v = config.intermediate_size, config.vocab_size
    weights = {4: [("qkv", h * (q + 2 * kv)), ("o", q * h), ("gate_up", 2 * h * i), ("down", i * h)],
               2: [("qkv", h * (q + 2 * kv)), ("gate_up", 2 * h * i)]}.get(per_layer)
    roles = []
    for place in range(per_layer + 1):
        last = place == per_layer
        times = [durations_us[s * per_step + (per_step - 1 if last else layer * per_layer + place)]
                 for s in range(steps) for layer in ([0] if last else range(layers))]
        row = dict(place="last" if last else place, launches=len(times), us=round(statistics.median(times), 2))
        if weights or last:
            name, elems = ("lm_head", v * h) if last else weights[place]
            row.update(role=name, mbytes=round(elems * 2 / 1e6, 2),
                       tbps=round(elems * 2 / (row["us"] * 1e-6) / 1e12, 2))
        roles.append(row)
    return roles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--compiled-only", action="store_true")
    parser.add_argument("--options", default=None,
                        help='Inductor config overrides for the compiled loop, JSON, e.g. \'{"triton.enable_pdl": true}\'')
    parser.add_argument("--pdl", nargs="?", const="on", default="off", choices=("on", "off", "both"),
                        help="CompileOptions.pdl (every kernel a programmatic dependent launch) for the compiled "
                             "loop; both: a row each")
    parser.add_argument("--fusions", choices=("on", "off", "both"), default="on",
                        help="CompileOptions.linear_fusions for the compiled loop (both: a row each)")
    parser.add_argument("--rope", choices=("on", "off", "both"), default="on",
                        help="CompileOptions.fuse_rope for the compiled loop (both: a row each)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ncu", action="store_true",
                        help="for Nsight Compute: the runtime's NVTX ranges on, and only the prompts and three "
                             "decode steps a loop (no timing, no profiler): filter with --nvtx-include "
                             "'regex:graphrt@replay bucket=decode.*/'")
    args = parser.parse_args()
    from graphrt.capture import CompileOptions

    switch = {"on": (True,), "off": (False,), "both": (True, False)}
    compiled_variants = [CompileOptions(options=json.loads(args.options) if args.options else None, pdl=p,
                                        linear_fusions=f, fuse_rope=r)
                         for p in switch[args.pdl] for f in switch[args.fusions] for r in switch[args.rope]]
    from torch.profiler import ProfilerActivity, profile

    from graphrt.bench.model import CONFIGS, GraphrtLoop, build, prompts

    hf = build(args.model, CONFIGS[args.model], torch.device("cuda"), torch.bfloat16)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids, pixels = prompts(hf, batch, 512, 0)
        for compile_on in ([] if args.compiled_only else [False]) + compiled_variants:
            compiled = compile_on is not False
            loop = GraphrtLoop(hf, batch, 512, 16, torch.device("cuda"), chunk=4096, compile=compile_on,
                               nvtx=args.ncu)
            features = None if pixels is None else [
                loop.lm.image_features(pixels[i: i + 1].to("cuda", torch.bfloat16)) for i in range(batch)]
            first = loop.prefill(ids, features)
            if args.ncu:
                loop.decode(first, 3)
                torch.cuda.synchronize()
                print(f"ncu: batch {batch}, compiled {compiled}: three decode steps run", flush=True)
                loop = None
                torch.cuda.empty_cache()
                continue
            loop.decode(first, 4)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loop.decode(first, 8)
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) / 8 * 1e6
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                loop.decode(first, 4)
                torch.cuda.synchronize()
            by_kind: dict[str, float] = {}
            by_name = []
            count = 0
            for e in prof.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + e.self_device_time_total / 4
                    count += e.count
                    by_name.append((e.self_device_time_total / 4, e.count / 4, e.key[:90]))
            kernel_us = sum(by_kind.values())
            launches = sorted((e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                              if e.device_type == torch.autograd.DeviceType.CUDA and "_linear_kernel" in e.name)
            roles = linear_roles([us for _, us in launches], 4, hf.config.get_text_config().num_hidden_layers,
                                 hf.config.get_text_config())
            # each kernel name: µs a step, launches a step, µs a launch (the heaviest 30)
            top = [[round(us, 1), n, round(us / max(n, 1e-9), 2), name]
                   for us, n, name in sorted(by_name, reverse=True)[:30]]
            row = dict(model=args.model, batch=batch, compiled=compiled, options=args.options if compiled else None,
                       pdl=compiled and compile_on.pdl, linear_fusions=compiled and compile_on.linear_fusions,
                       fuse_rope=compiled and compile_on.fuse_rope,
                       wall_us=wall_us, kernel_us=kernel_us,
                       kernels_per_step=count / 4, **{f"{k} us": v for k, v in sorted(by_kind.items())}, top=top,
                       linear_roles=roles)
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()
                              if k not in ("top", "linear_roles")}), flush=True)
            for r in roles:      # small_linear by its place in a layer: µs a launch, TB/s of its weights
                print("    linear", json.dumps(r), flush=True)
            for t in top:
                print("   ", *t, flush=True)
            loop = None
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"probe_model_step_{args.model}{'_options' if args.options else ''}"
        name += "" if args.pdl == "off" else f"_pdl_{args.pdl}"
        name += "" if args.rope == "on" else f"_rope_{args.rope}"
        (args.out / f"{name}.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
