"""Tensor-parallel step time: the same L-layer decode step on 1 device and with its heads
sharded over 2 (``graphrt.parallel``: one all-reduce per layer, captured in each rank's
graphs with NCCL). Each rank stages the same Step itself.

On a machine with fewer than 2 GPUs (or with --quick) it runs tiny shapes over gloo,
eagerly (gloo collectives cannot be captured), with both ranks on the one GPU or on the
CPU: that only shows the code runs.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from graphrt.bench.common import blocks_per_seq, decode_arrays, progress, quick_out_main, write


def _rank(rank: int, world: int, port: int, out: str, case: dict, backend: str, gloo_device: str) -> None:
    from graphrt import Runtime, RuntimeConfig, Step
    from graphrt.parallel import ParallelToyModel, process_group, shard_config
    from graphrt.toy import ToyModel

    with process_group(rank, world, port, backend, gloo_device) as device:
        cuda = device.type == "cuda"
        batch, context, layers = case["batch"], case["context"], case["layers"]
        per = blocks_per_seq(context)
        cfg = RuntimeConfig(num_q_heads=case["heads"][0], num_kv_heads=case["heads"][1], head_dim=case["head_dim"],
                            block_size=16, num_blocks=batch * per, max_num_seqs=batch, max_num_tokens=batch,
                            max_model_len=context + 1, max_prefix_ranges=2,
                            dtype=torch.bfloat16 if cuda else torch.float32)
        toy = dict(num_layers=layers, hidden=case["hidden"], vocab=1024, seed=0)
        model = (ParallelToyModel(cfg, rank=rank, world_size=world, device=device, **toy) if world > 1
                 else ToyModel(cfg, device=device, **toy))
        rt = Runtime(shard_config(cfg, world), model, num_layers=layers, device=device)
        if backend == "nccl":
            rt.capture(decode_buckets=[batch], mixed_buckets=[], quiet=True)
        step = Step.from_arrays(**decode_arrays(batch, context))
        ids = np.arange(batch) % 1000
        for _ in range(case["warmup"]):
            rt.step(step, ids)
        if cuda:
            torch.cuda.synchronize()
        torch.distributed.barrier()
        host, t0 = [], time.perf_counter()
        for _ in range(case["steps"]):
            t1 = time.perf_counter()
            logits = rt.step(step, ids)[1]
            host.append(time.perf_counter() - t1)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / case["steps"]
        if rank == 0:
            Path(out).write_text(json.dumps(dict(wall_us=1e6 * wall, host_us=1e6 * float(np.median(host)),
                                                 mode=rt.last.mode, checksum=float(logits.float().sum()))))


def run(*, quick: bool, out: Path, quiet: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    from graphrt.parallel import free_port

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    multi = gpus >= 2 and not quick
    backend = "nccl" if multi else "gloo"
    if multi:
        base = dict(heads=(32, 8), head_dim=128, hidden=4096, layers=32, context=4096, warmup=10, steps=50)
        batches = [1, 8, 64]
    else:
        base = dict(heads=(4, 2), head_dim=64, hidden=64, layers=2, context=40, warmup=1, steps=2)
        batches = [1, 2]
    gloo_device = "cuda:0" if gpus else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in progress(batches, "parallel", quiet):
            for world in (1, 2):
                case = dict(base, batch=batch)
                result = Path(tmp) / f"b{batch}_w{world}.json"
                mp.spawn(_rank, args=(world, free_port(), str(result), case, backend, gloo_device), nprocs=world,
                         join=True)
                r = json.loads(result.read_text())
                rows.append(dict(bench="parallel", impl="graphrt_graph" if r["mode"] == "replay" else "graphrt_eager",
                                 backend=backend, gpus=world if multi else int(gloo_device != "cpu"), ranks=world,
                                 layers=base["layers"], batch=batch, context=base["context"], hidden=base["hidden"], **r))
    for r in rows:
        one = next(x for x in rows if x["batch"] == r["batch"] and x["ranks"] == 1)
        r["speedup_vs_1"] = one["wall_us"] / r["wall_us"]
        print(f"parallel {r['backend']} ranks={r['ranks']} batch={r['batch']:3d}: {r['wall_us']:9.0f} us/step "
              f"(host {r['host_us']:.0f} us, {r['mode']}), {r['speedup_vs_1']:.2f}x one rank")
    path = write(out, "parallel" if multi else "parallel_quick", rows)
    if not quiet:
        print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    quick_out_main(run, __doc__, argv)
