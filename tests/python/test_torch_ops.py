"""The torch.library custom ops (flashattn::fwd, varlen_fwd, bwd, varlen_bwd): opcheck on each,
torch.compile(fullgraph=True) of models using the public functions (forward and backward)
against eager, the dropout seed under compile, the ops' outputs and fake shapes."""

import numpy as np
import pytest
import torch

import flashattn
from flashattn import _arrays
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


def test_opcheck_varlen_fwd_paged_and_compile(rng):
    """flashattn::varlen_fwd_paged (paged k and v read in place, forward only): opcheck, and
    flash_attn_varlen_func with block_table under torch.compile(fullgraph) without gradients
    gives the eager result."""
    from flashattn import flash_attn_varlen_func

    h, hk, d, dv, page = 4, 2, 8, 5, 3
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    table = torch.tensor([[4, 0, 7], [2, 9, 9], [1, 6, 3]], dtype=torch.int32)
    q = _t(rng, 9, h, d)
    k, v = _t(rng, 8, page, hk, d), _t(rng, 8, page, hk, dv)
    sink = _t(rng, h)
    for p, probs in ((0.25, True), (0.0, False)):
        args = (q, k, v, cu_q, cu_k, None, table, None, sink, _seed() if p else None, 5, 5, p,
                0.4, True, -1, -1, 0.0, probs)
        torch.library.opcheck(torch.ops.flashattn.varlen_fwd_paged.default, args)
    out, lse, S, _ = torch.ops.flashattn.varlen_fwd_paged(*args)
    assert out.shape == (9, h, dv) and lse.shape == (h, 9) and S.shape == (0,)

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, block_table=table)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=0, atol=0)


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


def _fp8_decode_case(rng):
    """A decoding step's inputs with e4m3 caches and their descales: (q, k_cache, v_cache, k,
    v, cache_seqlens, k_descale, v_descale)."""
    b, s_cache, h, hk, d = 2, 16, 4, 2, 16
    q = _t(rng, b, 1, h, d).bfloat16()
    k_new, v_new = _t(rng, b, 1, hk, d).bfloat16(), _t(rng, b, 1, hk, d).bfloat16()
    caches = [_t(rng, b, s_cache, hk, d).to(torch.float8_e4m3fn) for _ in range(2)]
    descales = [_t(rng, b, hk).abs() + 0.25 for _ in range(2)]
    lens = torch.tensor([3, 11], dtype=torch.int32)
    return (q, *caches, k_new, v_new, lens, *descales)


def test_opcheck_kvcache_fp8(rng):
    """flashattn::kvcache with fp8 caches and descales: its fake implementation and AOT
    dispatch. (opcheck's test_schema compares the inputs before and after with arithmetic torch
    lacks for fp8 on the CPU; test_opcheck_kvcache checks the declared mutation.)"""
    q, kc, vc, k_new, v_new, lens, kd, vd = _fp8_decode_case(rng)
    args = (q, kc, vc, k_new, v_new, None, None, lens, None, None, None, None, None, None, True,
            -1, -1, 0.0, False, 0, kd, vd)
    torch.library.opcheck(torch.ops.flashattn.kvcache.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic",
                                      "test_autograd_registration"))


def test_compile_fullgraph_kvcache_fp8(rng):
    """fp8 caches with descales compile as one flashattn::kvcache node, fullgraph: the output
    and the appended codes equal eager's, bit for bit."""
    q, kc, vc, k_new, v_new, lens, kd, vd = _fp8_decode_case(rng)

    def step(q, kc, vc, k, v, kd, vd):
        return flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                 causal=True, k_descale=kd, v_descale=vd)

    caches = (kc.clone(), vc.clone())
    eager = step(q, kc, vc, k_new, v_new, kd, vd)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(
        q, *caches, k_new, v_new, kd, vd)
    assert torch.equal(compiled, eager) and torch.isfinite(eager).all()
    for a, c in zip((kc, vc), caches):
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    want = (v_new[:, 0].float() / vd[:, :, None]).to(torch.float8_e4m3fn)
    assert torch.equal(vc[torch.arange(2), lens.long()].view(torch.uint8),
                       want.view(torch.uint8))


# --------------------------------------------------------------------------------------------
# Eager calls run the ops' kernels and formulas directly; anything that could observe the
# difference gets the ops.


def _dense_case(rng, dtype=torch.float32):
    q = _t(rng, 2, 9, 4, 8, dtype=dtype, grad=True)
    k = _t(rng, 2, 13, 2, 8, dtype=dtype, grad=True)
    v = _t(rng, 2, 13, 2, 6, dtype=dtype, grad=True)
    sink = _t(rng, 4, grad=True)
    return q, k, v, sink


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_eager_path_equals_the_ops(rng, monkeypatch, p):
    """Outputs and every gradient bitwise equal through the ops (forced) and directly, dense and
    varlen, with dropout replayed from the same seed."""
    q, k, v, sink = _dense_case(rng)
    dout = torch.randn(2, 9, 4, 6)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    qv, kv, vv = (_t(rng, *s, grad=True) for s in ((9, 4, 8), (13, 2, 8), (13, 2, 6)))

    def run():
        torch.manual_seed(7)
        out = flash_attn_func(q, k, v, dropout_p=p, causal=True, learnable_sink=sink)
        outv = flash_attn_varlen_func(qv, kv, vv, cu, cu_k, 5, 7, dropout_p=p,
                                      window_size=(3, 1), learnable_sink=sink)
        loss = (out * dout).sum() + (outv * outv).sum()
        return [out, outv] + list(torch.autograd.grad(loss, (q, k, v, sink, qv, kv, vv)))

    direct = run()
    monkeypatch.setattr(_torch_ops, "is_eager", lambda tensors: False)
    via_ops = run()
    assert not torch.equal(direct[0], torch.zeros_like(direct[0]))
    for a, b in zip(direct, via_ops):
        assert torch.equal(a, b)


def test_modes_and_subclasses_see_the_ops(rng):
    """A dispatch mode (what tracing, FlopCounter and the like rely on) sees flashattn::fwd and
    flashattn::bwd, and a tensor subclass's __torch_function__ sees the op call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v, _ = _dense_case(rng)
    with Record():
        out = flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
    assert "flashattn.fwd.default" in seen and "flashattn.bwd.default" in seen
    assert q.grad is not None and torch.isfinite(q.grad).all()

    calls = []

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    qs = q.detach().as_subclass(Spy)
    got = flash_attn_func(qs, k.detach(), v.detach(), causal=True)
    assert torch.ops.flashattn.fwd in calls
    assert torch.equal(got.as_subclass(torch.Tensor), out.detach())


def test_double_backward_is_refused_not_silently_zero(rng):
    """The backward has no formula of its own: with create_graph, differentiating the gradients
    raises (through the op) instead of treating them as constants."""
    q, k, v, _ = _dense_case(rng)
    out = flash_attn_func(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="flashattn"):
        torch.autograd.grad(gq.sum(), (k,))


def test_signature_cache_swaps_data_not_results(rng):
    """Calls that share a signature reuse one prepared call: every result is still its own
    inputs' (against the uncached path), also after a call whose input needed a copy, and with
    threads sharing signatures (the library runs without the GIL)."""
    import threading

    from flashattn import _cached, _core

    def inputs():
        return [_t(rng, 1, 7, 2, 16) for _ in range(3)]

    def uncached(q, k, v):
        out, lse, _ = _core.forward(q, k, v, kind=_arrays.TORCH, causal=True, out=None,
                                    lse=torch.empty(1, 2, 7))
        return out, lse

    sets = [inputs() for _ in range(6)]
    for q, k, v in sets:
        out, lse = _cached.forward_dense_torch(q, k, v, 0.0, None, True, (-1, -1), 0.0, 0)
        want_out, want_lse = uncached(q, k, v)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    q, k, v = sets[0]
    strided = torch.randn(1, 7, 2, 32)[..., ::2]  # last dim not contiguous: copied
    out, _ = _cached.forward_dense_torch(strided, k, v, 0.0, None, True, (-1, -1), 0.0, 0)
    assert torch.equal(out, uncached(strided.contiguous(), k, v)[0])
    out, _ = _cached.forward_dense_torch(q, k, v, 0.0, None, True, (-1, -1), 0.0, 0)
    assert torch.equal(out, uncached(q, k, v)[0])
    # q dense but permuted (heads outermost): out keeps the library's own [b, s, h, d] layout on
    # the cached call too (torch.empty_like(q) would copy q's order), with and without lse.
    for want_lse in (True, False):
        for _ in range(2):
            qp = _t(rng, 1, 2, 7, 16).transpose(1, 2)
            out, _ = _cached.forward_dense_torch(qp, k, v, 0.0, None, True, (-1, -1), 0.0, 0,
                                               want_lse=want_lse)
            assert out.is_contiguous() and torch.equal(out, uncached(qp, k, v)[0])

    want = [uncached(*s)[0] for s in sets]
    errors = []

    def worker(order):
        try:
            for _ in range(20):
                for i in order:
                    got = flash_attn_func(*sets[i], causal=True)
                    if not torch.equal(got, want[i]):
                        errors.append(i)
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(list(range(6))[::step],))
               for step in (1, -1, 2, -2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


_BWD_CASES = {
    "plain": dict(),
    "gqa, strided q, causal, bf16": dict(hk=2, strided=True, causal=True, dtype=torch.bfloat16),
    "window, softcap, scale, deterministic": dict(window=(3, 1), softcap=4.0, scale=0.3,
                                                  deterministic=True),
    "dropout": dict(dropout=0.2),
}


@pytest.mark.parametrize("case", list(_BWD_CASES))
def test_backward_signature_cache_swaps_data_not_results(rng, monkeypatch, case):
    """Backward calls that share a signature reuse one prepared call
    (``_cached.backward_dense_torch``): each call's gradients are its own inputs' (bitwise
    against the uncached ``_core.backward``), dropout replays each call's own seed, and only
    the first call of the signature is prepared."""
    from flashattn import _cached, _core

    o = _BWD_CASES[case]
    dtype, hk = o.get("dtype", torch.float32), o.get("hk", 4)
    opts = dict(dropout_p=o.get("dropout", 0.0), softmax_scale=o.get("scale"),
                causal=o.get("causal", False), window_size=o.get("window", (-1, -1)),
                softcap=o.get("softcap", 0.0))
    monkeypatch.setattr(_cached._LOCAL, "calls", {}, raising=False)
    prepared = []
    real = _cached.run_backward

    def spy(*args):
        prepared.append(1)
        return real(*args)

    monkeypatch.setattr(_cached, "run_backward", spy)
    for call in range(3):
        seed = 1000 + call if opts["dropout_p"] else 0
        if o.get("strided"):
            q = _t(rng, 2, 9, 6, 40).to(dtype)[:, :, 1:5, 4:28]
        else:
            q = _t(rng, 2, 9, 4, 24).to(dtype)
        k, v = (_t(rng, 2, 11, hk, 24).to(dtype) for _ in range(2))
        out, lse, _ = _core.forward(q, k, v, kind=_arrays.TORCH, seed=seed, **opts)
        dout = _t(rng, 2, 9, 4, 24).to(dtype)
        got = _cached.backward_dense_torch(
            dout, q, k, v, out, lse, opts["dropout_p"], opts["softmax_scale"], opts["causal"],
            tuple(opts["window_size"]), opts["softcap"], seed, 0,
            o.get("deterministic", False))
        want = _core.backward(dout, q, k, v, out, lse, kind=_arrays.TORCH, seed=seed,
                              deterministic=o.get("deterministic", False), **opts)[:3]
        for g, w, x in zip(got, want, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype and g.is_contiguous()
            assert torch.isfinite(g).all() and g.abs().sum() > 0
            assert torch.equal(g, w), (case, call)
    assert len(prepared) == 1


def test_cached_call_survives_a_reentrant_call(rng, monkeypatch):
    """An allocation inside a cached call can run Python (a finalizer) that makes a call of the
    same signature on the same thread, which writes the same prepared arguments: each call
    still returns its own inputs' results."""
    from flashattn import _cached, _core

    monkeypatch.setattr(_cached._LOCAL, "calls", {}, raising=False)
    monkeypatch.setattr(_cached, "_DENSE_LSE", None)  # the Python path (C's does the same)
    a, b = ([_t(rng, 1, 7, 2, 16) for _ in range(3)] for _ in range(2))
    options = (0.0, None, True, (-1, -1), 0.0, 0)
    _cached.forward_dense_torch(*a, *options)  # prepares the signature
    real, nested = torch.empty_like, []

    def empty_like(x, *args, **kwargs):
        if not nested and all(st == 0 for st in x.stride()):  # the lse template
            nested.append(None)  # one nested call, not a nested one's nested call
            nested[0] = _cached.forward_dense_torch(*b, *options)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", empty_like)
    out, lse = _cached.forward_dense_torch(*a, *options)
    monkeypatch.setattr(torch, "empty_like", real)
    assert len(nested) == 1
    for got, inputs in (((out, lse), a), (nested[0], b)):
        want = _core.forward(*inputs, kind=_arrays.TORCH, causal=True)[:2]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fast_path_equals_the_general_path(rng, monkeypatch, dtype):
    """flash_attn_func's one-step path (plain tensors, no dropout, ALiBi, sinks or probs)
    gives bitwise the general path's out over the options it takes (Python ints and floats
    alike), without gradients writes no lse, with them gives the general path's gradients, and
    leaves every other call to the general path. A signature's first call prepares it in Python
    (the route, _torch_ops.dense), every later one runs in C (_fastpath)."""
    from flashattn import _cached, _route

    # Python's preparation: forward_dense_torch, with or without the lse; the route: dense.
    taken, routed = [], []
    real, real_dense = _cached.forward_dense_torch, _torch_ops.dense

    def spy(*args, **kwargs):
        taken.append(kwargs.get("want_lse", True))
        return real(*args, **kwargs)

    def dense_spy(*args, **kwargs):
        routed.append(True)
        return real_dense(*args, **kwargs)

    def in_c():  # served in C: neither the route nor the preparation ran
        return taken == [] and routed == []

    monkeypatch.setattr(_cached, "forward_dense_torch", spy)
    monkeypatch.setattr(_torch_ops, "dense", dense_spy)
    q, k, v = (_t(rng, 2, s, h, 16, dtype=dtype) for s, h in ((11, 4), (19, 2), (19, 2)))
    options = [dict(), dict(causal=True), dict(window_size=(4, 2), softmax_scale=0.3),
               dict(softcap=3, dropout_p=0, softmax_scale=1), dict(window_size=(-5, 7)),
               dict(causal=True, softcap=2.5, window_size=(2**40, 3))]
    flash_attn_func(q, k, v)  # the first torch call of a process loads the ops
    assert _route.DENSE_C is not None, "the C fast path (_fastpath.c) was not built"
    for kw in options:
        taken.clear()
        routed.clear()
        fast = flash_attn_func(q, k, v, **kw)
        assert in_c() or taken == [False], kw
        taken.clear()
        routed.clear()
        again = flash_attn_func(q, k, v, **kw)
        assert torch.equal(again, fast) and in_c(), kw
        general, _, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        assert taken == [True], kw
        assert not torch.equal(fast, torch.zeros_like(fast)) and torch.equal(fast, general), kw
    taken.clear()
    flash_attn_func(q, k, v, causal=1)  # not a bool nor a float: the route's one step
    flash_attn_func(q, k, v, softmax_scale=np.float32(0.2))
    assert taken == [False, False]
    q.requires_grad_(), v.requires_grad_()
    kw = dict(causal=True, window_size=(6, 1), softcap=4.0, deterministic=True)
    dout = torch.randn(2, 11, 4, 16).to(dtype)
    grads = []
    for probs in (False, True):
        routed.clear()
        out = flash_attn_func(q, k, v, return_attn_probs=probs, **kw)
        # the one-step path: C hands the call to _DenseFastFn, the route never runs
        assert (routed == []) == (not probs)
        out = out[0] if probs else out
        grads.append([out] + list(torch.autograd.grad(out, (q, v), dout)))
    for fast, general in zip(*grads):
        assert not torch.equal(fast, torch.zeros_like(fast)) and torch.equal(fast, general)
    with torch.no_grad():
        flash_attn_func(q, k, v)  # prepared (again, if the bounded cache dropped it)
        taken.clear()
        routed.clear()
        flash_attn_func(q, k, v)
    assert in_c()
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(1, "a"))


# --------------------------------------------------------------------------------------------
# flashattn::combine


def _combine_inputs(rng, s=4, b=2, sq=3, h=2, d=8, dtype=torch.float32):
    op = _t(rng, s, b, sq, h, d, dtype=dtype)
    lp = _t(rng, s, b, sq, h, dtype=dtype) * 3
    lp[0, 0, 0, 0] = float("inf")      # empty part (a row that saw no key)
    lp[1, 0, 1, 1] = float("-inf")     # empty part
    lp[:, 1, 2, 0] = float("-inf")     # a row with no part at all
    op[0, 0, 0, 0] = float("nan")      # an empty part's output is never read
    return op, lp


def test_opcheck_combine(rng):
    op, lp = _combine_inputs(rng)
    merged = torch.empty(2, 3, 2, 8, dtype=torch.float16)
    torch.library.opcheck(torch.ops.flashattn.combine.default, (op, lp, merged))
    lse = torch.ops.flashattn.combine(op, lp, merged)
    assert lse.shape == (2, 3, 2) and lse.stride() == (6, 1, 3)
    out, want_lse = flashattn.flash_attn_combine(op, lp, out_dtype=torch.float16)
    assert torch.equal(merged, out) and torch.equal(lse, want_lse)


def test_compile_fullgraph_combine(rng):
    op, lp = _combine_inputs(rng)

    def f(op, lp):
        out, lse = flashattn.flash_attn_combine(op * 2, lp)
        return out.sum(-1) + lse

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(op, lp)
    assert torch.equal(got, f(op, lp))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_combine_torch_merge_matches_the_library(rng, dtype):
    """The torch merge CUDA tensors fall back to (the library's combine has no CUDA backend
    yet), on CPU tensors against the library: empty parts of either sign, a row with no part,
    a NaN lse (its row is NaN), fp16 output."""
    from flashattn import _kvcache

    op, lp = _combine_inputs(rng, s=5, b=3, sq=4, h=3, d=16, dtype=dtype)
    lp[2, 2, 3, 1] = float("nan")
    for out_dtype in (dtype, torch.float16):
        want, want_lse = flashattn.flash_attn_combine(op, lp, out_dtype=out_dtype)
        out = torch.empty_like(want)
        lse = torch.empty_strided(want_lse.shape, want_lse.stride(), dtype=dtype)
        _kvcache._combine_torch(op, lp, out, lse)
        nan = torch.isnan(want)
        assert nan.any() and torch.equal(nan, torch.isnan(out))
        tol = 1e-3 if out_dtype == torch.float16 else 1e-6
        torch.testing.assert_close(out[~nan], want[~nan], rtol=tol, atol=tol)
        assert torch.equal(out[1, 2, 0], torch.zeros_like(out[1, 2, 0]))
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=0, equal_nan=True)
        assert lse[1, 2, 0] == float("-inf")
