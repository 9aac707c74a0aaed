"""Every step context implements graphrt.context's protocol: the runtime's StepContext and
the reference runner's hold every member of ModelContext with its signature; the
transformers adapter's construction check holds AttentionContext's."""

from __future__ import annotations

import inspect

import pytest
import torch

from graphrt import ReferenceRunner, Runtime, RuntimeConfig, SeqStep, Step
from graphrt.context import MEMBERS, AttentionContext, ModelContext


def contexts(device):
    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=8, max_num_seqs=2,
                        max_num_tokens=16, max_model_len=64, max_prefix_ranges=1, dtype=torch.float32, sampling=True)
    seen = []

    def step_fn(ctx):
        seen.append(ctx)
        return torch.zeros(1)

    step = Step([SeqStep(q_len=3, context_len=0, block_ids=[1])])
    Runtime(cfg, step_fn, num_layers=1, device=device).step(step, [1, 2, 3])
    ReferenceRunner(cfg, step_fn, num_layers=1, device=device).step(step, [1, 2, 3])
    return seen


def test_runtime_and_reference_contexts_are_model_contexts(device):
    runtime_ctx, reference_ctx = contexts(device)
    for ctx in (runtime_ctx, reference_ctx):
        name = type(ctx).__name__
        assert isinstance(ctx, ModelContext), name
        missing = [m for m in MEMBERS if not hasattr(ctx, m)]
        assert not missing, f"{name} lacks {missing}"
        for method in ("attention", "merge_embeds", "sample"):
            want = list(inspect.signature(getattr(ModelContext, method)).parameters)[1:]
            got = list(inspect.signature(getattr(ctx, method)).parameters)
            assert got == want, f"{name}.{method}{got} differs from the protocol's {want}"
        assert ctx.last_token_index.tolist() == [2]


def test_adapter_check_is_an_attention_context():
    pytest.importorskip("transformers")
    from graphrt.integrations.transformers import _Probe

    assert isinstance(_Probe(), AttentionContext)
    want = list(inspect.signature(AttentionContext.attention).parameters)[1:]
    assert list(inspect.signature(_Probe().attention).parameters) == want
