"""graphrt.serve: the one request loop (continuous batching, chunked prefill that never
cuts a range) of the demos and ``graphrt bench model``: its greedy tokens against plain
steps, its prefill mode that leaves the first tokens on the device, its sampled mode, and
what it refuses."""

from __future__ import annotations

import pytest
import torch

from _cases import fresh_seed, rngs
from graphrt import Runtime, RuntimeConfig
from graphrt.sampling import GREEDY, SamplingParams
from graphrt.serve import Request, serve
from graphrt.toy import ToyModel


class Sampled(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ctx):
        hidden, logits = self.model(ctx)
        return hidden, logits, ctx.sample(logits)


def setup(device, seed: int, *, sampling: bool = False):
    cfg = RuntimeConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=48, max_num_seqs=4,
                        max_num_tokens=64, max_model_len=256, max_prefix_ranges=2, dtype=torch.float32,
                        sampling=sampling)
    model = ToyModel(cfg, num_layers=2, hidden=64, vocab=50, window=24, seed=seed, device=device)
    return cfg, Runtime(cfg, Sampled(model) if sampling else model, num_layers=2, device=device)


def requests(rng, new_tokens: int, n: int = 3) -> list[Request]:
    reqs = []
    for rid in range(n):
        length = int(rng.integers(14, 30))
        start = int(rng.integers(1, length - 8))
        reqs.append(Request(rid=rid, arrival=rid, prompt=rng.integers(0, 50, length).tolist(), new_tokens=new_tokens,
                            ranges=[(start, start + 8)]))
    return reqs


def test_first_tokens_on_the_device_are_the_read_back_ones(device):
    """``read_back=False`` (the bench's prefill): the same first tokens and logits as the
    loop that reads them, left on the device as 0-d tensors."""
    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg, rt = setup(device, seed)
    reqs = requests(rng, 1)
    prompts = [list(r.prompt) for r in reqs]
    host_times: list[float] = []
    steps = serve(rt, reqs, chunk=20, free_blocks=list(range(cfg.num_blocks)), host_times=host_times)
    assert steps == len(host_times) > 1         # chunked: more than one step
    again = [Request(rid=r.rid, arrival=r.arrival, prompt=p, new_tokens=1, ranges=r.ranges)
             for r, p in zip(reqs, prompts)]
    serve(rt, again, chunk=20, free_blocks=list(range(cfg.num_blocks)), read_back=False)
    for r, d in zip(reqs, again):
        assert isinstance(d.generated[0], torch.Tensor) and d.generated[0].dim() == 0
        assert d.generated[0].device.type == torch.device(device).type
        assert int(d.generated[0]) == r.generated[0], f"request {r.rid} (seed {seed})"
        torch.testing.assert_close(d.logits[0][1], r.logits[0][1])
        assert d.logits[0][0] == r.logits[0][0] == len(r.prompt) - 1


def test_greedy_loop_matches_steps_run_one_request_at_a_time(device):
    """Requests joining at different steps, prefills chunked around their ranges: each one's
    greedy tokens are those of the request run alone, and the banned token never comes."""
    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg, rt = setup(device, seed)
    reqs = requests(rng, 4)
    alone = [Request(rid=r.rid, arrival=0, prompt=list(r.prompt), new_tokens=4, ranges=r.ranges) for r in reqs]
    together = [Request(rid=r.rid, arrival=r.arrival, prompt=list(r.prompt), new_tokens=4, ranges=r.ranges)
                for r in reqs]
    seen = []
    serve(rt, together, chunk=16, free_blocks=list(range(cfg.num_blocks)), never=[7],
          on_step=lambda step_no, step, owners, ids, out: seen.append((step.num_seqs, len(ids), step.num_tokens)))
    assert all(n_ids == tokens for _, n_ids, tokens in seen)
    assert max(s for s, _, _ in seen) > 1       # some steps ran several requests
    for a in alone:
        serve(rt, [a], chunk=16, free_blocks=list(range(cfg.num_blocks)), never=[7])
    for a, t in zip(alone, together):
        assert t.generated == a.generated, f"request {a.rid} (seed {seed})"
        assert 7 not in t.generated


def test_sampled_loop_takes_the_steps_draws(device):
    """With ``sampling``, each step's settings travel with it and the tokens are the ones the
    step drew: temperature 0 gives the greedy loop's tokens; a seeded request draws the
    same tokens on a second run."""
    seed = fresh_seed()
    rng, _ = rngs(seed)
    cfg, rt = setup(device, seed, sampling=True)
    base = requests(rng, 3)

    def run(settings):
        reqs = [Request(rid=r.rid, arrival=r.arrival, prompt=list(r.prompt), new_tokens=3, ranges=r.ranges)
                for r in base]
        serve(rt, reqs, chunk=16, free_blocks=list(range(cfg.num_blocks)), sampling=settings)
        return [r.generated for r in reqs]

    greedy = run({r.rid: GREEDY for r in base})
    plain = [Request(rid=r.rid, arrival=r.arrival, prompt=list(r.prompt), new_tokens=3, ranges=r.ranges)
             for r in base]
    _, plain_rt = setup(device, seed)           # the same weights, a step that returns logits last
    serve(plain_rt, plain, chunk=16, free_blocks=list(range(cfg.num_blocks)))
    assert greedy == [r.generated for r in plain]
    hot = {r.rid: SamplingParams(temperature=1.5, seed=100 + r.rid) for r in base}
    first = run(hot)
    assert run(hot) == first


def test_device_tokens_only_for_prefills(device):
    cfg, rt = setup(device, 0)
    with pytest.raises(ValueError, match="read_back=False.*new_tokens=1"):
        serve(rt, [Request(rid=0, arrival=0, prompt=[1, 2, 3], new_tokens=2)], chunk=16,
              free_blocks=list(range(cfg.num_blocks)), read_back=False)
