"""Question: why does ``torch.compile(TransformersModel.forward)`` (Inductor, no capture) give
other tokens than the eager adapter on a GPU while aot_eager on the CPU agrees?

A tiny Llama (graphrt.integrations.tiny, bf16 on CUDA, fp32 on CPU) through an uncaptured
Runtime, a prefill of 10 tokens then 6 greedy decodes, for: the eager adapter; the forward
compiled with each backend named. For each compiled run it prints the ops dynamo put in the
graph (graphrt's custom ops or not), graph breaks, the CUDA kernels of one decode step and
the largest logit difference from the eager run.

    python3 benchmarks/probes/probe_compile.py [--backends inductor,aot_eager] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="inductor,aot_eager")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    from graphrt import Runtime, SeqStep, Step
    from graphrt.integrations.tiny import tiny_model
    from graphrt.integrations.transformers import TransformersModel

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = tiny_model("llama", 0).to(device=device, dtype=dtype)
    report = {}

    def run(fn, lm):
        cfg = lm.runtime_config(block_size=16, num_blocks=16, max_num_seqs=2, max_num_tokens=32, max_model_len=64,
                                max_prefix_ranges=1)
        rt = Runtime(cfg, fn, num_layers=lm.num_layers, device=device)
        prompt = list(range(3, 13))
        logits = rt.step(Step([SeqStep(q_len=10, context_len=0, block_ids=[0])]), prompt).float().clone()
        tokens, rows = [int(logits[0].argmax())], [logits]
        kernels = None
        for t in range(6):
            step = Step([SeqStep(q_len=1, context_len=10 + t, block_ids=[0])])
            if t == 3 and cuda:
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    logits = rt.step(step, [tokens[-1]]).float().clone()
                    torch.cuda.synchronize()
                kernels = sorted({e.key for e in prof.key_averages()
                                  if e.device_type == torch.autograd.DeviceType.CUDA})
            else:
                logits = rt.step(step, [tokens[-1]]).float().clone()
            tokens.append(int(logits[0].argmax()))
            rows.append(logits)
        return tokens, torch.cat(rows), kernels

    lm = TransformersModel(hf)
    want_tokens, want, want_kernels = run(lm, lm)
    report["eager"] = dict(tokens=want_tokens, kernels=want_kernels)
    print("eager", want_tokens, flush=True)
    for name in args.backends.split(","):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        inner = torch._dynamo.lookup_backend(name)
        ops = []

        def backend(gm, example_inputs, inner=inner, ops=ops):
            ops.append(collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
            return inner(gm, example_inputs)

        lm = TransformersModel(hf)
        compiled = torch.compile(lm.forward, backend=backend, dynamic=False)
        tokens, got, kernels = run(compiled, lm)
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        graphrt_ops = [{k: v for k, v in c.items() if "graphrt" in k or "attention" in k} for c in ops]
        diff = float((got - want).abs().max())
        report[name] = dict(tokens=tokens, max_logit_diff=diff, graphs=len(ops), graphrt_ops=graphrt_ops,
                            graph_breaks=breaks, kernels=kernels)
        print(f"{name}: tokens {tokens} (eager {want_tokens}), max |logit diff| {diff:.3g}, {len(ops)} graphs, "
              f"graphrt ops per graph {graphrt_ops}, breaks {breaks}", flush=True)
        print(f"  kernels of a decode step: {kernels}", flush=True)
    # graphrt's own option: compiled per bucket, captured (on CUDA) and replayed
    from graphrt.capture import CompileError

    for label, compile_opt in (("eager captured", False), ("Runtime(compile=True)", True)):
        torch._dynamo.reset()
        lm = TransformersModel(hf)

        def captured(lm=lm, compile_opt=compile_opt):
            cfg = lm.runtime_config(block_size=16, num_blocks=16, max_num_seqs=2, max_num_tokens=32,
                                    max_model_len=64, max_prefix_ranges=1)
            rt = Runtime(cfg, lm, num_layers=lm.num_layers, device=device, compile=compile_opt)
            rt.capture(decode_buckets=[1], mixed_buckets=[16], quiet=True)
            return rt
        try:
            rt = captured()
        except CompileError as exc:
            print(f"{label}: {exc}", flush=True)
            report[label] = dict(error=str(exc))
            continue
        records = [str(r) for r in rt.compiler.records.values()] if rt.compiler else []
        prompt = list(range(3, 13))
        logits = rt.step(Step([SeqStep(q_len=10, context_len=0, block_ids=[0])]), prompt)[:1].float().clone()
        tokens, rows, modes = [int(logits[0].argmax())], [logits], [rt.last.mode]
        for t in range(6):
            logits = rt.step(Step([SeqStep(q_len=1, context_len=10 + t, block_ids=[0])]), [tokens[-1]])[:1].float()
            tokens.append(int(logits[0].argmax()))
            rows.append(logits.clone())
            modes.append(rt.last.mode)
        diff = float((torch.cat(rows) - want).abs().max())
        report[label] = dict(tokens=tokens, modes=modes, max_logit_diff=diff, records=records)
        print(f"{label}: tokens {tokens} {modes}, max |logit diff| from eager {diff:.3g}; {records}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_compile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
