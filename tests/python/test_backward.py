"""Gradients through torch autograd: gradcheck in fp64 per feature, comparison against a
differentiable float64 torch reference (every feature, dense and varlen, GQA, dv != d),
upstream's criterion for fp16/bf16 (3x the same-dtype naive error), dropout masks shared by the
forward and the backward, and bitwise reproducibility across thread counts."""

import numpy as np
import pytest
import torch

from flashattn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func)


def torch_ref(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
              sink=None, keep=None, dropout_p=0.0):
    """Differentiable dense attention in the inputs' dtype. q [b,sq,h,d], k/v [b,sk,hk,*];
    alibi [h] or [b,h]; sink [h]; keep bool [b,h,sq,sk] (dropout mask)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hk, 2)
    v = v.repeat_interleave(h // hk, 2)
    scale = d ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    if alibi is not None:
        a = alibi.to(s.dtype)
        a = a[None, :, None, None] if a.dim() == 1 else a[:, :, None, None]
        s = s - a * (diag - j).abs().to(s.dtype)
    left, right = window
    if causal:
        right = 0
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    s = s.masked_fill(~vis, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype)[None, :, None, None].expand(b, h, sq, 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :-1]
    if keep is not None:
        p = p * keep.to(p.dtype) / (1 - dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


FEATURES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 1)),
    dict(window=(-1, 2)),
    dict(softcap=1.5),
    dict(alibi="h"),
    dict(alibi="bh"),
    dict(sink=True),
    dict(scale=0.37),
    dict(causal=True, window=(4, -1), alibi="h", sink=True),
    dict(softcap=3.0, window=(5, 5), sink=True),
]


def _inputs(rng, b, sq, sk, h, hk, d, dv, dtype, feat, grad_sink=True):
    mk = lambda *s: torch.tensor(rng.standard_normal(s), dtype=dtype).requires_grad_()
    q, k, v = mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, dv)
    alibi = None
    if feat.get("alibi") == "h":
        alibi = torch.tensor(rng.uniform(0.05, 0.5, h), dtype=torch.float32)
    elif feat.get("alibi") == "bh":
        alibi = torch.tensor(rng.uniform(0.05, 0.5, (b, h)), dtype=torch.float32)
    sink = None
    if feat.get("sink"):
        sink = torch.tensor(rng.standard_normal(h), dtype=torch.float32)
        sink.requires_grad_(grad_sink)
    return q, k, v, alibi, sink


def _kwargs(feat, alibi, sink):
    return dict(softmax_scale=feat.get("scale"), causal=feat.get("causal", False),
                window_size=feat.get("window", (-1, -1)), softcap=feat.get("softcap", 0.0),
                alibi_slopes=alibi, learnable_sink=sink)


def _ref_kwargs(feat, alibi, sink):
    return dict(scale=feat.get("scale"), causal=feat.get("causal", False),
                window=feat.get("window", (-1, -1)), softcap=feat.get("softcap", 0.0),
                alibi=alibi, sink=sink)


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: ",".join(map(str, f.items())) or "plain")
def test_gradcheck_fp64(rng, feat):
    """Finite differences against the analytic dq, dk, dv (the sink, an fp32 parameter in the C
    API, is held fixed here and checked by test_sink_gradient_finite_differences)."""
    q, k, v, alibi, sink = _inputs(rng, 2, 5, 7, 4, 2, 6, 5, torch.float64, feat,
                                   grad_sink=False)
    kw = _kwargs(feat, alibi, sink)

    def f(q, k, v):
        return flash_attn_func(q, k, v, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("varlen", [False, True])
def test_sink_gradient_finite_differences(rng, varlen):
    """d loss / d sink by central differences with steps exact in fp32 (the sinks' dtype)."""
    h = 4
    mk = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float64)
    sink = torch.tensor(rng.standard_normal(h), dtype=torch.float32)
    if varlen:
        cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
        q, k, v = mk(9, h, 6), mk(9, 2, 6), mk(9, 2, 5)
        run = lambda s: flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True,
                                               learnable_sink=s)
    else:
        q, k, v = mk(2, 5, h, 6), mk(2, 8, 2, 6), mk(2, 8, 2, 5)
        run = lambda s: flash_attn_func(q, k, v, window_size=(2, 1), learnable_sink=s)
    w = mk(*run(sink).shape)
    s = sink.clone().requires_grad_()
    (g,) = torch.autograd.grad((run(s) * w).sum(), (s,))
    step = 2.0 ** -10
    for i in range(h):
        up, down = sink.clone(), sink.clone()
        up[i] += step
        down[i] -= step
        fd = ((run(up) * w).sum() - (run(down) * w).sum()).item() / (2 * step)
        assert abs(fd - g[i].item()) <= 1e-5 * max(1.0, abs(fd)), (i, fd, g[i].item())


def test_gradcheck_varlen_fp64(rng):
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    cuk = torch.tensor([0, 4, 6, 6, 11], dtype=torch.int32)
    mk = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float64).requires_grad_()
    q, k, v = mk(10, 4, 5), mk(12, 2, 5), mk(12, 2, 3)
    sink = torch.tensor(rng.standard_normal(4), dtype=torch.float32)

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cuk, 5, 5, causal=True, window_size=(2, -1),
                                      learnable_sink=sink)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, [x for x in inputs if x is not None and x.requires_grad],
                               dout)


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: ",".join(map(str, f.items())) or "plain")
@pytest.mark.parametrize("shape", [(2, 70, 45, 4, 1, 33, 20), (1, 40, 130, 8, 2, 64, 64),
                                   (3, 1, 9, 2, 2, 7, 7)])
def test_grads_fp32_vs_reference(rng, feat, shape):
    b, sq, sk, h, hk, d, dv = shape
    q, k, v, alibi, sink = _inputs(rng, b, sq, sk, h, hk, d, dv, torch.float32, feat)
    out = flash_attn_func(q, k, v, **_kwargs(feat, alibi, sink))
    dout = torch.randn_like(out)
    got = _grads(out, (q, k, v, sink), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    s64 = sink.detach().double().requires_grad_() if sink is not None else None
    ref = torch_ref(q64, k64, v64, **_ref_kwargs(feat, alibi, s64))
    want = _grads(ref, (q64, k64, v64, s64), dout.double())
    for name, g, w in zip("q k v sink".split(), got, want):
        err = (g.double() - w).abs().max().item()
        assert err <= 1e-4 * max(1.0, w.abs().max().item()), (name, err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("feat", [dict(), dict(causal=True, alibi="h"), dict(softcap=2.0),
                                  dict(window=(20, 3), sink=True)],
                         ids=lambda f: ",".join(map(str, f.items())) or "plain")
def test_grads_lowp_criterion(rng, dtype, feat):
    """Upstream's criterion: each gradient's max error against the fp64 reference is at most 3x
    the error of naive attention computed in the same low dtype (plus a rounding floor)."""
    b, sq, sk, h, hk, d = 2, 96, 80, 4, 2, 64
    q, k, v, alibi, sink = _inputs(rng, b, sq, sk, h, hk, d, d, dtype, feat, grad_sink=False)
    out = flash_attn_func(q, k, v, **_kwargs(feat, alibi, sink))
    dout = torch.randn_like(out)
    got = _grads(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch_ref(q64, k64, v64, **_ref_kwargs(feat, alibi, sink))
    want = _grads(ref, (q64, k64, v64), dout.double())
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))
    naive = torch_ref(ql, kl, vl, **_ref_kwargs(feat, alibi, sink))
    base = _grads(naive, (ql, kl, vl), dout)
    eps = torch.finfo(dtype).eps
    for name, g, w, n in zip("qkv", got, want, base):
        err = (g.double() - w).abs().max().item()
        naive_err = (n.double() - w).abs().max().item()
        floor = eps * w.abs().max().item()
        assert err <= 3 * naive_err + floor, (name, err, naive_err)


def test_varlen_grads_match_dense_per_sequence(rng):
    """Varlen gradients equal the dense gradients of each sequence on its own; rows outside every
    sequence get zero gradients; zero-length sequences are fine."""
    h, hk, d = 4, 2, 16
    lens_q, lens_k = [5, 0, 9, 1], [7, 3, 0, 12]
    cu_q = torch.tensor(np.concatenate([[1], 1 + np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    tq, tk = int(cu_q[-1]) + 2, int(cu_k[-1])
    mk = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float64).requires_grad_()
    q, k, v = mk(tq, h, d), mk(tk, hk, d), mk(tk, hk, d)
    sink = torch.tensor(rng.standard_normal(h), dtype=torch.float32).requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                 learnable_sink=sink)
    dout = torch.randn_like(out)
    dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, sink), dout)
    ds_want = torch.zeros(h, dtype=torch.float64)
    for i in range(len(lens_q)):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        ka, ke = int(cu_k[i]), int(cu_k[i + 1])
        qi, ki, vi = (x.detach()[s:t][None].clone().requires_grad_()
                      for x, s, t in ((q, a, e), (k, ka, ke), (v, ka, ke)))
        si = sink.detach().double().requires_grad_()
        ref = torch_ref(qi, ki, vi, causal=True, sink=si)
        gq, gk, gv, gs = torch.autograd.grad(ref, (qi, ki, vi, si), dout[a:e][None],
                                             allow_unused=True)
        for g, w in ((dq[a:e], gq), (dk[ka:ke], gk), (dv[ka:ke], gv)):
            assert torch.allclose(g, w[0], atol=1e-10, rtol=1e-9)
        ds_want += gs if gs is not None else 0
    assert torch.allclose(ds.double(), ds_want, atol=1e-5, rtol=1e-5)
    outside = torch.ones(tq, dtype=torch.bool)
    outside[int(cu_q[0]):int(cu_q[-1])] = False
    assert outside.any() and (dq[outside] == 0).all()


@pytest.mark.parametrize("varlen", [False, True])
def test_dropout_forward_and_backward_share_the_mask(rng, varlen):
    """The mask recovered from S_dmask's sign, fed to the reference, reproduces out and every
    gradient: the backward replays exactly the forward's dropout."""
    b, sq, sk, h, hk, d, p = 2, 33, 47, 4, 2, 24, 0.3
    mk = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float64).requires_grad_()
    q, k, v = mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)
    if varlen:
        cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
        cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32)
        out, lse, S = flash_attn_varlen_func(
            q.reshape(b * sq, h, d), k.reshape(b * sk, hk, d), v.reshape(b * sk, hk, d), cu_q,
            cu_k, sq, sk, dropout_p=p, causal=True, return_attn_probs=True)
        out = out.reshape(b, sq, h, d)
    else:
        out, lse, S = flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    keep = S[:, :, :sq, :sk] >= 0
    dropped = (S[:, :, :sq, :sk] < 0).double().mean().item()
    assert 0.15 < dropped / 0.5 < 0.45  # about p of the causal half is dropped
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = torch_ref(q64, k64, v64, causal=True, keep=keep, dropout_p=p)
    assert torch.allclose(out, ref, atol=1e-10, rtol=1e-9)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-10, rtol=1e-9)


def test_packed_forms_differentiate_into_the_buffer(rng):
    qkv = torch.tensor(rng.standard_normal((2, 11, 3, 4, 8)), dtype=torch.float64)
    qkv.requires_grad_()
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    (g,) = torch.autograd.grad(out.sum(), (qkv,))
    x = qkv.detach().clone().requires_grad_()
    ref = torch_ref(x[:, :, 0], x[:, :, 1], x[:, :, 2], causal=True)
    (w,) = torch.autograd.grad(ref.sum(), (x,))
    assert torch.allclose(g, w, atol=1e-10, rtol=1e-9)
    q = torch.tensor(rng.standard_normal((2, 6, 4, 8)), dtype=torch.float64).requires_grad_()
    kv = torch.tensor(rng.standard_normal((2, 9, 2, 2, 8)), dtype=torch.float64)
    kv.requires_grad_()
    out = flash_attn_kvpacked_func(q, kv, window_size=(2, 2))
    gq, gkv = torch.autograd.grad(out.sum(), (q, kv))
    q2, kv2 = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    ref = torch_ref(q2, kv2[:, :, 0], kv2[:, :, 1], window=(2, 2))
    wq, wkv = torch.autograd.grad(ref.sum(), (q2, kv2))
    assert torch.allclose(gq, wq, atol=1e-10) and torch.allclose(gkv, wkv, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_bitwise_reproducible_across_threads(rng, dtype, monkeypatch):
    b, sq, sk, h, hk, d = 2, 150, 130, 4, 2, 40
    base = [torch.tensor(rng.standard_normal(s), dtype=dtype)
            for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))]
    dout = torch.tensor(rng.standard_normal((b, sq, h, d)), dtype=dtype)
    results = []
    for threads, deterministic in (("1", False), ("2", True), ("3", False), ("2", False)):
        monkeypatch.setenv("FLASHATTN_NUM_THREADS", threads)
        torch.manual_seed(1234)
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True, deterministic=deterministic)
        results.append(torch.autograd.grad(out, (q, k, v), dout))
    for other in results[1:]:
        for g, w in zip(other, results[0]):
            assert torch.equal(g, w)


def test_no_grad_inputs_and_sink_only(rng):
    """Only the learnable sink requires grad: gradients flow to it alone."""
    q, k, v = (torch.tensor(rng.standard_normal((1, 12, 2, 8)), dtype=torch.float32)
               for _ in range(3))
    sink = torch.tensor(rng.standard_normal(2), dtype=torch.float16).requires_grad_()
    out = flash_attn_func(q, k, v, learnable_sink=sink, causal=True)
    (g,) = torch.autograd.grad(out.sum() * 0 + (out * out).sum(), (sink,))
    assert g.dtype == torch.float16 and torch.isfinite(g).all() and g.abs().sum() > 0
    s64 = sink.detach().double().requires_grad_()
    ref = torch_ref(q.double(), k.double(), v.double(), causal=True, sink=s64)
    (w,) = torch.autograd.grad((ref * ref).sum(), (s64,))
    assert torch.allclose(g.double(), w, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("feat", [dict(), dict(causal=True, sink=True), dict(window=(9, 3)),
                                  dict(softcap=2.0, alibi="h")],
                         ids=lambda f: ",".join(map(str, f.items())) or "plain")
@pytest.mark.parametrize("shape", [(2, 70, 300, 32, 16, 24), (2, 60, 700, 16, 8, 24),
                                   (1, 50, 800, 8, 8, 24), (1, 40, 1100, 32, 32, 24)],
                         ids=["pairs", "stripes", "stripes-256", "stripes-of-2"])
def test_grads_fused_schedule(rng, feat, shape, monkeypatch):
    """Shapes with at least 32 (batch, kv head) pairs take the fused backward schedule, and so do
    16 pairs whose keys make two 512-key chunks (each pair in two stripes of chunks, each with
    its own share of dQ, added up afterwards), 8 pairs whose keys make four 256-key chunks, and
    32 pairs over 1100 keys (three chunks, two in stripe 0); the gradients must match the
    reference and stay bitwise identical across thread counts."""
    b, sq, sk, h, hk, d = shape
    q, k, v, alibi, sink = _inputs(rng, b, sq, sk, h, hk, d, d, torch.float64, feat)
    dout = torch.tensor(rng.standard_normal((b, sq, h, d)))
    results = []
    for threads in ("1", "3"):
        monkeypatch.setenv("FLASHATTN_NUM_THREADS", threads)
        out = flash_attn_func(q, k, v, **_kwargs(feat, alibi, sink))
        results.append(_grads(out, (q, k, v, sink), dout))
    for g, w in zip(results[0], results[1]):
        assert torch.equal(g, w)
    q64, k64, v64 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    s64 = sink.detach().double().requires_grad_() if sink is not None else None
    ref = torch_ref(q64, k64, v64, **_ref_kwargs(feat, alibi, s64))
    want = _grads(ref, (q64, k64, v64, s64), dout)
    for name, g, w in zip("q k v sink".split(), results[0], want):
        err = (g.double() - w).abs().max().item()
        assert err <= 1e-9 * max(1.0, w.abs().max().item()) + (1e-5 if name == "sink" else 0), (
            name, err)


def test_grads_fused_schedule_varlen_and_dropout(rng):
    """Varlen with 40 sequences of one kv head (fused) and dropout replayed from S_dmask."""
    lens = rng.integers(0, 9, 40)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    total, h, d, p = int(cu[-1]), 2, 16, 0.25
    mk = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float64).requires_grad_()
    q, k, v = mk(total, h, d), mk(total, 1, d), mk(total, 1, d)
    out, _, S = flash_attn_varlen_func(q, k, v, cu, cu, int(lens.max()), int(lens.max()),
                                       dropout_p=p, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for i in range(len(lens)):
        a, e = int(cu[i]), int(cu[i + 1])
        if a == e:
            continue
        n = e - a
        keep = S[i:i + 1, :, :n, :n] >= 0
        qi, ki, vi = (x.detach()[a:e][None].clone().requires_grad_() for x in (q, k, v))
        ref = torch_ref(qi, ki, vi, causal=True, keep=keep, dropout_p=p)
        want = torch.autograd.grad(ref, (qi, ki, vi), dout[a:e][None])
        for g, w in zip(got, want):
            assert torch.allclose(g[a:e], w[0], atol=1e-10, rtol=1e-9)
