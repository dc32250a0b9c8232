"""The Python forward functions on torch CUDA tensors, against the CPU path on the same inputs.

Run by `make gpu-check` on a CUDA machine:
    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so python3 -m pytest tests/gpu
Skipped as a whole where torch sees no CUDA device. Both sides accumulate in fp32 and round the
output once; the GPU also rounds P to the input dtype before P V, so outputs agree to a few
units in the last place of fp16 / bf16 (the tolerances below), lse to fp32 rounding.
"""
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
from flashattn import _torch_ops  # noqa: E402,F401  (registers torch.ops.flashattn)

DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _close(gpu, cpu, dtype, what):
    tol = TOL[dtype]
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), atol=tol, rtol=tol, msg=what)


def _lse_close(gpu, cpu):
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-3, rtol=2e-3)


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


def test_current_stream_and_no_sync():
    q, k, v = (x.cuda() for x in _qkv(4, 1024, 1024, 8, 8, 128, 128, torch.float16, seed=9))
    ref = flash_attn_func(q, k, v, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        outs = [flash_attn_func(q, k, v, causal=True) for _ in range(3)]
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
