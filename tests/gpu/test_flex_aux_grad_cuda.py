"""Gradients of score_mod's captured tensors on CUDA (the C backward's mod_aux_grad on the GPU,
added by fp32 atomics from the backward's element-wise step): a relative-position bias table
(each lane its own element, a thread's two elements at one kv - q added together), a per-key
bias (elements at the same key, which that pairing does not join) and a per-head scale (one
element per warp, whose derivative is the score), with and without a block mask, GQA, both
backward families; against the same call on the CPU tensors, whose backward sums in double.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 -m pytest tests/gpu/test_flex_aux_grad_cuda.py
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

import flashattn  # noqa: E402

# |gpu - cpu| over the largest |cpu| gradient: P and dP come from fp16 / bf16 products on the
# GPU (as the dq, dk, dv comparisons of test_python_cuda.py)
TOL = {torch.float16: 6e-3, torch.bfloat16: 3e-2}


def _grads(device, inputs, masked, B, L):
    """out and the gradients of q, k, v, the table, the head scale and the key bias, on
    device."""
    q, k, v, dout, table, head_scale, key_bias, doc = (x.to(device) for x in inputs)
    leaves = [x.detach().clone().requires_grad_()
              for x in (q, k, v, table, head_scale, key_bias)]
    qx, kx, vx, tx, sx, kbx = leaves

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * sx[h] + tx[h, kv_idx - q_idx + L] + kbx[b, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    bm = (flashattn.create_block_mask(mask_mod, B, None, L, L, device=device, BLOCK_SIZE=64)
          if masked else None)
    out = flashattn.flex_attention(qx, kx, vx, score_mod=score_mod, block_mask=bm,
                                   enable_gqa=True)
    out.backward(dout)
    return out, [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "document"])
@pytest.mark.parametrize("d, family", [(64, "1"), (128, "1"), (128, "0")],
                         ids=["d64", "d128", "d128-sm80"])
def test_captured_gradients_on_cuda(gen, monkeypatch, dtype, masked, d, family):
    """family "0": FLASHATTN_BWD_SM90=0, the sm80 family on Hopper too."""
    monkeypatch.setenv("FLASHATTN_BWD_SM90", family)
    B, H, HK, L = 2, 4, 2, 300
    q = torch.randn(B, H, L, d, generator=gen).to(dtype)
    k = torch.randn(B, HK, L, d, generator=gen).to(dtype)
    v = torch.randn(B, HK, L, d, generator=gen).to(dtype)
    dout = torch.randn(B, H, L, d, generator=gen).to(dtype)
    table = torch.randn(H, 2 * L, generator=gen)
    head_scale = 1 + 0.3 * torch.randn(H, generator=gen)
    key_bias = torch.randn(B, L, generator=gen)
    doc = torch.cumsum((torch.rand(B, L, generator=gen) < 0.02).int(), 1).int()
    inputs = (q, k, v, dout, table, head_scale, key_bias, doc)
    out_cpu, g_cpu = _grads("cpu", inputs, masked, B, L)
    out_gpu, g_gpu = _grads("cuda", inputs, masked, B, L)
    torch.testing.assert_close(out_gpu.cpu().float(), out_cpu.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    for name, a, b in zip(("dq", "dk", "dv", "dtable", "dhead_scale", "dkey_bias"), g_gpu,
                          g_cpu):
        assert a is not None and a.device.type == "cuda" and a.dtype == b.dtype, name
        scale = b.float().abs().max().item()
        assert scale > 0, name
        err = (a.cpu().float() - b.float()).abs().max().item()
        assert err <= TOL[dtype] * scale, "%s: max |gpu - cpu| %.3g, scale %.3g" % (
            name, err, scale)
    dtable = g_gpu[3].cpu()
    assert torch.all(dtable[:, 0] == 0)  # kv - q + L is never 0: nothing added there
    if not masked:
        assert torch.all(dtable[:, 1:] != 0)


def test_second_call_zeroes_gradients(gen):
    """Each backward writes the gradient afresh (the kernel adds into a zeroed tensor): two
    calls on the same inputs give the same table gradient twice, not its sum."""
    B, H, L, D = 1, 2, 200, 64
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(torch.bfloat16).cuda()
               for _ in range(3))
    table = torch.randn(H, 2 * L, generator=gen).cuda().requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + L]

    got = []
    for _ in range(2):
        table.grad = None
        flashattn.flex_attention(q, k, v, score_mod=score_mod).float().sum().backward()
        got.append(table.grad.clone())
    assert got[0].abs().max() > 0
    torch.testing.assert_close(got[1], got[0], atol=1e-5, rtol=1e-5)


REL = torch.zeros(4, 400)


def _rel_bias(score, b, h, q_idx, kv_idx):
    return score + REL[h, kv_idx - q_idx + 200]


def test_captured_gradients_compiled_on_cuda(gen):
    """Under torch.compile(fullgraph) a captured table requiring grad is an input of the ops
    (flex_fwd / flex_bwd): its gradient equal to the eager call's on CUDA (the same kernels;
    atomics in another order, so to fp32 rounding); out bitwise, q's gradient to its rounding
    (dQ too is added by atomics)."""
    global REL
    B, H, L, D = 2, 4, 200, 64
    REL = torch.randn(H, 400, generator=gen).cuda().requires_grad_()
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(torch.bfloat16).cuda()
               for _ in range(3))

    def call(q, k, v):
        return flashattn.flex_attention(q, k, v, score_mod=_rel_bias)

    got = []
    for f in (torch.compile(call, fullgraph=True), call):
        qx = q.clone().requires_grad_()
        REL.grad = None
        out = f(qx, k, v)
        (out.float() * out.detach().float().sin()).sum().backward()
        got.append((out, qx.grad, REL.grad))
    (oc, qc, tc), (oe, qe, te) = got
    assert torch.equal(oc, oe)
    torch.testing.assert_close(qc.float(), qe.float(), atol=1e-2 * qe.abs().max().item(),
                               rtol=1e-2)
    assert tc is not None and tc.abs().max() > 0
    torch.testing.assert_close(tc, te, atol=1e-5 * te.abs().max().item(), rtol=1e-4)
