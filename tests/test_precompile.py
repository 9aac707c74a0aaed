"""Parallel precompilation before capture (capture.precompile).

On any machine: a worker process compiles a kernel variant from Triton's specialization
data for an explicit GPU target (Triton ships ptxas), filling the on-disk cache, with no
GPU. On a GPU: a capture with precompile=True finds the variants, and its replays match
an eager runtime.
"""

from __future__ import annotations

import json

import pytest
import torch

from graphrt.capture.precompile import Variant, compile_in_pool

HAS_CUDA = torch.cuda.is_available()


def write_kv_variant(head_dim: int) -> Variant:
    """Specialization data of graphrt's KV-write kernel, in the schema Triton's
    ``JITFunction.preload`` reads (bf16 K/V and cache, 8 KV heads)."""
    from graphrt.kernels.kv_write import _write_kv_kernel

    names = _write_kv_kernel.arg_names
    const = dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, KV_BLOCK_SIZE=16,
                 QUANTIZE=False, ROUND_E4M3=False)
    signature = {}
    for n in names:
        if n in const:
            signature[n] = "constexpr"
        elif n == "slot_mapping_ptr":
            signature[n] = "*i64"
        elif n in ("k_scale_ptr", "v_scale_ptr"):
            signature[n] = "*fp32"
        elif n.endswith("_ptr"):
            signature[n] = "*bf16"
        else:
            signature[n] = "i32"
    pointers = [[i] for i, n in enumerate(names) if signature[n].startswith("*")]
    data = dict(name=_write_kv_kernel.fn.__qualname__, signature=signature,
                constant_keys=[[names.index(k)] for k in const], constant_vals=list(const.values()),
                attrs_keys=pointers, attrs_vals=[[["tt.divisibility", 16]]] * len(pointers),
                options=dict(num_warps=4, num_stages=2), key="test")
    return Variant(_write_kv_kernel.fn.__module__, _write_kv_kernel.fn.__qualname__, json.dumps(data))


def test_workers_compile_variants_into_the_cache_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")        # the workers need Triton's compiler, not its interpreter
    variants = [write_kv_variant(64), write_kv_variant(128)]
    failures = compile_in_pool(variants, ("cuda", 90, 32), workers=2)
    assert failures == []
    cubins = list(tmp_path.rglob("*.cubin"))
    assert len(cubins) == 2, f"expected one cubin per variant in the cache, found {cubins}"
    # a variant that cannot compile is reported, not raised
    broken = Variant(variants[0].module, "no_such_kernel", variants[0].data)
    failures = compile_in_pool([broken], ("cuda", 90, 32), workers=1)
    assert len(failures) == 1 and "no_such_kernel" in failures[0]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_capture_with_precompile_matches_eager(tmp_path, monkeypatch):
    import numpy as np

    from graphrt import Runtime, RuntimeConfig, SeqStep, Step
    from graphrt.toy import ToyModel

    # a kernel shape no other test compiles (head_dim 48, 3 query heads per KV head), so
    # that its variants are not in this process's memory yet; a fresh cache directory
    # makes them cold on disk too
    cfg = RuntimeConfig(num_q_heads=6, num_kv_heads=2, head_dim=48, block_size=16, num_blocks=64, max_num_seqs=4,
                        max_num_tokens=32, max_model_len=256, max_prefix_ranges=2, dtype=torch.bfloat16)
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, device="cuda")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    graphs = Runtime(cfg, model, num_layers=2, device="cuda")
    eager = Runtime(cfg, model, num_layers=2, device="cuda")
    graphs.capture(decode_buckets=[1, 4], mixed_buckets=[32], quiet=True, precompile=True)
    report = graphs.graphs.precompile_report
    assert report is not None and report.failures == [] and report.variants > 0, report
    for step in (Step([SeqStep(q_len=5, context_len=0, block_ids=[0]), SeqStep(q_len=3, context_len=0, block_ids=[1])]),
                 Step([SeqStep(q_len=1, context_len=5, block_ids=[0]), SeqStep(q_len=1, context_len=3, block_ids=[1])])):
        ids = np.arange(step.num_tokens) % 50
        hidden, logits = graphs.step(step, ids)
        assert graphs.last.mode == "replay"
        want_hidden, want_logits = eager.step(step, ids)
        n = step.num_tokens
        torch.testing.assert_close(hidden[:n].float(), want_hidden[:n].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(logits[: step.num_seqs].float(), want_logits[: step.num_seqs].float(), atol=5e-2,
                                   rtol=5e-2)
