"""The transformers adapter against transformers' own forward: tiny random models built in
code (no downloads), a multi-step serving loop (chunked prefill, decodes, requests joining
and finishing at different steps, images as prefix ranges with their embeddings given per
step), each sampled position's logits compared with the library's forward over the full
sequence. CPU: fp32 through the interpreter. GPU: every step a graph replay, bf16/fp16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from _cases import fresh_seed  # noqa: E402
from graphrt import Runtime  # noqa: E402
from graphrt.integrations.tiny import BOI, EOI, IMAGE, KINDS, VOCAB, logit_error, make_requests, tiny_model  # noqa: E402
from graphrt.integrations.transformers import TransformersModel  # noqa: E402
from graphrt.serve import serve  # noqa: E402


def run_and_compare(kind: str, device, dtype, *, capture: bool, seed: int, chunk: int = 12) -> float:
    """Worst |graphrt - transformers| / max |logit| over every sampled position."""
    rng = np.random.default_rng(seed)
    hf = tiny_model(kind, seed).to(device=device, dtype=dtype).eval()
    model = TransformersModel(hf)
    cfg = model.runtime_config(block_size=16, num_blocks=64, max_num_seqs=4, max_num_tokens=48, max_model_len=128,
                               max_prefix_ranges=2)
    rt = Runtime(cfg, model, num_layers=model.num_layers, device=device, strict=capture)
    if capture:
        rt.capture(decode_buckets=[1, 2, 4], mixed_buckets=[16, 48], quiet=True)
    reqs = make_requests(rng, model, images=kind == "gemma3", device=device)
    modes = []
    serve(rt, reqs, chunk=chunk, free_blocks=rng.permutation(cfg.num_blocks).tolist(), never=(BOI, EOI, IMAGE),
          on_step=lambda *_: modes.append(rt.last.mode))
    if capture:
        assert set(modes) == {"replay"}, f"steps ran {modes}"
    return logit_error(hf, reqs, device)


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_matches_transformers_cpu(kind, device):
    if device.type == "cuda":
        pytest.skip("the GPU test below runs the same loop from graphs")
    seed = fresh_seed()
    worst = run_and_compare(kind, device, torch.float32, capture=False, seed=seed)
    print(f"{kind}: worst logit error / max |logit| = {worst:.2e}")
    assert worst < 1e-5, f"{kind}: logits off by {worst:.2e} of max |logit| (seed={seed})"


@pytest.mark.parametrize("rule,global_ranges", [("ranges_unclipped", True), ("clip", False)],
                         ids=["ranges-unclipped", "global-layers-causal"])
def test_gemma3_other_mask_settings_are_caught(monkeypatch, device, rule, global_ranges):
    """The check above tells mask settings apart: with images longer than the sliding
    window, the rule older transformers and vLLM used (ranges past the window), or
    Gemma4's causal-only global layers, put Gemma3's logits off by ~1e-2 (2e-2..6e-2 seen)."""
    from graphrt.integrations import transformers as adapter

    monkeypatch.setitem(adapter.MASK_SETTINGS, "gemma3", adapter.MaskSettings(rule, global_ranges))
    seed = fresh_seed()
    worst = run_and_compare("gemma3", device, torch.float32, capture=False, seed=seed)
    assert worst > 1e-3, f"wrong mask settings went unnoticed: {worst:.2e} (seed={seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adapter_matches_transformers_replayed(kind, dtype):
    seed = fresh_seed()
    worst = run_and_compare(kind, torch.device("cuda"), dtype, capture=True, seed=seed)
    print(f"{kind} {dtype}: worst logit error / max |logit| = {worst:.2e}")
    assert worst < (5e-2 if dtype == torch.bfloat16 else 1e-2), f"{kind}: off by {worst:.2e} (seed={seed})"


@pytest.mark.gpu
def test_adapter_steps_are_one_pinned_copy_and_no_sync():
    """Gemma3 with images, every step a replay: the profiler sees one pinned host-to-device
    copy per step, no pageable one, and no host sync inside any step (strict mode too)."""
    from torch.profiler import ProfilerActivity, profile

    from graphrt.profiling import count_transfers

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    device = torch.device("cuda")
    model = TransformersModel(tiny_model("gemma3", seed).to(device=device, dtype=torch.bfloat16).eval())
    cfg = model.runtime_config(block_size=16, num_blocks=64, max_num_seqs=4, max_num_tokens=48, max_model_len=128,
                               max_prefix_ranges=2)
    rt = Runtime(cfg, model, num_layers=model.num_layers, device=device, strict=True)
    rt.capture(decode_buckets=[1, 2, 4], mixed_buckets=[16, 48], quiet=True)
    reqs = make_requests(rng, model, images=True, device=device)
    never = torch.tensor([BOI, EOI, IMAGE], device=device)
    modes = []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = serve(rt, reqs, chunk=12, free_blocks=rng.permutation(cfg.num_blocks).tolist(), never=never,
                      on_step=lambda *_: modes.append(rt.last.mode))
        torch.cuda.synchronize()
    seen = count_transfers(prof, "graphrt_step")
    assert set(modes) == {"replay"} and seen.regions == steps
    assert seen.h2d_pinned == steps, f"{seen.h2d_pinned} pinned HtoD copies over {steps} steps"
    assert seen.h2d_pageable == 0 and seen.syncs == 0, f"{seen.h2d_pageable} pageable copies, {seen.syncs} syncs"


def test_dynamic_rope_is_refused():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="dynamic"):
        TransformersModel(transformers.LlamaForCausalLM(cfg))


def test_image_ranges():
    model = TransformersModel(tiny_model("gemma3", 0))
    ids = [1, BOI, IMAGE, IMAGE, EOI, IMAGE, 2, IMAGE]
    assert model.image_ranges(ids) == [(2, 4), (5, 6), (7, 8)]
