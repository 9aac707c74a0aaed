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


def variant(kernel, const: dict, pointers: dict, ints_as_one: bool = False, num_warps: int = 4) -> Variant:
    """Specialization data of one of graphrt's kernels, in the schema Triton's
    ``JITFunction.preload`` reads. ``pointers`` maps pointer arguments to their element
    type (others: ``*i32``); float scalars are the ``scale``/``softcap`` ones. With
    ``ints_as_one`` every int argument is the constant 1, as Triton's launcher
    specialises an int argument equal to 1 (the interpreter never does)."""
    names = kernel.arg_names
    const = dict(const)
    signature = {}
    for n in names:
        if n in const:
            signature[n] = "constexpr"
        elif n in pointers and not n.endswith("_ptr"):     # tensor descriptors (or a pointer in their place)
            signature[n] = pointers[n]
        elif n.endswith("_ptr"):
            signature[n] = "*" + pointers.get(n, "i32")
        elif n in ("scale_log2e", "softcap"):
            signature[n] = "fp32"
        elif ints_as_one:
            signature[n], const[n] = "constexpr", 1
        else:
            signature[n] = "i32"
    ptrs = [[i] for i, n in enumerate(names) if signature[n].startswith("*") and n.endswith("_ptr")]
    data = dict(name=kernel.fn.__qualname__, signature=signature,
                constant_keys=[[names.index(k)] for k in const], constant_vals=list(const.values()),
                attrs_keys=ptrs, attrs_vals=[[["tt.divisibility", 16]]] * len(ptrs),
                options=dict(num_warps=num_warps, num_stages=2), key="test")
    return Variant(kernel.fn.__module__, kernel.fn.__qualname__, json.dumps(data))


def write_kv_variant(head_dim: int, fp8: bool = False, ints_as_one: bool = False) -> Variant:
    """graphrt's KV-write kernel: bf16 K/V and cache (or an e4m3 cache), 8 KV heads."""
    from graphrt.kernels.kv_write import _write_kv_kernel

    const = dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, KV_BLOCK_SIZE=16,
                 QUANTIZE=fp8, ROUND_E4M3=False, PDL=True)
    cache = "fp8e4nv" if fp8 else "bf16"
    pointers = dict(k_ptr="bf16", v_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="i64",
                    k_scale_ptr="fp32", v_scale_ptr="fp32")
    return variant(_write_kv_kernel, const, pointers, ints_as_one)


def attention_variants(ints_as_one: bool) -> list[Variant]:
    """The attention and merge kernels with every mask option on: a prefill launch with
    the short-query path, split, windowed, soft-capped and with ranges, reading the new
    K/V through tensor descriptors (fp16); a decode launch writing the new K/V into an
    e4m3 cache read by a bf16 query, rotating q and k (``rope``) as it loads them."""
    from graphrt.kernels.paged_attention import _attn_kernel, _merge_kernel

    common = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, KV_BLOCK_SIZE=16, QPK=4, QPK_PAD=4, MAX_RANGES=4,
                  WINDOW_RULE=0, IEEE_DOT=False)
    fp32 = dict(part_o_ptr="fp32", part_lse_ptr="fp32", k_scale_ptr="fp32", v_scale_ptr="fp32")
    everything = dict(common, BLOCK_Q=64, BLOCK_N=64, SHORT_Q=4, SHORT_BLOCK_N=128, USE_WINDOW=True,
                      USE_RANGES=True, USE_SOFTCAP=True, SPLIT=True, KV_FP8=False, KV_OFF32=True, FUSE_MERGE=True,
                      MERGE_ROWS=64, DECODE_MAP=False, WRITE_KV=False, ROUND_E4M3=False, READ_NEW=True, PDL=True,
                      ROPE_DIM=0)
    fp8 = dict(common, BLOCK_Q=4, BLOCK_N=128, SHORT_Q=0, SHORT_BLOCK_N=0, USE_WINDOW=False,
               USE_RANGES=False, USE_SOFTCAP=False, SPLIT=False, KV_FP8=True, KV_OFF32=False, FUSE_MERGE=False,
               MERGE_ROWS=64, DECODE_MAP=True, WRITE_KV=True, ROUND_E4M3=False, READ_NEW=False, PDL=False,
               ROPE_DIM=64)
    halves = dict(fp32, q_ptr="fp16", out_ptr="fp16", k_cache_ptr="fp16", v_cache_ptr="fp16", k_new_ptr="fp16",
                  v_new_ptr="fp16", slot_mapping_ptr="i64", k_desc="tensordesc<fp16[64, 128]>",
                  v_desc="tensordesc<fp16[64, 128]>")
    e4m3 = dict(fp32, q_ptr="bf16", out_ptr="bf16", k_cache_ptr="fp8e4nv", v_cache_ptr="fp8e4nv", k_new_ptr="bf16",
                v_new_ptr="bf16", slot_mapping_ptr="i64", k_desc="*bf16", v_desc="*bf16", cos_ptr="bf16",
                sin_ptr="bf16")
    merge = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4, PDL=True)
    return [variant(_attn_kernel, everything, halves, ints_as_one, num_warps=8),
            variant(_attn_kernel, fp8, e4m3, ints_as_one),
            variant(_merge_kernel, merge, dict(out_ptr="fp16", part_o_ptr="fp32", part_lse_ptr="fp32"), ints_as_one)]


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


def test_a_pool_stopped_early_ends_its_workers(tmp_path, monkeypatch):
    # what precompile does when its probe finds the cache warm
    from graphrt.capture.precompile import _Pool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pool = _Pool(("cuda", 90, 32), workers=2)
    assert pool.started == 0                                              # no variant yet: no process
    for head_dim in (64, 128, 256):
        pool.send(write_kv_variant(head_dim))
    jobs = [job for _, job, _ in pool._jobs]
    assert len(jobs) == 2 and all(job.poll() is None for job in jobs)     # importing (or compiling)
    pool.stop()
    assert all(job.returncode is not None for job in jobs)
    assert not list(tmp_path.rglob("*.cubin"))


def test_pool_workers_wait_for_variants_and_time_each_compile(tmp_path, monkeypatch):
    # a worker starts with each of the first variants (up to the limit; the next ones go
    # round robin) and compiles each as it is sent, timing it. The workers import Triton
    # and the kernel modules alone.
    from graphrt.capture.precompile import _Pool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pool = _Pool(("cuda", 90, 32), workers=3)
    pool.send(write_kv_variant(64))
    pool.send(write_kv_variant(128))
    assert pool.started == 2
    failures, seconds = pool.finish()
    assert failures == []
    assert all(job.returncode == 0 for _, job, _ in pool._jobs)
    compiled = {k: v for k, v in seconds.items() if k.startswith("_write_kv_kernel")}
    assert len(compiled) == 2 and all(v > 0 for v in compiled.values()), seconds
    imports = [v for k, v in seconds.items() if k.startswith("(imports)")]
    assert len(imports) == 2 and all(v > 0 for v in imports), seconds
    assert len(list(tmp_path.rglob("*.cubin"))) == 2


def test_a_worker_imports_no_torch():
    # what keeps a worker's start short: the kernel modules it loads import Triton alone
    import subprocess
    import sys

    from graphrt.capture import precompile

    modules = [f"{name}={__import__('importlib.util').util.find_spec(name).origin}" for name in precompile._Pool.MODULES]
    code = ("import runpy, sys; sys.argv = [sys.argv[0], '[\"cuda\", 90, 32]'] + sys.argv[1:]; "
            "ns = runpy.run_path(%r); import json; "
            "[ns['_load_by_path'](*m.split('=', 1)) for m in sys.argv[2:]]; "
            "print(json.dumps(sorted(k for k in sys.modules if k == 'torch' or k.startswith('graphrt'))))"
            % precompile.__file__)
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == sorted(precompile._Pool.MODULES)


def test_kernels_compile_for_the_gpu_with_int_arguments_specialised_to_one(tmp_path, monkeypatch):
    # On a GPU, Triton turns an int argument equal to 1 (a stride, num_blocks, a table of
    # one column) into a Python constant, which lacks tensor methods such as .to(); the
    # interpreter that runs the kernel tests never does. Compiling for sm_90 with every
    # int argument 1 catches such code without a GPU.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    variants = attention_variants(ints_as_one=True) + [write_kv_variant(128, fp8=True, ints_as_one=True)]
    failures = compile_in_pool(variants, ("cuda", 90, 32), workers=2)
    assert failures == []
    assert len(list(tmp_path.rglob("*.cubin"))) == len(variants)


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


def test_decode_buckets_of_every_size_share_the_attention_variants(monkeypatch):
    # Capture compiles one attention variant per distinct specialization key. Decode
    # buckets differ in their sequence count and split factor; neither may add variants:
    # all default decode buckets together need what the one-sequence bucket (split) and
    # the largest one (unsplit) need. Keys follow Triton's rule for launch arguments:
    # constexprs by value, ints by == 1 / multiple of 16 / other unless
    # do_not_specialize, tensors by dtype. No kernel runs: the launches are recorded.
    import importlib
    import inspect

    import graphrt.runtime as runtime_module
    from graphrt import Runtime, RuntimeConfig
    from graphrt.capture.buckets import default_buckets, make_buckets
    from graphrt.runtime import StepContext
    from graphrt.toy import ToyModel

    # the modules (graphrt.kernels exports a function named paged_attention too)
    pa = importlib.import_module("graphrt.kernels.paged_attention")
    kv_write = importlib.import_module("graphrt.kernels.kv_write")
    names = list(inspect.signature(pa._attn_kernel.fn).parameters)
    keys: list = []

    def key_of(args, kwargs) -> tuple:
        out = []
        for name, value in [*zip(names, args), *sorted(kwargs.items())]:
            if isinstance(value, torch.Tensor):
                kind = str(value.dtype)
            elif name.isupper() or name in ("num_warps", "num_stages"):
                kind = value
            elif isinstance(value, bool) or not isinstance(value, int):
                kind = type(value).__name__
            elif name in pa._PER_BUCKET:
                kind = "i32"
            else:
                kind = "1" if value == 1 else "D" if value % 16 == 0 else "N"
            out.append((name, kind))
        return tuple(out)

    class Recorder:
        def __init__(self, sink):
            self.sink = sink

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.sink.append(key_of(args, kwargs)) if self.sink is not None else None

    # nothing launches, but the wrappers' check for CPU tensors asks for the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pa, "_attn_kernel", Recorder(keys))
    monkeypatch.setattr(pa, "_merge_kernel", Recorder(None))
    monkeypatch.setattr(kv_write, "_write_kv_kernel", Recorder(None))
    # the split factors of a 132-SM GPU (decode_splits off CUDA is always 1)
    monkeypatch.setattr(runtime_module, "decode_splits",
                        lambda n, kv_heads, device: 1 << (max(1, min(64, 264 // (n * kv_heads))).bit_length() - 1))
    cfg = RuntimeConfig(num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=64, max_num_seqs=256,
                        max_num_tokens=512, max_model_len=64, max_prefix_ranges=1, dtype=torch.float32)
    rt = Runtime(cfg, ToyModel(cfg, num_layers=2, hidden=32, vocab=16, device="cpu"), num_layers=2, device="cpu")
    decode, _ = default_buckets(cfg.max_num_seqs, cfg.max_num_tokens)
    per_bucket = {}
    for bucket in make_buckets(decode, [], cfg.max_num_seqs, cfg.max_num_tokens):
        layout = rt.buffers.layout(bucket.num_seqs, bucket.num_tokens)
        rt.buffers.stage_empty(layout)
        ctx = StepContext(rt, rt.buffers.device_views(layout), max_query_len=bucket.max_query_len,
                          num_splits=runtime_module.decode_splits(bucket.num_seqs, cfg.num_kv_heads, "cpu"))
        keys.clear()
        rt.model_step(ctx)
        per_bucket[bucket.num_seqs] = set(keys)
    assert len(per_bucket) >= 8 and per_bucket[1] and per_bucket[256]
    every = set().union(*per_bucket.values())
    expected = per_bucket[1] | per_bucket[256]
    extra = every - expected
    near = [min(expected, key=lambda k: len(set(k) ^ set(e))) for e in extra]
    assert not extra, (f"{len(every)} attention variants for {len(per_bucket)} decode buckets, expected "
                       f"{len(expected)}; extra ones differ in {[sorted(set(e) - set(k)) for e, k in zip(extra, near)]}")


def test_manifest_lists_variants_while_their_cache_entries_last(tmp_path, monkeypatch):
    from triton import knobs

    from graphrt.capture import precompile as pc

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    path = pc.manifest_path("shapes A", ("cuda", 90, 32))
    assert path is not None and path.startswith(str(tmp_path))
    assert pc.manifest_path("shapes B", ("cuda", 90, 32)) != path
    assert pc.manifest_path("shapes A", ("cuda", 100, 32)) != path
    assert pc._read_manifest(path) is None                      # none yet
    v = write_kv_variant(64)
    (tmp_path / "abc123").mkdir()
    (tmp_path / "abc123" / "__grp___write_kv_kernel.json").write_text("{}")
    pc._write_manifest(path, [dict(v.__dict__, entry="abc123")])
    assert pc._read_manifest(path) == [v]
    (tmp_path / "abc123" / "__grp___write_kv_kernel.json").unlink()   # the cache entry went
    assert pc._read_manifest(path) is None
    with open(path, "w") as f:
        f.write("{not json")
    assert pc._read_manifest(path) is None
    report = pc.PrecompileReport(manifest=path, from_manifest=True)
    pc.forget_manifest(report)
    assert not (tmp_path / path).exists()


_CAPTURE_SCRIPT = """
import json, torch, numpy as np
from graphrt import Runtime, RuntimeConfig, SeqStep, Step
from graphrt.toy import ToyModel
cfg = RuntimeConfig(num_q_heads=6, num_kv_heads=2, head_dim=40, block_size=16, num_blocks=64, max_num_seqs=4,
                    max_num_tokens=32, max_model_len=256, max_prefix_ranges=2, dtype=torch.bfloat16)
torch.manual_seed(0)
model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, device="cuda")
rt = Runtime(cfg, model, num_layers=2, device="cuda")
rt.capture(decode_buckets=[1, 4], mixed_buckets=[32], quiet=True, precompile=True)
r = rt.graphs.precompile_report
step = Step([SeqStep(q_len=5, context_len=0, block_ids=[0]), SeqStep(q_len=3, context_len=0, block_ids=[1])])
hidden, _ = rt.step(step, np.arange(8) % 50)
assert rt.last.mode == "replay"
eager = Runtime(cfg, model, num_layers=2, device="cuda")
want, _ = eager.step(step, np.arange(8) % 50)
torch.testing.assert_close(hidden[:8].float(), want[:8].float(), atol=2e-2, rtol=2e-2)
print(json.dumps(dict(variants=r.variants, from_manifest=r.from_manifest, manifest=r.manifest, failures=r.failures)))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_warm_capture_loads_the_manifest_and_a_stale_one_goes(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}

    def capture() -> dict:
        child = subprocess.run([sys.executable, "-c", _CAPTURE_SCRIPT], env=env, capture_output=True, text=True,
                               timeout=600)
        assert child.returncode == 0, child.stderr[-3000:]
        return json.loads(child.stdout.strip().splitlines()[-1])

    cold = capture()                       # a fresh cache: the search and the pool; writes the manifest
    assert not cold["from_manifest"] and cold["failures"] == [] and os.path.isfile(cold["manifest"]), cold
    warm = capture()                       # the same shapes: the manifest's variants, loaded
    assert warm["from_manifest"] and warm["variants"] == cold["variants"], warm
    with open(cold["manifest"]) as f:      # a manifest missing one variant: used, then removed
        listed = json.load(f)
    listed["variants"] = listed["variants"][1:]
    with open(cold["manifest"], "w") as f:
        json.dump(listed, f)
    stale = capture()
    assert stale["from_manifest"] and stale["variants"] == cold["variants"] - 1, stale
    assert not os.path.exists(cold["manifest"]), "the capture kept a manifest that missed a variant"
    again = capture()                      # found again and written anew
    assert not again["from_manifest"] and os.path.isfile(cold["manifest"]), again


def test_capture_precompiles_unless_told_not_to(monkeypatch):
    # Runtime.capture(precompile=None) precompiles unless the environment's
    # GRAPHRT_PRECOMPILE is "0"; an explicit argument wins. (The graph set is a stand-in
    # that records what capture asks of it: no GPU needed.)
    from graphrt import Runtime, RuntimeConfig
    from graphrt.toy import ToyModel

    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=8, max_num_seqs=2,
                        max_num_tokens=16, max_model_len=64, max_prefix_ranges=1, dtype=torch.float32)
    rt = Runtime(cfg, ToyModel(cfg, num_layers=1, hidden=16, vocab=10), num_layers=1, device="cpu")
    asked = []

    class Graphs:
        graphs = {}

        def capture(self, buckets, prepare, *, precompile, precompile_key, **_):
            asked.append((precompile, precompile_key))
            self.graphs.update(dict.fromkeys(buckets))

    rt.graphs = Graphs()
    monkeypatch.setattr(Runtime, "_precompile_key", lambda self: "key")      # (it names the GPU)
    for env, arg, want in ((None, None, True), ("0", None, False), ("1", None, True), ("0", True, True),
                           (None, False, False)):
        if env is None:
            monkeypatch.delenv("GRAPHRT_PRECOMPILE", raising=False)
        else:
            monkeypatch.setenv("GRAPHRT_PRECOMPILE", env)
        asked.clear()
        rt.capture(decode_buckets=[1], mixed_buckets=[], quiet=True, precompile=arg)
        assert asked == [(want, "key" if want else None)], (env, arg, asked)
