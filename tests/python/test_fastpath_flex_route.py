"""flex_attention's C fast path (python/flashattn/_fastpath_flex.c): which calls C serves and
which the Python route does (and hands to C), bitwise the route's answers, per thread."""

import threading

import pytest
import torch

import flashattn
from flashattn import FlashAttnError, _flex_prepared
from flexfast import (S, _Mod, path, qkv, randn, reference, window)  # noqa: F401


def test_served_calls_match_the_route(path, qkv, rng, monkeypatch):
    """Options, mods together, a bound method: the C answer is the Python route's, bitwise."""
    q, k, v = qkv
    bias = randn(rng, 64)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx - kv_idx).abs()]

    bm = flashattn.create_block_mask(window, None, None, S, S, BLOCK_SIZE=16)
    obj = _Mod(0.5)
    kv2 = k[:, :1].contiguous(), v[:, :1].contiguous()
    calls = [dict(score_mod=rel), dict(block_mask=bm), dict(score_mod=rel, block_mask=bm),
             dict(score_mod=rel, return_lse=True), dict(score_mod=rel, scale=0.3),
             dict(score_mod=obj.method, block_mask=bm), dict(score_mod=obj)]
    with torch.no_grad():
        for kw in calls:
            flashattn.flex_attention(q, k, v, **kw)
            flashattn.flex_attention(q, k, v, **kw)
            path.clear()
            got = flashattn.flex_attention(q, k, v, **kw)
            assert path == [True], kw
            with monkeypatch.context() as m:
                m.setattr(_flex_prepared, "FLEX_C", None)
                want = flashattn.flex_attention(q, k, v, **kw)
            for a, b in zip(*((got, want) if kw.get("return_lse") else ((got,), (want,)))):
                assert torch.equal(a, b), kw
        flashattn.flex_attention(q, *kv2, rel, enable_gqa=True)
        flashattn.flex_attention(q, *kv2, rel, enable_gqa=True)
        path.clear()
        got = flashattn.flex_attention(q, *kv2, rel, enable_gqa=True)
        assert path == [True]
        torch.testing.assert_close(got, reference(q, *kv2, rel), atol=2e-5, rtol=2e-5)
        with pytest.raises(ValueError, match="enable_gqa"):  # the flag is part of the key
            flashattn.flex_attention(q, *kv2, rel)


def test_route_takes_other_calls(path, qkv, rng):
    """A first call with gradients, NumPy inputs, a function of new captures at every call,
    kernel_options: the route."""
    q, k, v = qkv

    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5

    flashattn.flex_attention(q, k, v, halve)
    path.clear()
    qg = q.clone().requires_grad_()
    out = flashattn.flex_attention(qg, k, v, halve)
    assert path == [False] and out.requires_grad
    out.sum().backward()
    assert qg.grad is not None
    path.clear()
    flashattn.flex_attention(q.numpy(), k.numpy(), v.numpy(), halve)
    assert path == [False]
    for i in range(3):
        path.clear()
        s = 2.0 + i  # a new float object each time

        def scaled(score, b, h, q_idx, kv_idx):
            return score * s

        out = flashattn.flex_attention(q, k, v, scaled)
        assert path == [False]
    torch.testing.assert_close(out, reference(q, k, v, scaled), atol=2e-5, rtol=2e-5)
    with pytest.raises(FlashAttnError, match="kernel_options"):
        flashattn.flex_attention(q, k, v, halve, kernel_options={})


def test_calls_with_gradients(path, qkv, rng, monkeypatch):
    """A repeated call with gradients is served in C (its autograd Function applied to the
    route's call): out, lse and the gradients bitwise the route's. A captured tensor changed in
    place sends the next call to the route, which reads it (out and gradients against the
    reference's autograd), and C serves the call after. The same arguments without gradients
    are another entry."""
    q, k, v = qkv
    bias = randn(rng, 64)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx - kv_idx).abs()]

    bm = flashattn.create_block_mask(window, None, None, S, S, BLOCK_SIZE=16)
    dout = randn(rng, *q.shape)

    def run(kw):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        res = flashattn.flex_attention(*x, **kw)
        res = res if isinstance(res, tuple) else (res,)
        assert not any(t.grad_fn is None for t in res[:1])
        return res + torch.autograd.grad(res[0], x, dout)

    for kw in (dict(score_mod=rel, block_mask=bm), dict(score_mod=rel, return_lse=True)):
        run(kw)
        run(kw)
        path.clear()
        got = run(kw)
        assert path == [True], kw
        with monkeypatch.context() as m:
            m.setattr(_flex_prepared, "FLEX_C", None)
            want = run(kw)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), kw
    kw = dict(score_mod=rel, block_mask=bm)
    before = run(kw)
    bias.mul_(-2.0)
    path.clear()
    after = run(kw)
    assert path == [False], "the change was not noticed"
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*x, rel, window)
    for name, a, w in zip(("out", "dq", "dk", "dv"), after,
                          (ref,) + torch.autograd.grad(ref, x, dout)):
        torch.testing.assert_close(a, w, atol=2e-5, rtol=2e-5, msg=name)
    assert not torch.allclose(after[0], before[0], atol=1e-3)
    path.clear()
    again = run(kw)
    assert path == [True] and all(torch.equal(a, b) for a, b in zip(again, after))
    with torch.no_grad():
        path.clear()
        torch.testing.assert_close(flashattn.flex_attention(q, k, v, **kw), after[0])
        assert path == [False]


def test_capture_that_starts_requiring_grad(path, qkv, rng):
    """Grad mode on, inputs without gradients: served in C until a captured tensor requires
    grad, which the route takes (its gradient, on the CPU)."""
    bias = randn(rng, 2)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    flashattn.flex_attention(*qkv, head_bias)
    flashattn.flex_attention(*qkv, head_bias)
    path.clear()
    flashattn.flex_attention(*qkv, head_bias)
    assert path == [True]
    bias.requires_grad_()
    path.clear()
    out = flashattn.flex_attention(*qkv, head_bias)
    assert path == [False] and out.requires_grad


def test_each_thread_has_its_own_calls(path, qkv):
    def distance(score, b, h, q_idx, kv_idx):
        return score - (q_idx - kv_idx).abs() * 0.25

    results = []

    def run():
        with torch.no_grad():
            results.append([flashattn.flex_attention(*qkv, distance) for _ in range(3)])

    with torch.no_grad():
        mine = [flashattn.flex_attention(*qkv, distance) for _ in range(3)]
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert all(torch.equal(x, mine[0]) for x in mine + results[0])
    # per thread: the route twice, then C
    assert path == [False, False, True, False, False, True]
    torch.testing.assert_close(mine[0], reference(*qkv, distance), atol=2e-5, rtol=2e-5)


def test_calls_with_gradients_in_threads(rng):
    """Calls with gradients of one signature in three threads at once, each thread's forward
    and backward arguments its own: every gradient is its own inputs', against the reference's
    autograd, while the library runs without the GIL."""
    bias = randn(rng, 64)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx - kv_idx).abs()]

    bm = flashattn.create_block_mask(window, None, None, S, S, BLOCK_SIZE=16)
    inputs = [[randn(rng, 1, 2, S, 16) for _ in range(4)] for _ in range(3 * 16)]
    got, errors = {}, []

    def run(t):
        try:
            for i in range(t, len(inputs), 3):
                x = [a.clone().requires_grad_() for a in inputs[i][:3]]
                out = flashattn.flex_attention(*x, rel, block_mask=bm)
                got[i] = (out.detach(),) + torch.autograd.grad(out, x, inputs[i][3])
        except Exception as e:  # reported below, from the test's thread
            errors.append(e)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    for i, (q, k, v, dout) in enumerate(inputs):
        x = [a.clone().requires_grad_() for a in (q, k, v)]
        ref = reference(*x, rel, window)
        for name, a, w in zip(("out", "dq", "dk", "dv"), got[i],
                              (ref,) + torch.autograd.grad(ref, x, dout)):
            torch.testing.assert_close(a, w, atol=2e-5, rtol=2e-5, msg="%s of call %d"
                                       % (name, i))


def test_what_the_route_hands_to_c(path, qkv, rng, monkeypatch):
    """The route registers a call it meets the second time, and at once one whose entry served
    calls before a change; not a new function at every call, and a call whose capture changes
    at every call after twice as many calls each time."""
    registered = []
    real = _flex_prepared.register

    def register(call_args, p, checks, captured):
        if checks is not None:  # handed to C (else the route did not ask for checks)
            registered.append(1)
        real(call_args, p, checks, captured)

    monkeypatch.setattr(_flex_prepared, "register", register)
    bias = randn(rng, 64)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx - kv_idx).abs()]

    with torch.no_grad():
        for _ in range(4):
            flashattn.flex_attention(*qkv, rel)
        assert path == [False, False, True, True] and len(registered) == 1
        bias.add_(1)  # a change after calls were served: registered again at once
        path.clear()
        for _ in range(2):
            flashattn.flex_attention(*qkv, rel)
        assert path == [False, True] and len(registered) == 2
        path.clear()
        for _ in range(40):  # a change at every call: registered ever more seldom
            bias.add_(1)
            flashattn.flex_attention(*qkv, rel)
        assert path == [False] * 40 and len(registered) - 2 <= 6
        registered.clear()
        for i in range(8):  # a function of other captures at every call
            s = 2.0 + i
            flashattn.flex_attention(*qkv, lambda score, b, h, q_idx, kv_idx: score * s)
        assert registered == []


def test_a_function_made_at_each_call(path, qkv, rng):
    """A lambda made at every call (as in a model's forward) from the same code and captures is
    the same call to C: served from the third; its captures checked as any function's."""
    bias = randn(rng, 64)

    def forward(q, k, v):
        return flashattn.flex_attention(
            q, k, v, lambda score, b, h, q_idx, kv_idx: score + bias[(q_idx - kv_idx).abs()])

    def expect():
        return reference(*qkv, lambda score, b, h, q_idx, kv_idx:
                         score + bias[(q_idx - kv_idx).abs()])

    with torch.no_grad():
        outs = [forward(*qkv) for _ in range(4)]
        assert path == [False, False, True, True]
        assert all(torch.equal(o, outs[0]) for o in outs)
        torch.testing.assert_close(outs[0], expect(), atol=2e-5, rtol=2e-5)
        bias.mul_(-1)  # in place: noticed by the captured tensor's checks
        path.clear()
        out = forward(*qkv)
        assert path == [False]
        torch.testing.assert_close(out, expect(), atol=2e-5, rtol=2e-5)
        bias = randn(rng, 64)  # another tensor: another call to C
        path.clear()
        out = forward(*qkv)
        assert path == [False]
        torch.testing.assert_close(out, expect(), atol=2e-5, rtol=2e-5)


def test_two_changes_between_served_calls(path, rng, monkeypatch):
    """tests/gpu/test_flex_fastpath_cuda.py's sequence on the CPU: served in C, a captured
    tensor changed in place, then the block mask's tensors and mask_mod changed before C served
    a call again: each change is noticed, and C serves again from the call after."""
    L, D = 256, 64
    q, k, v = (randn(rng, 1, 4, L, D) for _ in range(3))
    bias = randn(rng, 4, 2 * L)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + L]

    bm = flashattn.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                     L, L, BLOCK_SIZE=64)

    def call():
        return flashattn.flex_attention(q, k, v, rel, block_mask=bm, return_lse=True)

    def route():
        with monkeypatch.context() as m:
            m.setattr(_flex_prepared, "FLEX_C", None)
            return call()

    with torch.no_grad():
        for _ in range(2):  # the route hands C a call it meets twice
            call()
        path.clear()
        out, lse = call()
        assert path == [True]
        want_out, want_lse = route()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)

        bias.mul_(-1)  # in place: the next call reads the new values
        path.clear()
        out2, _ = call()
        assert path == [False] and not torch.equal(out2, out)
        assert torch.equal(out2, route()[0])

        # C served no call since: the second change is not yet one at every call
        full = flashattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, None, None,
                                           L, L, BLOCK_SIZE=64)
        for name in _flex_prepared.BM_FIELDS:
            getattr(bm, name).copy_(getattr(full, name))
        bm.mask_mod = full.mask_mod
        path.clear()
        out3, _ = call()
        assert path == [False] and not torch.equal(out3, out2)
        assert torch.equal(out3, route()[0])
        path.clear()
        assert all(torch.equal(call()[0], out3) for _ in range(2))
        assert path == [True, True]
