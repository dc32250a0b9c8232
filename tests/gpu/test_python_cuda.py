"""The Python package on torch CUDA tensors: the functions against the CPU path on the same
inputs, autograd, the custom ops (opcheck), torch.compile, CUDA graph capture, the SDPA
registration, the combine, DLPack with CuPy and JAX, and the absence of host synchronisation.

Run by `make gpu-check` on a CUDA machine:
    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so python3 -m pytest tests/gpu
Skipped as a whole where torch sees no CUDA device. Both sides accumulate in fp32 and round the
output once; the GPU also rounds P to the input dtype before P V, so outputs agree to a few
units in the last place of fp16 / bf16 (the tolerances below), lse to fp32 rounding.
"""
import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import flashattn  # noqa: E402
from flashattn import (FlashAttnError, flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                       flash_attn_qkvpacked_func, flash_attn_varlen_func)
from flashattn import _lib, _torch_ops  # noqa: E402,F401  (registers torch.ops.flashattn)

DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _close(gpu, cpu, dtype, what):
    tol = TOL[dtype]
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), atol=tol, rtol=tol, msg=what)


def _lse_close(gpu, cpu, tol=2e-3):
    torch.testing.assert_close(gpu.cpu(), cpu, atol=tol, rtol=tol)


def _both(f, *tensors, **kw):
    """f on the CPU tensors and on CUDA copies of them: (cpu result, cuda result)."""
    cuda = [t.cuda() if isinstance(t, torch.Tensor) else t for t in tensors]
    kw_cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return f(*tensors, **kw), f(*cuda, **kw_cuda)


def _qkv(b, sq, sk, h, hk, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, dv, generator=g).to(dtype)
    return q, k, v


CASES = [
    dict(shape=(2, 257, 257, 4, 4, 64, 64)),
    dict(shape=(2, 300, 517, 4, 4, 128, 128), causal=True),
    dict(shape=(1, 333, 290, 8, 2, 96, 96), window_size=(32, 16)),
    dict(shape=(2, 70, 150, 6, 1, 40, 24), window_size=(50, -1)),
    dict(shape=(1, 200, 200, 4, 2, 128, 128), causal=True, softcap=30.0, alibi=True, sink=True),
    dict(shape=(1, 512, 512, 2, 2, 256, 256), softmax_scale=0.07),
    dict(shape=(3, 1, 1000, 8, 2, 128, 128), causal=True),
    dict(shape=(1, 150, 190, 2, 2, 64, 64), causal=True, softmax_scale=-0.1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c["shape"]))
def test_dense_matches_cpu(case, dtype):
    b, sq, sk, h, hk, d, dv = case["shape"]
    q, k, v = _qkv(b, sq, sk, h, hk, d, dv, dtype, seed=sq * 7 + d)
    kw = dict(causal=case.get("causal", False), window_size=case.get("window_size", (-1, -1)),
              softcap=case.get("softcap", 0.0), softmax_scale=case.get("softmax_scale"),
              return_attn_probs=True)
    if case.get("alibi"):
        kw["alibi_slopes"] = torch.rand(h) * 0.3
    if case.get("sink"):
        kw["learnable_sink"] = torch.randn(h)
    (oc, lc, _), (og, lg, sg) = _both(flash_attn_func, q, k, v, **kw)
    assert og.is_cuda and lg.is_cuda and og.device == torch.device("cuda", 0)
    assert og.dtype == dtype and lg.dtype == torch.float32 and sg.numel() == 0
    _close(og, oc, dtype, "out")
    _lse_close(lg, lc)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_packed_forms(dtype):
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 190, 3, 4, 64, generator=g).to(dtype)
    oc, og = _both(flash_attn_qkvpacked_func, qkv, causal=True)
    _close(og, oc, dtype, "qkvpacked")
    q = torch.randn(2, 100, 4, 64, generator=g).to(dtype)
    kv = torch.randn(2, 260, 2, 2, 64, generator=g).to(dtype)
    oc, og = _both(flash_attn_kvpacked_func, q, kv)
    _close(og, oc, dtype, "kvpacked")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_varlen_matches_cpu(dtype):
    g = torch.Generator().manual_seed(11)
    lq, lk = [37, 0, 300, 129], [50, 17, 280, 400]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 8, 128, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), 2, 128, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), 2, 128, generator=g).to(dtype)
    (oc, lc, _), (og, lg, _) = _both(flash_attn_varlen_func, q, k, v, cu_q, cu_k, max(lq),
                                     max(lk), causal=True, alibi_slopes=torch.rand(8) * 0.2,
                                     return_attn_probs=True)
    _close(og, oc, dtype, "varlen out")
    _lse_close(lg, lc)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_varlen_few_rows_matches_cpu(dtype):
    """At most 16 query rows per sequence: the decode schedule on both devices (the GPU's split
    over the keys, its partials in the call's workspace), an empty sequence, a second call of
    the signature (the cached C arguments), and the gradients (the backward reads the decode
    schedule's lse)."""
    g = torch.Generator().manual_seed(12)
    lq, lk = [1, 0, 16, 5, 9], [3000, 17, 700, 2049, 64]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    for run in range(2):
        q = torch.randn(int(cu_q[-1]), 8, 128, generator=g).to(dtype)
        k = torch.randn(int(cu_k[-1]), 2, 128, generator=g).to(dtype)
        v = torch.randn(int(cu_k[-1]), 2, 128, generator=g).to(dtype)
        (oc, lc, _), (og, lg, _) = _both(flash_attn_varlen_func, q, k, v, cu_q, cu_k, max(lq),
                                         max(lk), causal=True, softcap=20.0,
                                         return_attn_probs=True)
        _close(og, oc, dtype, "varlen few-row out, call %d" % run)
        _lse_close(lg, lc)
    qs = [x.clone().requires_grad_() for x in (q, k, v)]
    qg = [x.cuda().requires_grad_() for x in (q, k, v)]
    dout = torch.randn(og.shape, generator=g).to(dtype)
    grads = []
    for tensors, d in ((qs, dout), (qg, dout.cuda())):
        out = flash_attn_varlen_func(*tensors, cu_q.to(tensors[0].device),
                                     cu_k.to(tensors[0].device), max(lq), max(lk), causal=True)
        grads.append(torch.autograd.grad(out, tensors, d))
    for name, gc, gg in zip("qkv", *grads):
        _close(gg, gc, dtype, "varlen few-row d" + name)


def _op_dropout(q, k, v, seed, p=0.17):
    """torch.ops.flashattn.fwd with an explicit seed: the same seed gives the same keep mask on
    both devices."""
    s = torch.tensor([seed], dtype=torch.int64)
    return torch.ops.flashattn.fwd(q, k, v, None, None, s, p, None, True, -1, -1, 0.0, True,
                                   False)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_dropout_mask_matches_cpu(dtype, d):
    q, k, v = _qkv(2, 129, 300, 3, 3, d, d, dtype, seed=d)
    (oc, lc, sc, rc), (og, lg, sg, rg) = _both(_op_dropout, q, k, v, 0x5EED)
    _close(og, oc, dtype, "dropout out")
    _lse_close(lg, lc)
    assert torch.equal(rg.cpu(), rc)
    sg = sg.cpu().float()
    sc = sc.float()
    torch.testing.assert_close(sg, sc, atol=1e-2, rtol=1e-2)
    big = sc.abs() > 1e-3
    assert torch.equal(torch.signbit(sg[big]), torch.signbit(sc[big])), "dropout masks differ"


def test_dropout_seed_from_cuda_generator():
    q, k, v = (x.cuda() for x in _qkv(1, 128, 128, 2, 2, 64, 64, torch.bfloat16, seed=3))
    torch.manual_seed(0)
    a = flash_attn_func(q, k, v, dropout_p=0.3)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(0)
    a2 = flash_attn_func(q, k, v, dropout_p=0.3)
    torch.cuda.manual_seed(0)
    a3 = flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, a2) and torch.equal(a, a3) and not torch.equal(a, b)
    # The CPU generator is left alone by CUDA calls.
    torch.manual_seed(1)
    x = torch.rand(4)
    torch.manual_seed(1)
    flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(torch.rand(4), x)


def test_current_stream_and_no_sync(monkeypatch):
    """Every call runs on the caller's current stream, the C fast path's too (it serves the
    calls after the first of a signature), and none synchronises."""
    from flashattn import _cached, _route, _torch_ops

    q, k, v = (x.cuda() for x in _qkv(4, 1024, 1024, 8, 8, 128, 128, torch.float16, seed=9))
    ref = flash_attn_func(q, k, v, causal=True)
    assert _route.DENSE_C is not None, "the C fast path (_fastpath.c) was not built"
    routed, real = [], _torch_ops.dense  # the Python route: what C does not serve
    monkeypatch.setattr(_torch_ops, "dense", lambda *a, **kw: routed.append(a) or real(*a, **kw))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    outs = []
    with torch.cuda.stream(s):
        for _ in range(3):
            routed.clear()
            outs.append(flash_attn_func(q, k, v, causal=True))
    assert routed == []  # the last call was served in C
    streams = [c.args.stream for c in _cached._LOCAL.calls.values() if c.fast is not None]
    assert s.cuda_stream in streams
    s.synchronize()
    for o in outs:
        assert torch.equal(o, ref)


def test_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device")
    q, k, v = _qkv(1, 200, 200, 2, 2, 64, 64, torch.float16, seed=1)
    oc, og = _both(flash_attn_func, q, k, v)
    o1 = flash_attn_func(q.to("cuda:1"), k.to("cuda:1"), v.to("cuda:1"))
    assert o1.device == torch.device("cuda", 1)
    assert torch.equal(o1.cpu(), og.cpu())


def test_refusals():
    q, k, v = (x.cuda() for x in _qkv(1, 64, 64, 2, 2, 64, 64, torch.float16, seed=2))
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        torch.testing.assert_close(flash_attn_func(qg, k, v), flash_attn_func(q, k, v))
    with pytest.raises(FlashAttnError, match=r"^k: expected a tensor on cuda:0 like q"):
        flash_attn_func(q, k.cpu(), v)
    with pytest.raises(FlashAttnError, match=r"^k: expected a tensor on cpu like q"):
        flash_attn_func(q.cpu(), k, v.cpu())
    with pytest.raises(FlashAttnError, match=r"^out: expected a tensor on cpu like out_partial"):
        flashattn.flash_attn_combine(torch.randn(2, 1, 3, 2, 8), torch.randn(2, 1, 3, 2),
                                     out=torch.empty(1, 3, 2, 8, device="cuda"))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(FlashAttnError, match=r"^cu_seqlens_q: expected a tensor on cuda:0"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu.cuda(), 64, 64)
    with pytest.raises(FlashAttnError, match=r"^q: the CUDA backend computes fp16 and bf16"):
        flash_attn_func(q.float(), k.float(), v.float())
    assert flashattn.__name__ == "flashattn"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_on_cuda_matches_cpu(dtype, deterministic):
    """loss.backward() through the CUDA backward (workspace from torch's allocator) against the
    CPU backward in fp32 on the same values: GQA, causal, a learnable sink."""
    q, k, v = _qkv(2, 150, 170, 8, 2, 64, 64, dtype, seed=5)
    dout = torch.randn(2, 150, 8, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(7))
    grads = {}
    for dev, dt in (("cuda", dtype), ("cpu", torch.float32)):
        qd, kd, vd = (x.to(dev, dt).requires_grad_() for x in (q, k, v))
        sd = sink.to(dev).requires_grad_()
        out = flash_attn_func(qd, kd, vd, causal=True, learnable_sink=sd,
                              deterministic=deterministic)
        out.backward(dout.to(dev, dt))
        grads[dev] = [x.grad.float().cpu() for x in (qd, kd, vd, sd)]
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), grads["cuda"], grads["cpu"]):
        err = (g - w).abs().max().item()
        assert err <= 2e-2 * max(1.0, w.abs().max().item()), (name, err)
    if deterministic:
        qd, kd, vd = (x.cuda().requires_grad_() for x in (q, k, v))
        runs = []
        for _ in range(2):
            out = flash_attn_func(qd, kd, vd, causal=True, deterministic=True)
            runs.append(torch.autograd.grad(out, (qd, kd, vd), dout.cuda()))
        for a, b in zip(*runs):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# The custom ops on CUDA tensors


def _randn(gen, *shape, dtype=torch.float16, grad=False, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to("cuda", dtype).requires_grad_(grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("p", [0.0, 0.15])
def test_opcheck_fwd_bwd_cuda(gen, dtype, p):
    """opcheck (schema, fake tensors, autograd registration, AOT dispatch) on CUDA tensors: GQA,
    causal, ALiBi, a learnable sink with its gradient; with dropout the probs output too."""
    from torch.library import opcheck

    q = _randn(gen, 2, 70, 4, 64, dtype=dtype, grad=True)
    k = _randn(gen, 2, 90, 2, 64, dtype=dtype, grad=True)
    v = _randn(gen, 2, 90, 2, 64, dtype=dtype, grad=True)
    alibi = (torch.rand(4, generator=gen) * 0.3).cuda()
    sink = _randn(gen, 4, dtype=torch.float32, grad=True)
    seed = torch.randint(0, 2**62, (1,), generator=gen) if p > 0 else None
    args = (q, k, v, alibi, sink, seed, p, None, True, -1, -1, 0.0, p > 0, False)
    opcheck(torch.ops.flashattn.fwd.default, args)
    out, lse, S, rng_state = torch.ops.flashattn.fwd(*args)
    assert out.is_cuda and lse.is_cuda and rng_state.is_cuda
    assert rng_state.tolist() == [int(seed) if p > 0 else 0, 0]
    assert tuple(S.shape) == ((2, 4, 128, 128) if p > 0 else (0,))
    dout = torch.randn_like(out)
    bargs = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, alibi,
             sink.detach(), rng_state, p, None, True, -1, -1, 0.0, False)
    opcheck(torch.ops.flashattn.bwd.default, bargs)
    dq, dk, dv, dsink = torch.ops.flashattn.bwd(*bargs)
    assert dq.is_cuda and dsink.shape == (4,) and torch.isfinite(dq.float()).all()


def test_opcheck_varlen_cuda(gen):
    from torch.library import opcheck

    cu_q = torch.tensor([0, 40, 40, 101], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 64, 70, 150], dtype=torch.int32, device="cuda")
    q = _randn(gen, 101, 4, 64)
    k, v = _randn(gen, 150, 2, 64), _randn(gen, 150, 2, 64)
    args = (q, k, v, cu_q, cu_k, None, None, None, None, 61, 80, 0.0, 0.3, True, -1, -1, 0.0,
            False, False)
    opcheck(torch.ops.flashattn.varlen_fwd.default, args)
    out, lse, S, rng_state = torch.ops.flashattn.varlen_fwd(*args)
    want = flash_attn_varlen_func(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), 61, 80,
                                  softmax_scale=0.3, causal=True)
    _close(out, want, torch.float16, "varlen op")
    bargs = (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, None, None, None, rng_state,
             61, 80, 0.0, 0.3, True, -1, -1, 0.0, False)
    grads = torch.ops.flashattn.varlen_bwd(*bargs)
    want = torch.ops.flashattn.varlen_bwd(*(x.cpu() if isinstance(x, torch.Tensor) else x
                                            for x in bargs))
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert g.is_cuda
        _close(g, w, torch.float16, "varlen " + name)
    opcheck(torch.ops.flashattn.varlen_bwd.default, bargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [
    dict(causal=True, s_new=1, sq=1),
    dict(causal=True, s_new=4, sq=4, rotary=True),
    dict(s_new=2, sq=3, rotary=True, interleaved=False),
    dict(window=(9, 0), softcap=5.0, alibi=True, sinks=True, s_new=1, sq=2),
    dict(s_new=0, sq=5, causal=True),
    dict(s_new=2, sq=2, causal=True, page=16, rotary=True),
    dict(s_new=1, sq=1, causal=True, bidx=True, leftpad=True),
    dict(s_new=1, sq=1, causal=True, splits=5, rotary=True),
    dict(s_new=0, sq=3, splits=3, page=16),
], ids=["decode", "causal-rotary", "rotary-neox", "window-softcap-alibi-sinks", "no-append",
        "paged-rotary", "batch-idx-leftpad", "decode-split", "split-paged"])
def test_kvcache_cuda_matches_cpu(gen, dtype, case):
    """flash_attn_with_kvcache on CUDA tensors (rotary and the append in torch ops, then the
    varlen forward over the caches, gathered for paged caches, cache_batch_idx and
    cache_leftpad, split and merged where num_splits asks) against the CPU library's call on
    copies: the same out and lse, and the caches updated alike in place."""
    b, h, hk, d, cap = 3, 8, 2, 64, 200
    s_new, sq = case["s_new"], case["sq"]
    q = _randn(gen, b, sq, h, d, dtype=dtype)
    rows, extra = b, {}
    if case.get("page"):
        page = case["page"]
        blocks = cap // page
        cap = blocks * page  # the capacity the block table gives
        rows = b * blocks + 3
        extra["block_table"] = torch.randperm(rows, generator=gen)[:b * blocks].view(
            b, blocks).to("cuda", torch.int32)
    if case.get("bidx"):
        rows = b + 2
        extra["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    if case.get("leftpad"):
        extra["cache_leftpad"] = torch.tensor([0, 20, 5], dtype=torch.int32, device="cuda")
    size = (rows, case["page"] if case.get("page") else cap, hk, d)
    kc, vc = _randn(gen, *size, dtype=dtype), _randn(gen, *size, dtype=dtype)
    k = _randn(gen, b, s_new, hk, d, dtype=dtype) if s_new else None
    v = _randn(gen, b, s_new, hk, d, dtype=dtype) if s_new else None
    lens = torch.tensor([0, 57, cap - s_new], dtype=torch.int32, device="cuda")
    kw = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0), return_softmax_lse=True,
              cache_seqlens=lens if s_new else None, num_splits=case.get("splits", 0),
              **extra)
    if case.get("rotary"):
        th = torch.rand(cap + sq, 16, generator=gen) * 6 - 3
        kw.update(rotary_cos=th.cos().to("cuda", dtype), rotary_sin=th.sin().to("cuda", dtype),
                  rotary_interleaved=case.get("interleaved", True))
    if case.get("alibi"):
        kw["alibi_slopes"] = (torch.rand(h, generator=gen) * 0.5).cuda()
    if case.get("sinks"):
        kw["learnable_sink"] = torch.randn(h, generator=gen).cuda()
    cpu = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    kc_c, vc_c = kc.cpu(), vc.cpu()
    out_c, lse_c = flashattn.flash_attn_with_kvcache(
        q.cpu(), kc_c, vc_c, None if k is None else k.cpu(), None if v is None else v.cpu(),
        **cpu)
    out, lse = flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    assert out.is_cuda and out.dtype == dtype and lse.shape == (b, h, sq)
    _close(out, out_c, dtype, "kvcache out")
    # Rotated q and keys may differ by an ulp of the dtype (the rotation rounds once either way),
    # which moves the scores, and the lse with them, by about that much (bf16: 3.6e-3 seen).
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    _lse_close(lse, lse_c, tol=2 * ulp if case.get("rotary") else 2e-3)
    torch.testing.assert_close(kc.cpu().float(), kc_c.float(), atol=2 * ulp, rtol=2 * ulp)
    assert torch.equal(vc.cpu(), vc_c)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("page", [0, 1, 16])
def test_kvcache_fp8_cuda_matches_cpu(gen, dtype, kind, page):
    """fp8 caches with k_descale / v_descale on CUDA tensors (the decode kernel) against the
    CPU library's call on copies: the same out and lse, the same appended codes (rotated keys
    at most one code apart)."""
    b, h, hk, d, cap, s_new = 3, 8, 2, 128, 192, 1
    q = _randn(gen, b, 2, h, d, dtype=dtype)
    extra, rows = {}, b
    if page:
        blocks = cap // page
        rows = b * blocks + 3
        extra["block_table"] = torch.randperm(rows, generator=gen)[:b * blocks].view(
            b, blocks).to("cuda", torch.int32)
    size = (rows, page if page else cap, hk, d)
    kc = (torch.rand(*size, generator=gen) * 4 - 2).to(kind).cuda()
    vc = (torch.rand(*size, generator=gen) * 4 - 2).to(kind).cuda()
    k, v = _randn(gen, b, s_new, hk, d, dtype=dtype), _randn(gen, b, s_new, hk, d, dtype=dtype)
    th = torch.rand(cap + 2, 16, generator=gen) * 6 - 3
    kw = dict(causal=True, return_softmax_lse=True, num_splits=0,
              cache_seqlens=torch.tensor([0, 57, cap - s_new], dtype=torch.int32, device="cuda"),
              rotary_cos=th.cos().to("cuda", dtype), rotary_sin=th.sin().to("cuda", dtype),
              k_descale=(torch.rand(b, hk, generator=gen) + 0.2).cuda(),
              v_descale=(torch.rand(b, hk, generator=gen) + 0.2).cuda(), **extra)
    cpu = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    kc_c, vc_c = kc.cpu(), vc.cpu()
    out_c, lse_c = flashattn.flash_attn_with_kvcache(q.cpu(), kc_c, vc_c, k.cpu(), v.cpu(), **cpu)
    out, lse = flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    assert out.is_cuda and out.dtype == dtype
    _close(out, out_c, dtype, "fp8 kvcache out")
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    _lse_close(lse, lse_c, tol=2 * ulp)
    assert torch.equal(vc.cpu().view(torch.uint8), vc_c.view(torch.uint8))
    step = (kc.cpu().view(torch.uint8).int() - kc_c.view(torch.uint8).int()).abs()
    assert int(step.max()) <= 1


def test_kvcache_cuda_refusals(gen):
    """Arguments on another device, or a paged cache with cache_batch_idx, are refused by name
    before anything is written."""
    q = _randn(gen, 2, 1, 4, 64)
    kc, vc = _randn(gen, 2, 32, 2, 64), _randn(gen, 2, 32, 2, 64)
    k, v = _randn(gen, 2, 1, 2, 64), _randn(gen, 2, 1, 2, 64)
    before = kc.clone()
    idx = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    with pytest.raises(FlashAttnError, match=r"^cache_batch_idx: not supported with a paged"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=5, cache_batch_idx=idx,
                                          block_table=idx[:, None])
    with pytest.raises(FlashAttnError, match=r"^k_cache: expected a tensor on cuda:0 like q"):
        flashattn.flash_attn_with_kvcache(q, kc.cpu(), vc, k, v, cache_seqlens=5)
    assert torch.equal(kc, before)


def test_kvcache_cuda_compiles_and_captures(gen):
    """The CUDA form reads no device value on the host: one op under torch.compile(fullgraph)
    and a decode step captured in a CUDA graph replays like eager."""
    q = _randn(gen, 2, 1, 8, 64)
    kc, vc = _randn(gen, 2, 64, 2, 64), _randn(gen, 2, 64, 2, 64)
    k, v = _randn(gen, 2, 1, 2, 64), _randn(gen, 2, 1, 2, 64)
    lens = torch.tensor([3, 40], dtype=torch.int32, device="cuda")

    def step(q, kc, vc, k, v, lens):
        return flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                 causal=True)

    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, kc, vc, k, v, lens)
    got = torch.compile(step, fullgraph=True)(q, kc2, vc2, k, v, lens)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc2, kc)
    kc3, vc3 = kc.clone(), vc.clone()
    step(q, kc3, vc3, k, v, lens)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(q, kc3, vc3, k, v, lens)
    lens.add_(1)
    kc3.copy_(kc)
    vc3.copy_(vc)
    graph.replay()
    kc4 = kc.clone()
    torch.testing.assert_close(out, step(q, kc4, vc.clone(), k, v, lens))
    assert torch.equal(kc3, kc4)


@pytest.mark.parametrize("page", [0, 16])
def test_kvcache_fp8_cuda_fast_path_compiles_and_captures(gen, monkeypatch, page):
    """fp8 caches with k_descale / v_descale on CUDA take the other caches' paths: a repeated
    call (new descales each time) is served in C, not by the Python route, with the bits of a
    call prepared anew; torch.compile(fullgraph) gives eager's answer; a decode step captured
    in a CUDA graph replays like eager; descales on the CPU or of the wrong dtype are refused by
    name before anything is written."""
    from flashattn import _cached, _route

    b, h, hk, d, cap = 2, 8, 2, 128, 64
    u8 = torch.uint8
    rows, extra = b, {}
    if page:
        blocks = cap // page
        rows = b * blocks + 1
        extra["block_table"] = torch.randperm(rows, generator=gen)[:b * blocks].view(
            b, blocks).to("cuda", torch.int32)
    size = (rows, page if page else cap, hk, d)
    kc = (torch.rand(*size, generator=gen) * 4 - 2).to(torch.float8_e4m3fn).cuda()
    vc = (torch.rand(*size, generator=gen) * 4 - 2).to(torch.float8_e4m3fn).cuda()
    q = _randn(gen, b, 1, h, d, dtype=torch.bfloat16)
    k, v = (_randn(gen, b, 1, hk, d, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([5, 40], dtype=torch.int32, device="cuda")

    def descales():
        return [(torch.rand(b, hk, generator=gen) + 0.2).cuda() for _ in range(2)]

    def step(q, kc, vc, k, v, lens, kd, vd):
        return flashattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                 causal=True, k_descale=kd, v_descale=vd,
                                                 **extra)

    assert _route.KVCACHE_C is not None, "the C fast path (_fastpath_kv.c) was not built"
    with monkeypatch.context() as m:
        routed, real = [], _torch_ops.kvcache_call  # the Python route: what C does not serve
        m.setattr(_torch_ops, "kvcache_call", lambda *a, **kw: routed.append(1) or real(*a, **kw))
        step(q, kc.clone(), vc.clone(), k, v, lens, *descales())  # prepares the signature
        for _ in range(2):
            kd, vd = descales()
            got_caches = (kc.clone(), vc.clone())
            routed.clear()
            got = step(q, *got_caches, k, v, lens, kd, vd)
            assert routed == [], "not served in C"
            _cached._LOCAL.calls.clear()
            want_caches = (kc.clone(), vc.clone())
            want = step(q, *want_caches, k, v, lens, kd, vd)
            assert routed == [1]
            assert torch.equal(got, want)
            for a, c in zip(got_caches, want_caches):
                assert torch.equal(a.view(u8), c.view(u8))

    kd, vd = descales()
    eager_caches, compiled_caches = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    want = step(q, *eager_caches, k, v, lens, kd, vd)
    got = torch.compile(step, fullgraph=True)(q, *compiled_caches, k, v, lens, kd, vd)
    torch.testing.assert_close(got, want)
    for a, c in zip(eager_caches, compiled_caches):
        assert torch.equal(a.view(u8), c.view(u8))

    kc3, vc3 = kc.clone(), vc.clone()
    step(q, kc3, vc3, k, v, lens, kd, vd)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(q, kc3, vc3, k, v, lens, kd, vd)
    lens.add_(1)
    kd.mul_(1.5)
    kc3.copy_(kc)
    vc3.copy_(vc)
    graph.replay()
    kc4, vc4 = kc.clone(), vc.clone()
    torch.testing.assert_close(out, step(q, kc4, vc4, k, v, lens, kd, vd))
    assert torch.equal(kc3.view(u8), kc4.view(u8)) and torch.equal(vc3.view(u8), vc4.view(u8))

    before = kc.clone()
    with pytest.raises(FlashAttnError, match=r"^k_descale: expected a tensor on cuda:0 like q"):
        step(q, kc, vc, k, v, lens, kd.cpu(), vd)
    with pytest.raises(FlashAttnError, match=r"^v_descale"):
        step(q, kc, vc, k, v, lens, kd, vd.double())
    assert torch.equal(kc.view(u8), before.view(u8))


def test_combine_cuda(gen):
    """flash_attn_combine on CUDA tensors (the library's fp32 kernel) against the CPU library
    (which merges in double), as the op (opcheck) and into out."""
    from torch.library import opcheck

    op = torch.randn(5, 2, 33, 4, 64, generator=gen)
    lp = torch.randn(5, 2, 33, 4, generator=gen) * 4
    lp[torch.rand(5, 2, 33, 4, generator=gen) < 0.3] = float("-inf")
    lp[:, 1, 7, 2] = float("-inf")
    lp[0, 0, 3, 1] = float("inf")
    for out_dtype in (None, torch.bfloat16):
        want, want_lse = flashattn.flash_attn_combine(op, lp, out_dtype=out_dtype)
        got, got_lse = flashattn.flash_attn_combine(op.cuda(), lp.cuda(), out_dtype=out_dtype)
        assert got.is_cuda and got.dtype == want.dtype and got_lse.stride() == want_lse.stride()
        tol = 2e-5 if out_dtype is None else 8e-3
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(got_lse.cpu(), want_lse, rtol=1e-5, atol=0)
    out = torch.empty(2, 33, 4, 64, device="cuda")
    merged, _ = flashattn.flash_attn_combine(op.cuda(), lp.cuda(), out=out)
    assert merged is out
    torch.testing.assert_close(out.cpu(), flashattn.flash_attn_combine(op, lp)[0], rtol=2e-5,
                               atol=2e-5)
    opcheck(torch.ops.flashattn.combine.default, (op.cuda(), lp.cuda(), out))
    with pytest.raises(FlashAttnError, match=r"^lse_partial: dimension 3"):
        flashattn.flash_attn_combine(op.cuda(), lp[..., :3].cuda())


# --------------------------------------------------------------------------------------------
# torch.compile


class _Block(torch.nn.Module):
    """Projections, GQA flash attention (causal, a window, a learnable sink), output
    projection."""

    def __init__(self, dim=256, heads=4, heads_kv=2):
        super().__init__()
        self.h, self.hk, self.d = heads, heads_kv, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * heads_kv) * self.d)
        self.out = torch.nn.Linear(dim, dim)
        self.sink = torch.nn.Parameter(torch.randn(heads))

    def forward(self, x, dropout_p=0.0):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, self.h + 2 * self.hk, self.d)
        q, k, v = qkv.split([self.h, self.hk, self.hk], dim=2)
        y = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True, window_size=(40, -1),
                            learnable_sink=self.sink)
        return self.out(y.reshape(b, n, -1))


def _block(gen, dtype):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return _Block().to("cuda", dtype)


def _max_rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-3)).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_compile_fullgraph_cuda(gen, dtype):
    """Inductor, fullgraph, forward and backward: the flashattn ops stay opaque nodes between
    generated kernels; output and parameter gradients match eager (Inductor's own kernels round
    differently, hence the tolerance)."""
    torch._dynamo.reset()
    model = _block(gen, dtype)
    compiled = torch.compile(model, fullgraph=True)
    for _ in range(2):
        x = _randn(gen, 2, 96, 256, dtype=dtype)
        dy = _randn(gen, 2, 96, 256, dtype=dtype)
        ye, yc = model(x), compiled(x)
        ge = torch.autograd.grad((ye * dy).sum(), list(model.parameters()))
        gc = torch.autograd.grad((yc * dy).sum(), list(model.parameters()))
        assert _max_rel(yc, ye) < 3e-2
        for a, b in zip(gc, ge):
            assert _max_rel(a, b) < 5e-2


def test_compile_dropout_cuda_reproducible(gen):
    """Under compile the seed is a random op of the graph (torch.randint on the CPU): a
    reseeded run repeats, the next call draws a new mask."""
    torch._dynamo.reset()
    model = _block(gen, torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = _randn(gen, 2, 64, 256, dtype=torch.bfloat16)
    torch.manual_seed(3)
    a = compiled(x, 0.3)
    torch.manual_seed(3)
    b = compiled(x, 0.3)
    c = compiled(x, 0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_compile_reduce_overhead_uses_cuda_graphs(gen):
    """mode="reduce-overhead" (Inductor's CUDA graph trees) runs a model with flashattn inside
    its graphs, nothing skipped, and replays match eager on fresh inputs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _block(gen, torch.float16).eval()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(4):
            x = _randn(gen, 2, 80, 256)
            got = compiled(x).clone()
            assert _max_rel(got, model(x)) < 3e-2
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_reduce_overhead_decode_calls_hold_no_pool_memory(gen):
    """Decode-shaped calls first made inside mode="reduce-overhead" graphs (their signatures
    new, so their cached calls are built during the graph trees' warm-up): nothing they keep
    may stay in the graphs' pool (torch refuses to run otherwise), and replays on fresh inputs
    match eager. One query row over 6000 keys takes the split path with its workspace; the
    caches are static addresses, as transformers' static cache marks them, so that their
    update does not keep the graphs from being recorded."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def step(q, k, v, kc, vc, lens, kn, vn):
        a = flash_attn_func(q, k, v, causal=True)
        b = flashattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)
        return a + b

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    kc = _randn(gen, 2, 6144, 2, 64)
    vc = _randn(gen, 2, 6144, 2, 64)
    torch._dynamo.mark_static_address(kc)
    torch._dynamo.mark_static_address(vc)
    for i in range(4):
        q = _randn(gen, 2, 1, 6, 64)
        k, v = _randn(gen, 2, 6001, 2, 64), _randn(gen, 2, 6001, 2, 64)
        kn, vn = _randn(gen, 2, 1, 2, 64), _randn(gen, 2, 1, 2, 64)
        lens = torch.tensor([5000 + i, 5999 - i], dtype=torch.int32, device="cuda")
        kc_e, vc_e = kc.clone(), vc.clone()
        got = compiled(q, k, v, kc, vc, lens, kn, vn).clone()
        want = step(q, k, v, kc_e, vc_e, lens, kn, vn)
        assert _max_rel(got, want) < 1e-2, i
        assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e), i
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


# --------------------------------------------------------------------------------------------
# CUDA graphs and host synchronisation


def _warm(fn):
    """Runs fn on a side stream, as capture requires (kernels compiled and loaded, allocator
    pools warm)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_cuda_graph_forward(gen, dtype):
    """A captured forward replays on new data copied into the static inputs, exactly as eager
    computes it, dense and varlen."""
    q, k, v = (_randn(gen, 2, 200, 4, 64, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, 57, 200], dtype=torch.int32, device="cuda")
    qv = _randn(gen, 200, 4, 64, dtype=dtype)

    def step():
        return (flash_attn_func(q, k, v, causal=True, window_size=(64, 0)),
                flash_attn_varlen_func(qv, k[0], v[0], cu, cu, 143, 143, causal=True))

    _warm(step)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, outv = step()
    previous = None
    for _ in range(3):
        for x in (q, k, v, qv):
            x.copy_(torch.randn(x.shape, generator=gen).to(dtype))
        g.replay()
        torch.cuda.synchronize()
        want, wantv = (flash_attn_func(q.clone(), k.clone(), v.clone(), causal=True,
                                       window_size=(64, 0)),
                       flash_attn_varlen_func(qv.clone(), k[0].clone(), v[0].clone(), cu, cu,
                                              143, 143, causal=True))
        assert torch.equal(out, want) and torch.equal(outv, wantv)
        assert previous is None or not torch.equal(out, previous)
        previous = out.clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_cuda_graph_forward_backward(gen, dtype):
    """Forward and backward captured together (the backward's dQ workspace from the graph's
    pool): replays on fresh inputs give eager's output and gradients bitwise (deterministic
    dQ), a learnable sink's gradient included."""
    q = _randn(gen, 2, 150, 8, 64, dtype=dtype, grad=True)
    k = _randn(gen, 2, 170, 2, 64, dtype=dtype, grad=True)
    v = _randn(gen, 2, 170, 2, 64, dtype=dtype, grad=True)
    sink = _randn(gen, 8, dtype=torch.float32, grad=True)
    dout = _randn(gen, 2, 150, 8, 64, dtype=dtype)
    leaves = (q, k, v, sink)

    def step():
        for x in leaves:
            x.grad = None
        out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=True)
        out.backward(dout)
        return out

    _warm(step)
    for x in leaves:
        x.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=True)
        out.backward(dout)
    grads = [x.grad for x in leaves]
    for _ in range(3):
        with torch.no_grad():
            for x in leaves + (dout,):
                x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        g.replay()
        torch.cuda.synchronize()
        fresh = [x.detach().clone().requires_grad_() for x in leaves]
        want = flash_attn_func(*fresh[:3], causal=True, learnable_sink=fresh[3],
                               deterministic=True)
        want_grads = torch.autograd.grad(want, fresh, dout)
        assert torch.equal(out, want)
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, want_grads):
            assert torch.equal(a, b), name


def test_dropout_under_capture_is_refused(gen):
    """Dropout cannot be captured (the seed would be frozen into the graph, every replay the
    same mask): the public function and the op both refuse it by name."""
    q, k, v = (_randn(gen, 1, 64, 2, 64) for _ in range(3))
    _warm(lambda: flash_attn_func(q, k, v))
    seed = torch.tensor([5], dtype=torch.int64)
    calls = (lambda: flash_attn_func(q, k, v, dropout_p=0.1),
             lambda: torch.ops.flashattn.fwd(q, k, v, None, None, seed, 0.1, None, False, -1,
                                             -1, 0.0, False, False))
    for call in calls:
        g = torch.cuda.CUDAGraph()
        with pytest.raises(FlashAttnError, match=r"^dropout_p: 0\.1 under CUDA graph capture"):
            with torch.cuda.graph(g):
                call()
    out = flash_attn_func(q, k, v, dropout_p=0.1)  # outside capture: fine
    assert torch.isfinite(out.float()).all() and not torch.equal(out, flash_attn_func(q, k, v))


def test_no_host_synchronisation(gen):
    """torch's sync debug mode turns every synchronising call into an error: none in the forward
    and backward without dropout, varlen (zero_tensors included), the combine, the ops."""
    from flashattn.flash_attn_interface import _flash_attn_varlen_forward

    q = _randn(gen, 2, 130, 4, 64, grad=True)
    k, v = _randn(gen, 2, 160, 2, 64, grad=True), _randn(gen, 2, 160, 2, 64, grad=True)
    sink = _randn(gen, 4, dtype=torch.float32, grad=True)
    cu = torch.tensor([0, 100, 260], dtype=torch.int32, device="cuda")
    qv, kv = _randn(gen, 300, 4, 64), _randn(gen, 260, 2, 64)
    op = torch.randn(3, 2, 10, 4, 64, device="cuda")
    lp = torch.randn(3, 2, 10, 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        out.backward(torch.randn_like(out))
        outv = flash_attn_varlen_func(qv, kv, kv, cu, cu, 160, 160, causal=True)
        _, lse, _, _ = _flash_attn_varlen_forward(qv, kv, kv, cu, cu, 160, 160, 0.0, None,
                                                  True, zero_tensors=True)
        flashattn.flash_attn_combine(op, lp)
        torch.ops.flashattn.fwd(q.detach(), k.detach(), v.detach(), None, None, None, 0.0,
                                None, False, -1, -1, 0.0, False, False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(q.grad.float()).all() and torch.isfinite(sink.grad).all()
    assert torch.isinf(lse[:, 260:]).all() and torch.isfinite(lse[:, :260]).all()
    assert torch.isfinite(outv[:260].float()).all()


# --------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention through torch's registry


def _sdpa_spy(monkeypatch):
    from flashattn import _core

    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = _core.forward, _core.backward

    def counting_fwd(*a, **kw):
        calls["fwd"] += 1
        return fwd(*a, **kw)

    def counting_bwd(*a, **kw):
        calls["bwd"] += 1
        return bwd(*a, **kw)

    monkeypatch.setattr(_core, "forward", counting_fwd)
    monkeypatch.setattr(_core, "backward", counting_bwd)
    return calls


def _sdpa_grads(q, k, v, dout, **kw):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        return out, torch.autograd.grad(out, (q, k, v), dout)


SDPA_CASES = [
    dict(shape=(2, 4, 4, 256, 256, 64), kw=dict()),
    dict(shape=(2, 8, 8, 300, 300, 128), kw=dict(is_causal=True)),
    dict(shape=(1, 8, 2, 200, 200, 64), kw=dict(is_causal=True, enable_gqa=True)),
    dict(shape=(2, 2, 2, 100, 180, 64), kw=dict(scale=0.2)),
    dict(shape=(1, 4, 4, 128, 128, 256), kw=dict(is_causal=True)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", SDPA_CASES, ids=["plain", "causal", "gqa", "scale", "d256"])
def test_sdpa_activation_routes_cuda_to_flashattn(gen, monkeypatch, dtype, case):
    """Registered, never active on import; activated, F.scaled_dot_product_attention on CUDA
    tensors runs flashattn (the spy counts its calls) and matches torch's own flash kernels,
    layouts included; restored, torch's kernels again."""
    from flashattn import _sdpa
    import torch.nn.attention as attention

    if not _sdpa.available():
        pytest.skip("torch %s has no register_flash_attention_impl / get_kernel"
                    % torch.__version__)
    b, h, hk, sq, sk, d = case["shape"]
    q = _randn(gen, b, h, sq, d, dtype=dtype, grad=True)
    k = _randn(gen, b, hk, sk, d, dtype=dtype, grad=True)
    v = _randn(gen, b, hk, sk, d, dtype=dtype, grad=True)
    dout = _randn(gen, b, h, sq, d, dtype=dtype)
    calls = _sdpa_spy(monkeypatch)
    assert "flashattn" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() is None
    try:
        want, want_grads = _sdpa_grads(q, k, v, dout, **case["kw"])
    except RuntimeError as e:  # this torch's flash backend does not take the case
        pytest.skip("torch's flash backend: %s" % str(e).splitlines()[0])
    assert calls == {"fwd": 0, "bwd": 0}
    attention.activate_flash_attention_impl("flashattn")
    try:
        assert attention.current_flash_attention_impl() == "flashattn"
        got, grads = _sdpa_grads(q, k, v, dout, **case["kw"])
    finally:
        attention.restore_flash_attention_impl()
    assert calls["fwd"] == 1 and calls["bwd"] == 1, calls
    assert got.stride() == want.stride()
    tol = TOL[dtype]
    assert _max_rel(got, want) < tol * 2
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert g.stride() == w.stride(), name
        assert _max_rel(g, w) < tol * 4, name
    assert attention.current_flash_attention_impl() is None
    _sdpa_grads(q, k, v, dout, **case["kw"])
    assert calls == {"fwd": 1, "bwd": 1}


def test_sdpa_dropout_goes_to_torch(gen, monkeypatch):
    from flashattn import _sdpa
    import torch.nn.attention as attention

    if not _sdpa.available():
        pytest.skip("torch %s has no register_flash_attention_impl" % torch.__version__)
    q, k, v = (_randn(gen, 2, 4, 128, 64, grad=True) for _ in range(3))
    calls = _sdpa_spy(monkeypatch)
    attention.activate_flash_attention_impl("flashattn")
    try:
        out, grads = _sdpa_grads(q, k, v, torch.randn_like(q), dropout_p=0.2)
    finally:
        attention.restore_flash_attention_impl()
    assert calls == {"fwd": 0, "bwd": 0}
    assert torch.isfinite(out.float()).all() and all(torch.isfinite(g.float()).all()
                                                     for g in grads)


# --------------------------------------------------------------------------------------------
# DLPack: CuPy and JAX device arrays in, the same kind out


def _torch_qkv(gen, dtype):
    return (_randn(gen, 2, 150, 4, 64, dtype=dtype), _randn(gen, 2, 170, 2, 64, dtype=dtype),
            _randn(gen, 2, 170, 2, 64, dtype=dtype))


def test_dlpack_cupy(gen):
    cupy = pytest.importorskip("cupy")
    q, k, v = _torch_qkv(gen, torch.float16)  # CuPy has no bf16
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    out = flash_attn_func(cq, ck, cv, causal=True)
    assert isinstance(out, cupy.ndarray) and out.shape == (2, 150, 4, 64)
    assert out.dtype == cupy.float16 and out.device.id == q.device.index
    assert torch.equal(torch.from_dlpack(out), flash_attn_func(q, k, v, causal=True))
    out, lse, S = flash_attn_func(cq, ck, cv, return_attn_probs=True)
    assert isinstance(lse, cupy.ndarray) and lse.dtype == cupy.float32
    assert torch.equal(torch.from_dlpack(lse),
                       flash_attn_func(q, k, v, return_attn_probs=True)[1])
    assert cupy.isfinite(out).all() and S.size == 0


def test_dlpack_jax(gen):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    dev = torch.cuda.current_device()
    gpus = [d for d in jax.devices() if d.platform == "gpu" and d.id == dev]
    # JAX's start-up can leave another GPU's context current on this thread (seen with two).
    torch.cuda.set_device(dev)
    if not gpus:
        pytest.skip("JAX sees no GPU %d (%s)" % (dev, jax.devices()))
    q, k, v = _torch_qkv(gen, torch.bfloat16)
    jq, jk, jv = (jax.device_put(jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16),
                                 gpus[0]) for x in (q, k, v))
    out = flash_attn_func(jq, jk, jv, causal=True, window_size=(50, 0))
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16
    assert out.shape == (2, 150, 4, 64) and list(out.devices())[0].platform == "gpu"
    want = flash_attn_func(q, k, v, causal=True, window_size=(50, 0))
    got = torch.from_dlpack(out)
    assert got.is_cuda and torch.equal(got, want)


# ---- flex_attention: the CUDA forward with user-defined scoring -------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_flex_attention_cuda_forward(gen, dtype):
    """flex_attention on CUDA tensors without gradients runs the C forward on the GPU (the mods
    compiled into its kernel): a document mask read from a captured int tensor, a
    relative-position bias from a captured float table (indices past it clamped), a block mask
    built on the host and given to the call on the device, GQA; against the same call on the
    CPU tensors."""
    B, H, HK, L, D = 2, 4, 2, 300, 64
    g = torch.Generator().manual_seed(39)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k = torch.randn(B, HK, L, D, generator=g).to(dtype)
    v = torch.randn(B, HK, L, D, generator=g).to(dtype)
    doc = torch.cumsum((torch.rand(B, L, generator=g) < 0.02).int(), 1).int()
    bias = torch.randn(H, 81, generator=g)

    def outputs(device):
        d, t = doc.to(device), bias.to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (d[b, q_idx] == d[b, kv_idx]) & (q_idx >= kv_idx)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + t[h, q_idx - kv_idx + 40]

        bm = flashattn.create_block_mask(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=64)
        with torch.no_grad():
            return flashattn.flex_attention(q.to(device), k.to(device), v.to(device),
                                            score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                            return_lse=True)

    out_cpu, lse_cpu = outputs("cpu")
    out_gpu, lse_gpu = outputs("cuda")
    assert out_gpu.device.type == "cuda" and lse_gpu.device.type == "cuda"
    _close(out_gpu, out_cpu, dtype, "flex out")
    _lse_close(lse_gpu, lse_cpu)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["document+relpos", "prefix+softcap", "alibi causal"])
def test_flex_attention_cuda_backward(gen, dtype, kind):
    """flex_attention's gradients on CUDA tensors (the C backward on the GPU, the mods compiled
    into its kernel): dq, dk, dv against the same call's on the CPU tensors, with a block mask
    where the case has a mask_mod, GQA; the captured tensors get no gradient."""
    B, H, HK, L, D = 2, 4, 2, 300, 64 if kind != "prefix+softcap" else 128
    g = torch.Generator().manual_seed(41)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k = torch.randn(B, HK, L, D, generator=g).to(dtype)
    v = torch.randn(B, HK, L, D, generator=g).to(dtype)
    dout = torch.randn(B, H, L, D, generator=g).to(dtype)
    doc = torch.cumsum((torch.rand(B, L, generator=g) < 0.02).int(), 1).int()
    bias = torch.randn(H, 81, generator=g)

    def grads(device):
        d, t = doc.to(device), bias.to(device)
        score_mod = mask_mod = None
        if kind == "document+relpos":
            def mask_mod(b, h, q_idx, kv_idx):
                return (d[b, q_idx] == d[b, kv_idx]) & (q_idx >= kv_idx)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + t[h, q_idx - kv_idx + 40]
        elif kind == "prefix+softcap":
            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx < 37) | (q_idx >= kv_idx)

            def score_mod(score, b, h, q_idx, kv_idx):
                return 20 * torch.tanh(score / 20)
        else:
            def score_mod(score, b, h, q_idx, kv_idx):
                slope = torch.exp2(-(h + 1).float())
                return torch.where(q_idx >= kv_idx, score - slope * (q_idx - kv_idx).abs(),
                                   -float("inf"))
        bm = (flashattn.create_block_mask(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=64)
              if mask_mod is not None else None)
        x = [t.detach().to(device).clone().requires_grad_() for t in (q, k, v)]
        out = flashattn.flex_attention(*x, score_mod=score_mod, block_mask=bm, enable_gqa=True)
        out.backward(dout.to(device))
        return out, [t.grad for t in x]

    out_cpu, g_cpu = grads("cpu")
    out_gpu, g_gpu = grads("cuda")
    _close(out_gpu, out_cpu, dtype, "flex out")
    for name, a, b in zip(("dq", "dk", "dv"), g_gpu, g_cpu):
        assert a.device.type == "cuda"
        scale = b.float().abs().max().item()
        err = (a.cpu().float() - b.float()).abs().max().item()
        tol = 3e-2 if dtype == torch.bfloat16 else 6e-3
        assert err <= tol * max(scale, 1e-3), "%s: max |gpu - cpu| %.3g, scale %.3g" % (
            name, err, scale)


def test_create_block_mask_built_on_cuda(gen):
    """create_block_mask(device="cuda") evaluates the mask on the device (captured tensors on the
    CPU or the device): every field equal to the CPU build's and to torch's create_block_mask
    on CUDA."""
    tflex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, H, L = 2, 4, 700
    g = torch.Generator().manual_seed(47)
    doc = torch.cumsum((torch.rand(B, L, generator=g) < 0.01).int(), 1)
    win = torch.randint(16, 200, (H,), generator=g)
    for where in ("cpu", "cuda"):
        d, w = doc.to(where), win.to(where)

        def mask_mod(b, h, q_idx, kv_idx):
            return (d[b, q_idx] == d[b, kv_idx]) & (q_idx - kv_idx < w[h]) & (q_idx >= kv_idx)

        for bs in (128, (64, 32)):
            gpu = flashattn.create_block_mask(mask_mod, B, H, L, L, device="cuda", BLOCK_SIZE=bs)
            cpu = flashattn.create_block_mask(mask_mod, B, H, L, L, device="cpu", BLOCK_SIZE=bs)
            # torch's indexes the captures on the device: only where they live there
            ref = (tflex.create_block_mask(mask_mod, B, H, L, L, device="cuda", BLOCK_SIZE=bs)
                   if where == "cuda" else None)
            for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                      "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
                x = getattr(gpu, f)
                assert x.is_cuda and x.dtype == torch.int32, f
                assert torch.equal(x.cpu(), getattr(cpu, f)), f
                assert ref is None or torch.equal(x, getattr(ref, f)), f


FLEX_DOC = torch.zeros(300, dtype=torch.int32)
FLEX_BIAS = torch.zeros(4, 81)


def _flex_doc_mask(b, h, q_idx, kv_idx):
    return (FLEX_DOC[q_idx] == FLEX_DOC[kv_idx]) & (q_idx >= kv_idx)


def _flex_relpos(score, b, h, q_idx, kv_idx):
    return score + FLEX_BIAS[h, q_idx - kv_idx + 40]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flex_attention_cuda_compiled(gen, dtype):
    """flex_attention under torch.compile(fullgraph) on CUDA tensors (torch.ops.flashattn.flex_fwd
    and flex_bwd): out and lse bitwise the eager call's; dq, dk, dv to the rounding that the
    backward's accumulation order leaves (its fp32 additions are not ordered across CTAs)."""
    global FLEX_DOC, FLEX_BIAS
    B, H, HK, L, D = 2, 4, 2, 300, 64
    g = torch.Generator().manual_seed(43)
    FLEX_DOC = torch.cumsum((torch.rand(L, generator=g) < 0.02).int(), 0).int().cuda()
    FLEX_BIAS = torch.randn(H, 81, generator=g).cuda()
    q = torch.randn(B, H, L, D, generator=g).to(dtype).cuda()
    k, v = (torch.randn(B, HK, L, D, generator=g).to(dtype).cuda() for _ in range(2))
    dout = torch.randn(B, H, L, D, generator=g).to(dtype).cuda()
    bm = flashattn.create_block_mask(_flex_doc_mask, 1, None, L, L, device="cuda", BLOCK_SIZE=64)

    def call(q, k, v):
        return flashattn.flex_attention(q, k, v, score_mod=_flex_relpos, block_mask=bm,
                                        enable_gqa=True, return_lse=True)

    results = []
    for f in (call, torch.compile(call, fullgraph=True)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = f(*x)
        out.backward(dout)
        results.append([out, lse] + [t.grad for t in x])
    for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert c.is_cuda, name
        assert torch.equal(c, e) if name in ("out", "lse") else _max_rel(c, e) < 1e-2, name


# --------------------------------------------------------------------------------------------
# FP8 (e4m3) forward on Hopper

FP8_CASES = [
    # (b, s, h, hk, d, causal, window, softcap, varlen)
    (2, 300, 8, 2, 128, False, (-1, -1), 0.0, False),
    (1, 513, 4, 4, 64, True, (-1, -1), 0.0, False),
    (2, 200, 4, 2, 256, False, (-1, -1), 15.0, False),
    (1, 300, 4, 2, 128, True, (64, 0), 0.0, False),
    (3, 190, 4, 2, 128, True, (-1, -1), 0.0, True),
]


def _dequant(x, descale):
    """x (b, s, heads, d) fp8 times its (b, hk) descale, each kv head's for its group: fp32."""
    group = x.shape[2] // descale.shape[1]
    return x.float() * descale.repeat_interleave(group, dim=1)[:, None, :, None]


@pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0),
                    reason="the fp8 forward is a Hopper kernel")
@pytest.mark.parametrize("case", FP8_CASES, ids=[str(i) for i in range(len(FP8_CASES))])
def test_fp8_forward_cuda_matches_cpu(gen, case, monkeypatch):
    """e4m3 q, k, v with descales on CUDA tensors (the Hopper fp8 kernel) beside the CPU
    library's fp8 forward on copies (P rounded to e4m3 alike), both against an fp32 attention
    of the dequantised inputs: FA3's criterion, the GPU's error at most twice the CPU's plus
    bf16's rounding of out. Dense calls also with V transposed into the workspace ahead of the
    kernel (FLASHATTN_SM90_FP8_VT=1), held to the same criterion: its rows take longer key
    blocks (src/plan/fa_plan.c, fa_sm90_fp8_vt_rows), so the sums run in another order."""
    from flashattn import fa3

    b, s, h, hk, d, causal, window, softcap, varlen = case
    q = (torch.rand(b, s, h, d, generator=gen) * 4 - 2).to(torch.float8_e4m3fn)
    k = (torch.rand(b, s, hk, d, generator=gen) * 4 - 2).to(torch.float8_e4m3fn)
    v = (torch.rand(b, s, hk, d, generator=gen) * 4 - 2).to(torch.float8_e4m3fn)
    ds = [torch.rand(b, hk, generator=gen) * 0.5 + 0.25 for _ in range(3)]
    kw = dict(causal=causal, window_size=window, softcap=softcap, q_descale=ds[0],
              k_descale=ds[1], v_descale=ds[2])
    ref_in = (_dequant(q, ds[0]), _dequant(k, ds[1]), _dequant(v, ds[2]))
    ref_kw = dict(causal=causal, window_size=window, softcap=softcap,
                  softmax_scale=1 / math.sqrt(d))
    if varlen:
        lens = torch.tensor([0] + [s - 37 * i for i in range(b)], dtype=torch.int32)
        cu = torch.cumsum(lens, 0, dtype=torch.int32)
        rows = torch.cat([torch.arange(i * s, i * s + int(lens[i + 1])) for i in range(b)])
        flat = lambda t: t.reshape(b * s, *t.shape[2:])[rows]  # noqa: E731
        ms = int(lens.max())

        def run(x, y, z, dev, **a):
            return fa3.flash_attn_varlen_func(flat(x).to(dev), flat(y).to(dev), flat(z).to(dev),
                                              cu.to(dev), cu.to(dev), ms, ms,
                                              **{n: (t.to(dev) if torch.is_tensor(t) else t)
                                                 for n, t in a.items()})
        ref = run(*ref_in, "cpu", **ref_kw)
    else:
        def run(x, y, z, dev, **a):
            return fa3.flash_attn_func(x.to(dev), y.to(dev), z.to(dev),
                                       **{n: (t.to(dev) if torch.is_tensor(t) else t)
                                          for n, t in a.items()})
        ref = run(*ref_in, "cpu", **ref_kw)
    out_c = run(q, k, v, "cpu", **kw)
    monkeypatch.setenv("FLASHATTN_SM90_FP8_VT", "0")
    out_g = run(q, k, v, "cuda", **kw)
    if not varlen:
        monkeypatch.setenv("FLASHATTN_SM90_FP8_VT", "1")
        out_vt = run(q, k, v, "cuda", **kw)
    assert out_g.is_cuda and out_g.dtype == torch.bfloat16 and out_g.shape == out_c.shape
    err_c = (out_c.float() - ref.float()).abs().max().item()
    for out in (out_g,) if varlen else (out_g, out_vt):
        assert out.shape == out_c.shape
        err_g = (out.cpu().float() - ref.float()).abs().max().item()
        assert err_g <= 2 * err_c + 2.0 ** -8, (err_g, err_c)
