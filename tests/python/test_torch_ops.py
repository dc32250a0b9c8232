"""The torch.library custom ops (flashattn::fwd, varlen_fwd, bwd, varlen_bwd): opcheck on each,
torch.compile(fullgraph=True) of models using the public functions (forward and backward)
against eager, the dropout seed under compile, the ops' outputs and fake shapes."""

import pytest
import torch

import flashattn
from flashattn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func)
from flashattn import _torch_ops  # noqa: F401  (registers the ops)


def _t(rng, *shape, dtype=torch.float32, grad=False):
    return torch.tensor(rng.standard_normal(shape), dtype=dtype).requires_grad_(grad)


def _seed():
    return torch.tensor([12345], dtype=torch.int64)


OPCHECK_DENSE = [
    # GQA, dv != d, sink with grad, alibi, causal, dropout with the probs output, fp32
    dict(dtype=torch.float32, shape=(2, 5, 7, 4, 2, 8, 6), alibi=True, sink=True, p=0.2,
         causal=True, window=(-1, -1), softcap=0.0, probs=True),
    # fp64 (lse kept in fp64), window, softcap, no dropout
    dict(dtype=torch.float64, shape=(1, 6, 6, 2, 1, 5, 5), alibi=False, sink=False, p=0.0,
         causal=False, window=(2, 1), softcap=2.0, probs=False),
]


@pytest.mark.parametrize("case", OPCHECK_DENSE, ids=["fp32-gqa-dropout", "fp64-window"])
def test_opcheck_fwd_and_bwd(rng, case):
    b, sq, sk, h, hk, d, dv = case["shape"]
    dt = case["dtype"]
    q = _t(rng, b, sq, h, d, dtype=dt, grad=True)
    k = _t(rng, b, sk, hk, d, dtype=dt, grad=True)
    v = _t(rng, b, sk, hk, dv, dtype=dt, grad=True)
    alibi = torch.rand(h) * 0.3 if case["alibi"] else None
    sink = _t(rng, h, grad=True) if case["sink"] else None
    args = (q, k, v, alibi, sink, _seed() if case["p"] > 0 else None, case["p"], None,
            case["causal"], case["window"][0], case["window"][1], case["softcap"],
            case["probs"], False)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args)

    out, lse, S, rng_state = torch.ops.flashattn.fwd(*args)
    assert out.shape == (b, sq, h, dv) and out.dtype == dt
    assert lse.shape == (b, h, sq) and lse.dtype == (torch.float64 if dt == torch.float64
                                                     else torch.float32)
    want_S = (b, h, 128, 128) if case["probs"] else (0,)
    assert tuple(S.shape) == want_S and S.dtype == dt
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    assert rng_state.tolist() == [12345 if case["p"] > 0 else 0, 0]

    dout = torch.randn_like(out)
    bargs = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, alibi,
             None if sink is None else sink.detach(), rng_state, case["p"], None,
             case["causal"], case["window"][0], case["window"][1], case["softcap"], False)
    torch.library.opcheck(torch.ops.flashattn.bwd.default, bargs)
    dq, dk, dv_, dsink = torch.ops.flashattn.bwd(*bargs)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
    assert dsink.dtype == torch.float32 and tuple(dsink.shape) == ((h,) if case["sink"] else (0,))


def test_opcheck_varlen_fwd_and_bwd(rng):
    h, hk, d, dv = 4, 2, 8, 5
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q = _t(rng, 9, h, d, grad=True)  # one row past cu_q[-1]
    k, v = _t(rng, 11, hk, d, grad=True), _t(rng, 11, hk, dv, grad=True)
    sink = _t(rng, h, grad=True)
    for p, probs in ((0.25, True), (0.0, False)):
        args = (q, k, v, cu_q, cu_k, None, None, sink, _seed() if p else None, 5, 5, p, 0.4,
                True, -1, -1, 0.0, probs, False)
        torch.library.opcheck(torch.ops.flashattn.varlen_fwd.default, args)
    out, lse, S, rng_state = torch.ops.flashattn.varlen_fwd(*args)
    assert out.shape == (9, h, dv) and lse.shape == (h, 9) and S.shape == (0,)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q,
             cu_k, None, None, sink.detach(), rng_state, 5, 5, 0.0, 0.4, True, -1, -1, 0.0,
             False)
    torch.library.opcheck(torch.ops.flashattn.varlen_bwd.default, bargs)


def test_fp64_lse_internal_fp32_public(rng):
    """The op keeps an fp64 lse for fp64 inputs (exact gradients); the public functions return
    upstream's fp32."""
    q = _t(rng, 1, 4, 2, 8, dtype=torch.float64)
    _, lse, _, _ = torch.ops.flashattn.fwd(q, q, q, None, None, None, 0.0, None, False, -1, -1,
                                           0.0, False, False)
    assert lse.dtype == torch.float64
    _, lse32, _ = flash_attn_func(q, q, q, return_attn_probs=True)
    assert lse32.dtype == torch.float32 and torch.equal(lse32, lse.float())


def test_meta_tensors_are_refused_not_faked():
    m = torch.empty(1, 4, 2, 8, device="meta")
    with pytest.raises(flashattn.FlashAttnError, match="^q: tensors on device 'meta'"):
        flash_attn_func(m, m, m)


class _Block(torch.nn.Module):
    """A small attention block: projections, GQA flash attention with a learnable sink, output
    projection."""

    def __init__(self, dim=32, heads=4, heads_kv=2):
        super().__init__()
        self.h, self.hk, self.d = heads, heads_kv, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * heads_kv) * self.d)
        self.out = torch.nn.Linear(dim, dim)
        self.sink = torch.nn.Parameter(torch.randn(heads))

    def forward(self, x, dropout_p=0.0):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, self.h + 2 * self.hk, self.d)
        q, k, v = qkv.split([self.h, self.hk, self.hk], dim=2)
        y = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True, window_size=(6, -1),
                            learnable_sink=self.sink)
        return self.out(y.reshape(b, n, -1))


def _grads(model, loss):
    return torch.autograd.grad(loss, [p for p in model.parameters()])


def _compare(eager_out, comp_out, eager_grads, comp_grads, tol):
    assert (eager_out - comp_out).abs().max().item() <= tol
    for a, b in zip(eager_grads, comp_grads):
        assert (a - b).abs().max().item() <= tol


def test_compile_inductor_fullgraph_forward_backward(rng):
    """The default backend (Inductor): the flashattn ops stay opaque nodes between generated
    kernels; the result and every parameter gradient match eager."""
    model = _Block()
    x = _t(rng, 2, 11, 32)
    compiled = torch.compile(model, fullgraph=True)
    ye, yc = model(x), compiled(x)
    dy = torch.randn_like(ye)
    _compare(ye, yc, _grads(model, (ye * dy).sum()), _grads(model, (yc * dy).sum()), 1e-5)


def test_compile_fullgraph_varlen_packed_kvpacked(rng):
    """Every op through AOT autograd (aot_eager backend: the graphs are traced with the fake
    implementations and the autograd formulas, then run eagerly), fullgraph."""
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)

    def f(qkv, q, kv, qkv_var):
        a = flash_attn_qkvpacked_func(qkv, causal=True)
        b = flash_attn_kvpacked_func(q, kv, window_size=(2, 2))
        c = flash_attn_varlen_qkvpacked_func(qkv_var, cu, 5, causal=True)
        d = flash_attn_varlen_func(qkv_var[:, 0], qkv_var[:, 1], qkv_var[:, 2], cu, cu, 5, 5)
        return a.sum() + b.sum() + (c * c).sum() + (d * c).sum()

    inputs = [_t(rng, 2, 6, 3, 2, 8, grad=True), _t(rng, 2, 5, 4, 8, grad=True),
              _t(rng, 2, 7, 2, 2, 8, grad=True), _t(rng, 9, 3, 2, 8, grad=True)]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    le, lc = f(*inputs), compiled(*inputs)
    ge, gc = torch.autograd.grad(le, inputs), torch.autograd.grad(lc, inputs)
    _compare(le, lc, ge, gc, 1e-5)


def test_compile_dropout_seed_comes_from_default_generator(rng):
    """The seed is drawn outside the op from torch's default generator: under compile,
    torch.manual_seed reproduces a run, and with random ops run eagerly (aot_eager) the
    compiled model draws exactly what eager draws."""
    model = _Block()
    x = _t(rng, 2, 9, 32)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    a = compiled(x, 0.3)
    torch.manual_seed(3)
    b = compiled(x, 0.3)
    c = compiled(x, 0.3)
    torch.manual_seed(3)
    e = model(x, 0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, e)


def test_opcheck_kvcache(rng):
    """flashattn::kvcache mutates the caches (the append) and returns (out, lse)."""
    b, s_cache, h, hk, d = 2, 20, 4, 2, 8
    q = _t(rng, b, 3, h, d)
    k_cache, v_cache = _t(rng, b, s_cache, hk, d), _t(rng, b, s_cache, hk, d)
    k_new, v_new = _t(rng, b, 3, hk, d), _t(rng, b, 3, hk, d)
    seqlens = torch.tensor([5, 11], dtype=torch.int32)
    cos = torch.cos(_t(rng, s_cache, d // 2))
    sin = torch.sin(_t(rng, s_cache, d // 2))
    sink = _t(rng, h)
    args = (q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, None, None, None, None, sink,
            None, True, -1, -1, 0.0, False, 0)
    torch.library.opcheck(torch.ops.flashattn.kvcache.default, args)


def test_compile_fullgraph_kvcache_decode_step(rng):
    """A decoding step (append with rotary, attend) compiles without graph breaks, matches eager
    and appends to the caller's cache in both."""
    b, s_cache, h, hk, d = 2, 16, 4, 2, 8
    q = _t(rng, b, 1, h, d)
    k_new, v_new = _t(rng, b, 1, hk, d), _t(rng, b, 1, hk, d)
    cos = torch.cos(_t(rng, s_cache, d // 2))
    sin = torch.sin(_t(rng, s_cache, d // 2))
    caches = [(_t(rng, b, s_cache, hk, d), _t(rng, b, s_cache, hk, d))]
    caches.append(tuple(c.clone() for c in caches[0]))

    def step(q, kc, vc, k, v):
        return flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos,
                                                 rotary_sin=sin, cache_seqlens=7, causal=True)

    eager = step(q, *caches[0], k_new, v_new)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(
        q, *caches[1], k_new, v_new)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, c in zip(caches[0], caches[1]):
        assert torch.equal(a, c)
    assert not torch.equal(caches[0][1][:, 7], torch.zeros_like(caches[0][1][:, 7]))
    torch.testing.assert_close(caches[0][1][:, 7], v_new[:, 0], rtol=0, atol=0)
