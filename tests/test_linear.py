"""graphrt.kernels.small_linear (a decode step's few rows against one to three weights)
against a float64 x @ w.T + b."""

from __future__ import annotations

import pytest
import torch

from _cases import assert_close, fresh_seed, rngs
from graphrt.kernels.linear import LinearConfig, block_rows, default_linear_config, small_linear

HAS_CUDA = torch.cuda.is_available()
# (dtype, atol, rtol): bf16 through tl.dot only on the GPU (the interpreter's bf16 dot is wrong)
DTYPES = [
    pytest.param((torch.float32, 1e-4, 1e-4), id="fp32"),
    pytest.param((torch.float16, 2e-2, 1e-2), id="fp16"),
    pytest.param((torch.bfloat16, 1e-1, 2e-2), id="bf16", marks=pytest.mark.gpu),
]
CASES = [   # rows, output rows of each weight, columns
    pytest.param(1, [40], 96, id="one-row"),
    pytest.param(1, [16, 8, 8], 64, id="one-row-qkv"),
    pytest.param(2, [33, 17], 130, id="two-rows-odd"),
    pytest.param(17, [64, 64], 48, id="rows17-pair"),
    pytest.param(64, [31, 1, 7], 40, id="rows64-three"),
    pytest.param(8, [1], 1, id="one-column"),
]
CONFIGS = [None, LinearConfig(block_n=16, block_k=32), LinearConfig(block_n=32, block_k=64, num_warps=8)]


@pytest.mark.parametrize("dtype_tol", DTYPES)
@pytest.mark.parametrize("rows,outs,cols", CASES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_small_linear(dtype_tol, rows, outs, cols, bias, device):
    dtype, atol, rtol = dtype_tol
    seed = fresh_seed()
    _, gen = rngs(seed)
    # x as a view with a row stride past its columns (a slice of a wider activation)
    x = torch.randn(rows, cols + 5, generator=gen).to(device=device, dtype=dtype)[:, :cols]
    ws = [torch.randn(n, cols, generator=gen).to(device=device, dtype=dtype) for n in outs]
    bs = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in outs] if bias else None
    for cfg in CONFIGS:
        got = small_linear(x, ws, bs, config=cfg)
        assert len(got) == len(ws)
        for i, (y, w) in enumerate(zip(got, ws)):
            ref = x.double() @ w.double().T + (bs[i].double() if bias else 0)
            assert y.dtype == dtype and tuple(y.shape) == (rows, w.shape[0])
            assert_close(f"y[{i}] ({cfg})", y, ref, atol, rtol, seed)


@pytest.mark.parametrize("dtype_tol", DTYPES)
@pytest.mark.parametrize("rows,outs,cols", [CASES[0], CASES[3], CASES[4]])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_small_linear_gated(dtype_tol, rows, outs, cols, activation, device):
    """With a gate the input is act(gate) * x, act(gate) and the product each rounded to
    x's dtype as the separate ops round (a SwiGLU / GeGLU down projection; act silu, or
    gelu's tanh approximation as torch computes it); gate values reach the far tails, where
    the activation is 0 or the value itself."""
    import torch.nn.functional as F

    dtype, atol, rtol = dtype_tol
    seed = fresh_seed()
    _, gen = rngs(seed)
    x = torch.randn(rows, cols + 3, generator=gen).to(device=device, dtype=dtype)[:, :cols]
    gate = (torch.randn(rows, cols, generator=gen) * 4).to(device=device, dtype=dtype)
    gate[0, :4] = torch.tensor([-120.0, 90.0, -6.0, 1e-3])
    ws = [torch.randn(n, cols, generator=gen).to(device=device, dtype=dtype) for n in outs]
    act = F.silu if activation == "silu" else lambda g: F.gelu(g, approximate="tanh")
    h = (act(gate.double()).to(dtype).double() * x.double()).to(dtype).double()
    for cfg in CONFIGS:
        got = small_linear(x, ws, config=cfg, gate=gate, activation=activation)
        for i, (y, w) in enumerate(zip(got, ws)):
            assert_close(f"y[{i}] ({cfg})", y, h @ w.double().T, atol, rtol, seed)
    with pytest.raises(ValueError, match="gate must have x's shape"):
        small_linear(x, ws, gate=gate[:, :-1])
    with pytest.raises(TypeError, match="gate must have dtype"):
        small_linear(x, ws, gate=gate.double())
    with pytest.raises(ValueError, match="activation must be one of"):
        small_linear(x, ws, gate=gate, activation="gelu")


@pytest.mark.parametrize("dtype_tol", DTYPES)
@pytest.mark.parametrize("rows,outs,cols", [CASES[1], CASES[2], CASES[4]])
@pytest.mark.parametrize("offset", [False, True], ids=["w", "1+w"])
def test_small_linear_normed(dtype_tol, rows, outs, cols, offset, device):
    """With a norm weight the input is x under an RMSNorm (x / sqrt(mean(x**2) + eps) times
    w or 1 + w), against float64; with a residual (one weight) the output is residual +
    the product rounded to x's dtype. Rows of very different scales, one all zeros."""
    dtype, atol, rtol = dtype_tol
    seed = fresh_seed()
    _, gen = rngs(seed)
    x = torch.randn(rows, cols + 3, generator=gen)[:, :cols] * torch.logspace(-2, 2, rows)[:, None]
    x[-1] = 0.0
    x = x.to(device=device, dtype=dtype)
    nw = (torch.randn(cols, generator=gen) / 2 + (0 if offset else 1)).to(device=device, dtype=dtype)
    ws = [(torch.randn(n, cols, generator=gen) / 4).to(device=device, dtype=dtype) for n in outs]
    bs = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in outs]
    eps = 1e-5
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (nw.double() + (1 if offset else 0))
    for cfg in CONFIGS:
        got = small_linear(x, ws, bs, config=cfg, norm_weight=nw, norm_eps=eps, norm_offset=offset)
        for i, (y, w) in enumerate(zip(got, ws)):
            assert_close(f"y[{i}] ({cfg})", y, xn @ w.double().T + bs[i].double(), atol, rtol, seed)
    r = torch.randn(rows, outs[0], generator=gen).to(device=device, dtype=dtype)
    (y,) = small_linear(x, ws[:1], bs[:1], norm_weight=nw.float(), norm_eps=eps, norm_offset=offset, residual=r)
    plain = (xn @ ws[0].double().T + bs[0].double()).to(dtype)
    assert_close("residual + y", y, r.double() + plain.double(), atol, rtol, seed)
    (y,) = small_linear(x, ws[:1], residual=r)                          # a residual alone
    assert_close("residual + x @ w.T", y, r.double() + (xd @ ws[0].double().T).to(dtype).double(), atol, rtol, seed)
    with pytest.raises(ValueError, match="a residual comes with one weight"):
        small_linear(x, [ws[0], ws[0]], residual=r)
    with pytest.raises(ValueError, match="residual must have shape"):
        small_linear(x, ws[:1], residual=r[:, :-1])
    with pytest.raises(ValueError, match="norm_weight must have x's"):
        small_linear(x, ws, norm_weight=nw[:-1])
    with pytest.raises(ValueError, match="norm_eps must be a float"):
        small_linear(x, ws, norm_weight=nw, norm_eps=0.0)
    with pytest.raises(TypeError, match="norm_offset must be a bool"):
        small_linear(x, ws, norm_weight=nw, norm_offset=1)


def test_small_linear_refuses_bad_input(device):
    x = torch.zeros(2, 8, device=device)
    w = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        small_linear(x, [])
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        small_linear(x, [w] * 4)
    with pytest.raises(ValueError, match="rows"):
        small_linear(torch.zeros(65, 8, device=device), [w])
    with pytest.raises(ValueError, match=r"weights\[0\] has 7 columns"):
        small_linear(x, [torch.zeros(4, 7, device=device)])
    with pytest.raises(TypeError, match=r"weights\[1\] must have dtype"):
        small_linear(x, [w, w.half()])
    with pytest.raises(ValueError, match=r"biases\[0\] has 3 entries"):
        small_linear(x, [w], [torch.zeros(3, device=device)])
    with pytest.raises(ValueError, match="one tensor per weight"):
        small_linear(x, [w, w], [torch.zeros(4, device=device)])
    with pytest.raises(ValueError, match="block_n must be >= 16"):
        small_linear(x, [w], config=LinearConfig(block_n=8, block_k=32))
    with pytest.raises(ValueError, match="contiguous last dim"):
        small_linear(torch.zeros(8, 2, device=device).T, [w])
    with pytest.raises(ValueError, match="power of two"):
        LinearConfig(block_n=12, block_k=32)


def test_default_config_fits_the_rows():
    for m in (1, 2, 16, 17, 33, 64):
        for itemsize in (2, 4):
            cfg = default_linear_config(m, 4096, 4096, itemsize)
            assert block_rows(m) == 1 or cfg.block_n >= 16
            assert block_rows(m) >= m
            if block_rows(m) > 1:          # the tiles' loads in flight within the H100's 232 KB
                assert (block_rows(m) + cfg.block_n) * cfg.block_k * itemsize * cfg.num_stages <= 116 << 10


def _layer(x, wq, wk, wv, wo, wg, wu, wd, bq, bk, bv, lm):
    """A decoder layer's matmuls, as a model makes them (3-D activations, F.linear)."""
    import torch.nn.functional as F

    q, k, v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
    h = x + F.linear(q * k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True), wo)
    g, u = F.linear(h, wg), F.linear(h, wu)
    h = h + F.linear(torch.nn.functional.silu(g) * u, wd)
    return F.linear(h, lm)


@pytest.mark.parametrize("rows", [1, 17, 33], ids=["rows1", "rows17", "rows33-cublas"])
def test_linear_pass_groups_shared_inputs(rows, device):
    """group_small_linears on the aten graph of a layer: q/k/v (with biases) in one launch,
    gate/up in one, the rest by the rules (one row: every matmul; more: groups and wide
    outputs only; past 32 rows: none), and the rewritten graph computes what the graph did:
    against float64, within the fp16 graph's own error (the same fp16 rounding between the
    matmuls, but each sum in its own order: an intermediate that rounds the other way is
    carried through the layer and the head, so the two fp16 results are not compared with a
    fixed tolerance)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphrt.capture.linear_pass import group_small_linears

    seed = fresh_seed()
    _, gen = rngs(seed)
    # the LM head: wide (>= 32768 rows) where that decides (rows > 1); small for one row, whose
    # 4-row programs the interpreter would take a minute over
    hidden, heads, inter, vocab = 48, 16, 80, 33000 if rows > 1 else 100
    shapes = [(hidden, hidden), (heads, hidden), (heads, hidden), (hidden, hidden), (inter, hidden),
              (inter, hidden), (hidden, inter), (hidden,), (heads,), (heads,), (vocab, hidden)]
    args = [torch.randn(1, rows, hidden, generator=gen).to(device, torch.float16)] + \
        [(torch.randn(*s, generator=gen) / 8).to(device, torch.float16) for s in shapes]
    gm = make_fx(_layer)(*args)
    want = gm(*args)
    replaced = group_small_linears(gm.graph, devices=(device.type,))
    gm.graph.lint()
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.graphrt.small_linear.default]
    mms = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert all(c.args[3] is True for c in calls), [c.args for c in calls]   # the weights: inputs none writes
    gated = [c.args[4] is not None for c in calls]   # the down projection takes silu(g) * u's g and u
    muls = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.silu.default)]
    if rows == 1:
        assert (replaced, [len(c.args[1]) for c in calls], len(mms)) == (8, [3, 1, 2, 1, 1], 0)
        assert gated == [False, False, False, True, False]
    elif rows <= 32:     # groups and the wide head only: o and down stay with cuBLAS
        assert (replaced, [len(c.args[1]) for c in calls], len(mms)) == (6, [3, 2, 1], 2)
        assert gated == [False, False, False]
    else:
        assert (replaced, calls, len(mms)) == (0, [], 8)
    assert len(muls) == (1 if rows == 1 else 3), muls
    exact = _layer(*[a.double() for a in args])
    own, grouped = ((t.double() - exact).abs().max().item() for t in (want, gm(*args)))
    assert grouped <= 1.5 * own + 1e-3 * exact.abs().max().item(), (grouped, own, seed)


@pytest.mark.parametrize("form", ["silu", "inductor", "sigmoid", "not-silu", "gelu-tanh", "gelu-inductor",
                                  "gelu-erf", "not-gelu"])
def test_linear_pass_finds_the_swiglu_product(form):
    """The gated product is found in the forms a traced model's graph holds: ``aten.silu``,
    Inductor's decomposition (g / (1 + exp(-g)) in fp32, rounded), g * sigmoid(g), and
    gelu's tanh form as ``aten.gelu`` and as decomposed; not in look-alikes (g / (2 +
    exp(-g)), the erf gelu, a tanh form with another constant)."""
    import torch.nn.functional as F
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphrt.capture.linear_pass import _swiglu

    def tanh_form(g, c=0.044715):
        gf = g.float()
        return (gf * 0.5 * (torch.tanh(0.7978845608028654 * (gf + gf * gf * gf * c)) + 1)).to(g.dtype)

    act = {"silu": F.silu, "inductor": F.silu, "sigmoid": lambda g: g * torch.sigmoid(g),
           "not-silu": lambda g: (g.float() / (2 + torch.exp(-g.float()))).to(g.dtype),
           "gelu-tanh": lambda g: F.gelu(g, approximate="tanh"),
           "gelu-inductor": lambda g: F.gelu(g.float(), approximate="tanh").to(g.dtype),
           "gelu-erf": F.gelu, "not-gelu": lambda g: tanh_form(g, 0.05)}[form]

    def mlp(g, u):
        return act(g) * u

    g, u = torch.randn(2, 1, 8, dtype=torch.float16), torch.randn(2, 1, 8, dtype=torch.float16)
    decomposed = form in ("inductor", "gelu-inductor")
    gm = make_fx(mlp, decomposition_table=select_decomp_table() if decomposed else None)(g, u)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.silu.default in targets) == (form == "silu"), targets
    assert (torch.ops.aten.gelu.default in targets) == (form in ("gelu-tanh", "gelu-erf")), targets
    mul = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    found = _swiglu(mul)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    act_name = "gelu_tanh" if form.startswith("gelu") else "silu"
    want = None if form.startswith("not") or form == "gelu-erf" else (placeholders[1], placeholders[0], act_name)
    assert found == want, (found, targets)


def _rms_norm(h, w, offset):
    """RMSNorm as transformers writes it: Llama's (w * normed.to(dtype)), Gemma's (1 + w)."""
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * (1.0 + w.float())).type_as(h) if offset else w * normed.to(h.dtype)


def _decoder(offset, h, lm, fw, *layers):
    """Two pre-norm decoder layers (residual stream, RMSNorm, q/k/v, a stand-in for
    attention, o, RMSNorm, SwiGLU MLP) and the final norm and LM head."""
    import torch.nn.functional as F

    for nw1, wq, wk, wv, wo, nw2, wg, wu, wd in (layers[:9], layers[9:]):
        x = _rms_norm(h, nw1, offset)
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        h = h + F.linear(q * torch.sigmoid(k.mean(-1, keepdim=True)) + v.mean(-1, keepdim=True), wo)
        x = _rms_norm(h, nw2, offset)
        h = h + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    return F.linear(_rms_norm(h, fw, offset), lm)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("offset", [False, True], ids=["llama-norm", "gemma-norm"])
def test_linear_pass_takes_in_norms_and_residual_adds(rows, offset, device):
    """A decoder's graph through Inductor's decompositions: each RMSNorm before a launch is
    computed in it, each residual add after a one-weight launch in its epilogue, the SwiGLU
    product in the down projection; what is left computes what the graph did, as near to
    float64 as the graph itself."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphrt.capture.linear_pass import group_small_linears

    seed = fresh_seed()
    _, gen = rngs(seed)
    hidden, heads, inter, vocab = 64, 16, 96, 100
    layer = [(hidden,), (hidden, hidden), (heads, hidden), (heads, hidden), (hidden, hidden), (hidden,),
             (inter, hidden), (inter, hidden), (hidden, inter)]
    shapes = [(vocab, hidden), (hidden,)] + layer * 2
    args = [torch.randn(1, rows, hidden, generator=gen).to(device, torch.float16)]
    for sh in shapes:
        t = torch.randn(*sh, generator=gen) / (4 if len(sh) == 2 else 2)
        args.append((t + (0 if offset else 1) if len(sh) == 1 else t).to(device, torch.float16))
    table = {k: v for k, v in select_decomp_table().items() if k not in (torch.ops.aten.mm.default,)}
    gm = make_fx(lambda *a: _decoder(offset, *a), decomposition_table=table)(*args)
    gm.graph.eliminate_dead_code()
    want = gm(*args)
    replaced = group_small_linears(gm.graph, devices=(device.type,))
    gm.graph.lint()
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.graphrt.small_linear.default]
    count = {t: sum(n.target is t for n in gm.graph.nodes)
             for t in (torch.ops.aten.mm.default, torch.ops.aten.rsqrt.default, torch.ops.aten.add.Tensor)}
    # per call: weights, gated, normed, residual
    got = [(len(c.args[1]), c.args[4] is not None, c.args[5] is not None, c.args[8] is not None) for c in calls]
    if rows == 1:     # q/k/v (norm), o (+ residual), gate/up (norm), down (SwiGLU, + residual); the head (norm)
        assert got == [(3, False, True, False), (1, False, False, True), (2, False, True, False),
                       (1, True, False, True)] * 2 + [(1, False, True, False)], got
        assert (replaced, count[torch.ops.aten.mm.default], count[torch.ops.aten.rsqrt.default]) == (15, 0, 0)
    else:             # past one row the pass groups only: every norm and add stays, o, down and the
                      # narrow head with cuBLAS
        assert got == [(3, False, False, False), (2, False, False, False)] * 2, got
        assert (replaced, count[torch.ops.aten.mm.default], count[torch.ops.aten.rsqrt.default]) == (10, 5, 5)
    # against float64: within a few times the fp16 graph's own error (the fused kernels round
    # less often; which of the two lands nearer differs from seed to seed)
    exact = _decoder(offset, *[a.double() for a in args])
    own, fused = ((t.double() - exact).abs().max().item() for t in (want, gm(*args)))
    assert fused <= 3 * own + 3e-3 * exact.abs().max().item(), (fused, own, seed)
    # without its fusions the pass groups alone: every norm and add stays
    gm = make_fx(lambda *a: _decoder(offset, *a), decomposition_table=table)(*args)
    group_small_linears(gm.graph, devices=(device.type,), fusions=False)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.graphrt.small_linear.default]
    assert calls and all(tuple(c.args[4:]) == (None, None, 1e-6, False, None, "silu") for c in calls), calls
    assert sum(n.target is torch.ops.aten.rsqrt.default for n in gm.graph.nodes) == 5


LAYER_CALLS = {   # per layer: (weights, gate activation or False, normed, residual) of each launch the pass makes
    ("llama", 1): [(3, False, True, False), (1, False, False, True), (2, False, True, False), (1, "silu", False, True)],
    ("llama", 8): [(3, False, False, False), (2, False, False, False)],     # past one row: groups only
    # Gemma 3: its norms after attention and the MLP sit between o / down and the residual
    # add: the norms before q/k/v and gate/up and the GeGLU product go in, not the adds
    ("gemma3", 1): [(3, False, True, False), (1, False, False, False), (2, False, True, False),
                    (1, "gelu_tanh", False, False)],
    ("gemma3", 8): [(3, False, False, False), (2, False, False, False)],
    # Phi-3: q/k/v and gate/up each one fused weight (one narrow launch: cuBLAS at 8 rows); its
    # down projection reads the two halves of the gate/up output where they lie
    ("phi3", 1): [(1, False, True, False), (1, False, False, True), (1, False, True, False), (1, "silu", False, True)],
    ("phi3", 8): [],
}


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_linear_pass_on_transformers_decoders(family, rows, device):
    """The pass on the forward graph AOTAutograd makes of a transformers decoder (fp16,
    Inductor's decompositions, the graph Inductor's post-grad passes start from): the
    launches it makes per layer (the LM head takes the final norm at one row), and logits
    as near to transformers' fp32 forward as transformers' own fp16 forward is."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from graphrt.capture.linear_pass import group_small_linears

    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
        cls = transformers.LlamaForCausalLM
    elif family == "phi3":
        cfg = transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=1)
        cls = transformers.Phi3ForCausalLM
    else:
        cfg = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            vocab_size=100, sliding_window=8)
        cls = transformers.Gemma3ForCausalLM
    seed = fresh_seed()
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    half = cls(cfg).eval()
    half.load_state_dict(model.state_dict())
    model, half = model.to(device), half.to(device, torch.float16)
    ids = torch.randint(0, 100, (1, rows)).to(device)
    calls = []

    def compiler(gm, example_inputs):
        group_small_linears(gm.graph, devices=(device.type,))
        gm.recompile()
        calls.extend((len(n.args[1]), n.args[4] is not None and n.args[9], n.args[5] is not None, n.args[8] is not None)
                     for n in gm.graph.nodes if n.target is torch.ops.graphrt.small_linear.default)
        return gm

    table = {k: v for k, v in select_decomp_table().items() if k is not torch.ops.aten.mm.default}
    torch._dynamo.reset()
    with torch.no_grad():
        exact = model(ids).logits.double()
        own = half(ids).logits
        fused = torch.compile(lambda i: half(i, use_cache=False).logits, fullgraph=True,
                              backend=aot_autograd(fw_compiler=compiler, decompositions=table))(ids)
    torch._dynamo.reset()
    head = [(1, False, True, False)] if rows == 1 else []      # at 8 rows the narrow head stays with cuBLAS
    assert calls == LAYER_CALLS[family, rows] * 2 + head, calls
    own_err, fused_err = ((t.double() - exact).abs().max().item() for t in (own, fused))
    assert fused_err <= 3 * own_err + 3e-3 * exact.abs().max().item(), (fused_err, own_err, seed)


def test_linear_pass_never_groups_across_a_write(device):
    """Two matmuls of one input with an in-place write to it in between (a graph that is not
    functional) stay two launches, each reading what it read before the rewrite."""
    from graphrt.capture.linear_pass import group_small_linears

    aten = torch.ops.aten
    seed = fresh_seed()
    _, gen = rngs(seed)
    vals = [torch.randn(*s, generator=gen).to(device, torch.float16) for s in ((1, 32), (24, 32), (40, 32))]
    g = torch.fx.Graph()
    x, w1, w2 = (g.placeholder(n) for n in ("x", "w1", "w2"))
    for node, v in zip((x, w1, w2), vals):
        node.meta["val"] = v
    a = g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (w1,))))
    g.call_function(aten.mul_.Tensor, (x, 2))
    b = g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (w2,))))
    g.output((a, b))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    want = gm(*[v.clone() for v in vals])
    assert group_small_linears(gm.graph, devices=(device.type,)) == 2
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.graphrt.small_linear.default]
    assert [len(c.args[1]) for c in calls] == [1, 1]
    for name, got, w in zip(("a", "b"), gm(*[v.clone() for v in vals]), want):
        assert_close(name, got, w.double(), 1e-2, 1e-2, seed)


def test_linear_pass_marks_only_unwritten_input_weights_constant(device):
    """The rewritten call says its weights are constant (a programmatic dependent launch may
    load them before the kernel before it finishes) only where each is a graph input that no
    node writes: not a weight the graph writes in place, not one it computes."""
    from graphrt.capture.linear_pass import group_small_linears

    aten = torch.ops.aten
    seed = fresh_seed()
    _, gen = rngs(seed)
    vals = [torch.randn(*s, generator=gen).to(device, torch.float16)
            for s in ((1, 32), (1, 32), (1, 32), (24, 32), (24, 32))]
    g = torch.fx.Graph()
    x1, x2, x3, w1, w2 = (g.placeholder(n) for n in ("x1", "x2", "x3", "w1", "w2"))
    for node, v in zip((x1, x2, x3, w1, w2), vals):
        node.meta["val"] = v
    g.call_function(aten.mul_.Tensor, (w2, 2))                  # the graph writes w2
    w3 = g.call_function(aten.mul.Tensor, (w1, 3))              # and computes w3
    w3.meta["val"] = vals[3] * 3
    outs = [g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (w,))))
            for x, w in ((x1, w1), (x2, w2), (x3, w3))]
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    want = gm(*[v.clone() for v in vals])
    assert group_small_linears(gm.graph, devices=(device.type,)) == 3
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.graphrt.small_linear.default]
    assert [c.args[3] for c in calls] == [True, False, False]
    for name, got, w in zip(("w1", "w2", "w3"), gm(*[v.clone() for v in vals]), want):
        assert_close(name, got, w.double(), 1e-2, 1e-2, seed)
    with pytest.raises(TypeError, match="constant_weights must be a bool"):
        from graphrt.kernels.linear import small_linear

        small_linear(vals[0], [vals[3]], constant_weights=1)



@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8], ids=["rows1", "rows8"])
def test_chained_launches_with_pdl_read_what_the_launch_before_wrote(rows):
    """A chain of small_linear launches as programmatic dependents in one CUDA graph, each
    loading its first weight tile before it waits (constant weights), each reading the
    output of the launch before, which lets it launch at its own start: every replay with
    fresh inputs gives the chain of float64 products (a launch that read its input before
    the one before had written it would give the last replay's values)."""
    from graphrt.kernels._checks import pdl_launches, pdl_supported

    dev = torch.device("cuda")
    if not pdl_supported(dev, True):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    seed = fresh_seed()
    _, gen = rngs(seed)
    width, depth = 1024, 6
    ws = [(torch.randn(width, width, generator=gen) / width ** 0.5).to(dev, torch.bfloat16) for _ in range(depth)]
    x = torch.zeros(rows, width, device=dev, dtype=torch.bfloat16)

    def chain():
        h = x
        for w in ws:
            h = small_linear(h, [w], constant_weights=True)[0]
        return h

    with pdl_launches(True):
        chain()                                           # compiles the variant outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(4):
        x.copy_(torch.randn(rows, width, generator=gen).to(dev, torch.bfloat16))
        graph.replay()
        want = x.double()
        for w in ws:
            want = (want @ w.double().T).to(torch.bfloat16).double()   # each launch rounds its output
        assert_close("chain", out, want, 5e-2, 5e-2, seed)
