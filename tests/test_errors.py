"""Launchers reject bad arguments with errors that name the argument, before any launch."""

from __future__ import annotations

import pytest
import torch

from _cases import Seq, build_meta, rngs
from graphrt.kernels import AttentionMetadata, KernelConfig, paged_attention, split_workspace, write_kv


@pytest.fixture
def setup(device):
    rng, _ = rngs(0)
    meta, _ = build_meta([Seq(3, 5, ((0, 4),)), Seq(1, 9)], block_size=16, num_blocks=4, max_ranges=2, rng=rng,
                         device=device, num_seqs=3, num_tokens=6)
    q = torch.randn(6, 4, 64, device=device)
    k_cache = torch.randn(4, 16, 2, 64, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=k_cache.clone(), out=torch.empty_like(q), meta=meta)


def _call(setup, **change):
    args = {**setup}
    opts = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    paged_attention(args["q"], args["k_cache"], args["v_cache"], args["out"], args["meta"], **opts)


@pytest.mark.parametrize("change,err,match", [
    (lambda s: dict(q=s["q"].long()), TypeError, r"^q must have dtype"),
    (lambda s: dict(k_cache=s["k_cache"].half()), TypeError, r"^k_cache is torch.float16 but q is torch.float32"),
    (lambda s: dict(out=s["out"].half()), TypeError, r"^out is torch.float16 but q is torch.float32"),
    (lambda s: dict(q=s["q"].half(), out=s["out"].half()), TypeError,
     r"^k_cache is torch.float32 but q is torch.float16"),
    (lambda s: dict(q=s["q"][0]), ValueError, r"^q must have 3 dims"),
    (lambda s: dict(v_cache=s["v_cache"][:2]), ValueError, r"^v_cache must have shape"),
    (lambda s: dict(out=s["out"][:3]), ValueError, r"^out must have shape"),
    (lambda s: dict(q=s["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, r"^q needs a contiguous last"),
    (lambda s: dict(q=s["q"][:, :3].contiguous(), out=s["out"][:, :3].contiguous()), ValueError,
     r"multiple of k_cache heads"),
    (lambda s: dict(k_cache=s["k_cache"][..., :32], v_cache=s["v_cache"][..., :32]), ValueError, r"k_cache head_dim"),
    (lambda s: dict(q=torch.randn(7, 4, 64, device=s["q"].device), out=torch.empty(7, 4, 64, device=s["q"].device)),
     ValueError, r"^q has 7 rows, the metadata 6 token slots"),
    (lambda s: dict(q=s["q"][:5], out=s["out"][:5]), ValueError, r"^q has 5 rows, the metadata 6 token slots"),
    (lambda s: dict(q=torch.randn(6, 4, 8, device=s["q"].device), out=torch.empty(6, 4, 8, device=s["q"].device),
                    k_cache=s["k_cache"][..., :8], v_cache=s["v_cache"][..., :8]),
     ValueError, r"^q.shape\[2\] \(head_dim\) must be an int in \[9, 256\]"),
    (lambda s: dict(q=torch.randn(6, 4, 320, device=s["q"].device), out=torch.empty(6, 4, 320, device=s["q"].device),
                    k_cache=torch.randn(4, 16, 2, 320, device=s["q"].device),
                    v_cache=torch.randn(4, 16, 2, 320, device=s["q"].device)),
     ValueError, r"^q.shape\[2\] \(head_dim\) must be an int in \[9, 256\]"),
    (lambda s: dict(k_cache=s["k_cache"][:0], v_cache=s["v_cache"][:0]), ValueError,
     r"^k_cache must hold at least one block"),
    (lambda s: dict(window_rule="gemma2"), ValueError, r"^window_rule must be one of"),
    (lambda s: dict(ranges=1), TypeError, r"^ranges must be a bool"),
    (lambda s: dict(window=0), ValueError, r"^window must be a positive int"),
    (lambda s: dict(window=8.0), ValueError, r"^window must be a positive int"),
    (lambda s: dict(window=True), ValueError, r"^window must be a positive int"),
    (lambda s: dict(softcap=0.0), ValueError, r"^softcap must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(softcap=float("inf")), ValueError, r"^softcap must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(softcap=float("nan")), ValueError, r"^softcap must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(softcap=True), ValueError, r"^softcap must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(scale=float("nan")), ValueError, r"^scale must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(scale=float("inf")), ValueError, r"^scale must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(scale=-0.1), ValueError, r"^scale must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(scale=1e-300), ValueError, r"^scale must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(softcap=1e30), ValueError, r"^softcap must be a number in \[1e-06, 1e\+06\]"),
    (lambda s: dict(num_splits=0), ValueError, r"^num_splits must be an int in \[1, 64\]"),
    (lambda s: dict(num_splits=True), ValueError, r"^num_splits must be an int in \[1, 64\]"),
    (lambda s: dict(num_splits=2, workspace=split_workspace(6, 4, 64, 3, s["q"].device)), ValueError,
     r"^workspace\[0\] must be"),
    (lambda s: dict(num_splits=2, workspace=split_workspace(6, 4, 64, 2, s["q"].device)[:2],
                    config=KernelConfig(block_q=16, block_n=32, fuse_merge=True)), ValueError,
     r"^workspace has no counters for the fused merge"),
    (lambda s: dict(num_splits=2, workspace=(*split_workspace(6, 4, 64, 2, s["q"].device)[:2],
                                             torch.zeros(3, dtype=torch.int32, device=s["q"].device))), ValueError,
     r"^workspace\[2\] \(counters\) must be contiguous with >= \d+ elements"),
    (lambda s: dict(num_splits=2, workspace=(*split_workspace(6, 4, 64, 2, s["q"].device)[:2],
                                             torch.zeros(99, device=s["q"].device))), TypeError,
     r"^workspace\[2\] must have dtype in \['torch.int32'\]"),
    (lambda s: dict(num_splits=2, workspace=split_workspace(6, 4, 64, 2, s["q"].device)[0]), TypeError,
     r"^workspace must be the tuple split_workspace"),
    (lambda s: dict(config=KernelConfig(block_q=16, block_n=32, maxnreg=32)), ValueError,
     r"^config.maxnreg must be None or an int in \[64, 255\], got 32"),
    (lambda s: dict(config=KernelConfig(block_q=16, block_n=32, maxnreg=128.0)), ValueError,
     r"^config.maxnreg must be None or an int in \[64, 255\], got 128.0"),
    (lambda s: dict(new_kv=torch.randn(6, 2, 64, device=s["q"].device), max_query_len=1), TypeError,
     r"^new_kv must be a pair \(k, v\)"),
    (lambda s: dict(new_kv=(torch.randn(6, 2, 64, device=s["q"].device), torch.randn(6, 2, 32, device=s["q"].device))),
     ValueError, r"^new_kv\[1\] must have shape \(6, 2, 64\)"),
    (lambda s: dict(new_kv=(torch.randn(6, 2, 64, device=s["q"].device), torch.randn(5, 2, 64, device=s["q"].device)),
                    max_query_len=1), ValueError, r"^new_kv\[1\] must have shape \(6, 2, 64\)"),
    (lambda s: dict(new_kv=(torch.randn(6, 2, 64, device=s["q"].device).half(),) * 2, max_query_len=1), TypeError,
     r"^new_kv\[0\] must have dtype in \['torch.float32'\]"),
], ids=["q-int", "cache-dtype", "out-dtype", "q-fp16-caches-fp32", "q-dims", "v-shape", "out-shape", "q-strided",
        "heads", "head-dim", "q-rows-over-capacity", "q-rows-under-capacity", "head-dim-8", "head-dim-320", "cache-no-blocks",
        "window-rule", "ranges-int", "window-0", "window-float", "window-bool", "softcap-0", "softcap-inf",
        "softcap-nan", "softcap-bool", "scale-nan", "scale-inf", "scale-negative", "scale-tiny", "softcap-1e30", "splits-0", "splits-bool",
        "workspace", "workspace-no-counters", "workspace-counters-short", "workspace-counters-float",
        "workspace-not-a-tuple", "maxnreg-low", "maxnreg-float", "new-kv-not-a-pair", "new-kv-shape-prefill",
        "new-kv-shape", "new-kv-dtype"])
def test_paged_attention_rejects(setup, change, err, match):
    before = {name: setup[name].clone() for name in ("out", "k_cache", "v_cache")}
    with pytest.raises(err, match=match):
        _call(setup, **change(setup))
    for name, t in before.items():
        assert torch.equal(setup[name].nan_to_num(), t.nan_to_num()), f"{name} was touched by a rejected call"


def test_metadata_rejects(setup):
    meta = setup["meta"]
    fields = {name: getattr(meta, name) for name in meta.__dataclass_fields__}
    with pytest.raises(TypeError, match=r"AttentionMetadata.seq_lens must be torch.int32"):
        AttentionMetadata(**{**fields, "seq_lens": fields["seq_lens"].long()})
    with pytest.raises(TypeError, match=r"AttentionMetadata.slot_mapping must be torch.int64"):
        AttentionMetadata(**{**fields, "slot_mapping": fields["slot_mapping"].int()})
    with pytest.raises(ValueError, match=r"query_start_loc has 3 entries, seq_lens has 3"):
        AttentionMetadata(**{**fields, "query_start_loc": fields["query_start_loc"][:3]})
    with pytest.raises(ValueError, match=r"prefix_ranges must be a contiguous \[S, R, 2\]"):
        AttentionMetadata(**{**fields, "prefix_ranges": fields["prefix_ranges"][:, :, :1]})
    with pytest.raises(TypeError, match=r"AttentionMetadata.block_table must be a torch.Tensor"):
        AttentionMetadata(**{**fields, "block_table": [[0]]})


def test_write_kv_rejects(setup):
    k = torch.randn(6, 2, 64, device=setup["q"].device)
    cache = setup["k_cache"]
    before = cache.clone()
    with pytest.raises(TypeError, match=r"^v must have dtype"):
        write_kv(k, k.half(), cache, cache, setup["meta"])
    with pytest.raises(TypeError, match=r"^k_cache is torch.float32 but k is torch.float16"):
        write_kv(k.half(), k.half(), cache, cache, setup["meta"])
    with pytest.raises(ValueError, match=r"^k_cache heads/head_dim"):
        write_kv(k[:, :1], k[:, :1], cache, cache, setup["meta"])
    with pytest.raises(ValueError, match=r"^k has 7 rows, slot_mapping 6 entries"):
        write_kv(torch.randn(7, 2, 64, device=k.device), torch.randn(7, 2, 64, device=k.device), cache, cache,
                 setup["meta"])
    with pytest.raises(ValueError, match=r"^k has 4 rows, slot_mapping 6 entries"):
        write_kv(k[:4], k[:4], cache, cache, setup["meta"])
    with pytest.raises(ValueError, match=r"^k_cache blocks must hold at least one token"):
        write_kv(k, k, cache[:, :0], cache[:, :0], setup["meta"])
    with pytest.raises(TypeError, match=r"^slot_mapping must have dtype"):
        write_kv(k, k, cache, cache, setup["meta"].slot_mapping.int())
    assert torch.equal(cache, before), "cache was touched by a rejected call"


def test_cpu_tensors_need_the_interpreter(setup, monkeypatch):
    if setup["q"].device.type != "cpu":
        pytest.skip("about CPU tensors")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _call(setup)


def test_lazy_names_resolve_to_functions_in_any_order():
    import subprocess
    import sys

    code = ("import graphrt.kernels as K; K.decode_splits; from graphrt.kernels import paged_attention; "
            "assert callable(paged_attention) and not hasattr(paged_attention, '__path__'), paged_attention")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
