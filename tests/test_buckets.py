"""graphrt.capture.buckets: the three step kinds' buckets (decode, verify, mixed), the
sizes they refuse, and which bucket a step picks."""

from __future__ import annotations

import pytest

from graphrt.capture import Bucket, BucketIndex, make_buckets


def test_verify_buckets_count_sequences_of_q_len_tokens():
    buckets = make_buckets([1, 4], [16, 64], 8, 64, verify=[2, 8], verify_q_len=4)
    verify = [b for b in buckets if b.kind == "verify"]
    assert verify == [Bucket(8, 2, "verify", 4), Bucket(32, 8, "verify", 4)]
    assert [b.max_query_len for b in verify] == [4, 4]
    assert [b.splits_kv for b in buckets] == [True, True, True, True, False, False]
    assert str(verify[1]) == "verify[seqs=8,q_len=4,tokens=32]"
    assert Bucket(4, 4, "decode").max_query_len == 1 and Bucket(64, 8, "mixed").max_query_len is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(verify=[2], verify_q_len=None), r"verify_q_len \(drafts \+ 1\) must be an int in \[2, 64\]"),
    (dict(verify=[2], verify_q_len=1), r"verify_q_len .* must be an int in \[2, 64\]"),
    (dict(verify=[2], verify_q_len=65), r"verify_q_len .* must be an int in \[2, 64\]"),
    (dict(verify=[9], verify_q_len=4), r"verify_buckets entries must be ints in \[1, 8\]"),   # max_num_seqs
    (dict(verify=[4], verify_q_len=32), r"verify_buckets entries must be ints in \[1, 2\]"),  # 64 tokens
    (dict(verify=[True], verify_q_len=4), r"verify_buckets entries must be ints"),
])
def test_verify_sizes_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_buckets([1], [16], 8, 64, **kwargs)


def test_a_step_of_equal_query_lengths_picks_its_verify_bucket():
    index = BucketIndex(make_buckets([1, 4], [16, 64], 8, 64, verify=[2, 8], verify_q_len=4))
    assert index.pick(3, 12, False, 4) == Bucket(32, 8, "verify", 4)     # the smallest with >= 3 sequences
    assert index.pick(2, 8, False, 4) == Bucket(8, 2, "verify", 4)
    assert index.pick(3, 12, False, None) == Bucket(16, 8, "mixed")     # lengths not all equal: mixed
    assert index.pick(2, 6, False, 3) == Bucket(16, 8, "mixed")         # no verify bucket of q_len 3
    assert index.pick(3, 3, True, 1) == Bucket(4, 4, "decode")           # decodes stay decodes
    no_verify = BucketIndex(make_buckets([1], [16], 8, 64))
    assert no_verify.verify == {} and no_verify.pick(2, 8, False, 4) == Bucket(16, 8, "mixed")


@pytest.mark.parametrize("drafts", [None, 0, True, 2.0])
def test_capture_refuses_verify_buckets_without_a_draft_count(drafts):
    import torch

    from graphrt import Runtime, RuntimeConfig
    from graphrt.toy import ToyModel

    cfg = RuntimeConfig(num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16, num_blocks=8, max_num_seqs=2,
                        max_num_tokens=16, max_model_len=64, dtype=torch.float32)
    rt = Runtime(cfg, ToyModel(cfg, num_layers=1, hidden=32, vocab=20), num_layers=1)
    with pytest.raises(ValueError, match="drafts must be an int >= 1 with verify_buckets"):
        rt.capture(decode_buckets=[1], mixed_buckets=[16], verify_buckets=[2], drafts=drafts)


def test_split_factor_fills_the_gpu_and_stops_at_the_key_tiles():
    """``decode_splits``' rule (``split_factor``): about two programs per SM, a power of two,
    at most 64, and no more splits than the longest context has key tiles."""
    from graphrt.kernels.paged_attention import MAX_SPLITS, split_factor

    assert split_factor(132, 1, 8) == 32                # 264 programs / 8 KV heads: 33 -> 32
    assert split_factor(132, 8, 8) == 4 and split_factor(132, 256, 8) == 1
    assert split_factor(1000, 1, 1) == MAX_SPLITS
    assert [split_factor(132, 1, 8, t) for t in (None, 64, 6, 4, 3, 1, 0)] == [32, 32, 4, 4, 2, 1, 1]


@pytest.mark.parametrize("max_model_len,head_dim,want", [(656, 64, 4), (544, 64, 4), (65536, 64, 32),
                                                         (256, 256, 4), (100, 64, 1)])
def test_a_bucket_splits_no_further_than_its_longest_context(monkeypatch, max_model_len, head_dim, want):
    """The runtime caps a decode bucket's split factor at the key tiles of ``max_model_len``
    (the decode tile: 128 keys for head_dim <= 128 in bf16, 64 past it); a bucket that does
    not split keys has 1. The GPU's 132 SMs stood in by ``split_factor``."""
    import torch

    import graphrt.runtime as runtime_module
    from graphrt import Runtime, RuntimeConfig
    from graphrt.kernels.paged_attention import split_factor
    from graphrt.toy import ToyModel

    seen = []

    def on_132_sms(num_seqs, num_kv_heads, device, *, max_key_tiles=None):
        seen.append(max_key_tiles)
        return split_factor(132, num_seqs, num_kv_heads, max_key_tiles)

    monkeypatch.setattr(runtime_module, "decode_splits", on_132_sms)
    cfg = RuntimeConfig(num_q_heads=32, num_kv_heads=8, head_dim=head_dim, block_size=16, num_blocks=8,
                        max_num_seqs=2, max_num_tokens=16, max_model_len=max_model_len, dtype=torch.bfloat16)
    rt = Runtime(cfg, ToyModel(cfg, num_layers=1, hidden=32, vocab=20), num_layers=1)
    assert rt._splits(Bucket(1, 1, "decode")) == want
    assert seen == [-(-max_model_len // (128 if head_dim <= 128 else 64))]
    assert rt._splits(Bucket(16, 2, "mixed")) == 1
