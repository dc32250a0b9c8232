"""flash_attn_func's C fast path (python/flashattn/_fastpath.c): once a call signature is
prepared in Python, later calls run in C. Each test checks the C path's answer against the
Python path's on the same inputs (the C path turned off), bitwise, and that the C path, not
the Python route (_torch_ops.dense, where C hands the calls it does not serve), served it."""
import ctypes

import numpy as np
import pytest
import torch

from flashattn import FlashAttnError, _cached, _route, _torch_ops, flash_attn_func


@pytest.fixture
def c_path(monkeypatch):
    """A record of each flash_attn_func call's path (True: served in C; False: the Python
    route), the extension required."""
    flash_attn_func(*(torch.randn(1, 2, 1, 8) for _ in range(3)))  # loads the torch ops
    real_c = _route.DENSE_C
    assert real_c is not None, "the C fast path (python/flashattn/_fastpath.c) was not built"
    served, in_route = [], []

    def route_spy(real):
        def spy(*args, **kwargs):
            in_route.append(True)
            return real(*args, **kwargs)
        return spy

    def c_spy(*args):
        in_route.clear()
        out = real_c(*args)
        served.append(not in_route)
        return out

    monkeypatch.setattr(_torch_ops, "dense", route_spy(_torch_ops.dense))  # torch tensors
    monkeypatch.setattr(_route, "forward", route_spy(_route.forward))  # NumPy arrays
    monkeypatch.setattr(_route, "DENSE_C", c_spy)
    return served


def _python_path(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(_route, "DENSE_C", None)
        return flash_attn_func(*args, **kwargs)


def _randn(rng, *shape, dtype=torch.float32):
    return torch.tensor(rng.standard_normal(shape), dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_second_call_runs_in_c_and_matches(rng, monkeypatch, c_path, dtype):
    """Strided views, GQA, d not a multiple of 8, every option the path takes: the second call
    of each signature is served in C, with the Python path's bits."""
    base = _randn(rng, 2, 13, 6, 40, dtype=dtype)
    q = base[:, :, 1:5, 3:23]                      # strided view: (2, 13, 4, 20)
    k = _randn(rng, 2, 17, 2, 20, dtype=dtype)
    v = _randn(rng, 17, 2, 3, 24, dtype=dtype).transpose(0, 1)[:, :, 1:3, 2:22]  # (2, 17, 2, 20)
    options = [dict(), dict(causal=True), dict(window_size=(3, 0), softmax_scale=0.25),
               dict(softcap=5, softmax_scale=1), dict(window_size=[2, 2])]
    for kw in options:
        first = flash_attn_func(q, k, v, **kw)
        c_path.clear()
        second = flash_attn_func(q, k, v, **kw)
        assert c_path == [True], kw
        expect = _python_path(monkeypatch, q, k, v, **kw)
        assert torch.isfinite(second).all() and not torch.equal(second, torch.zeros_like(second))
        assert torch.equal(second, expect) and torch.equal(second, first), kw


def test_in_place_changes_of_a_tensor_are_seen(rng, monkeypatch, c_path):
    """The same tensor objects with new shapes, strides or dtype in place: never the stale
    prepared call."""
    q, k, v = (_randn(rng, 1, 12, 2, 16) for _ in range(3))
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    q.transpose_(1, 2).transpose_(1, 2)  # same layout back: still the prepared call
    c_path.clear()
    flash_attn_func(q, k, v)
    assert c_path == [True]
    k.resize_(1, 9, 2, 16).normal_()    # fewer keys
    v.set_(_randn(rng, 1, 9, 2, 16))    # new storage
    q.data = _randn(rng, 1, 12, 2, 16, dtype=torch.bfloat16)  # new dtype behind the object
    k.data, v.data = k.data.bfloat16(), v.data.bfloat16()
    c_path.clear()
    got = flash_attn_func(q, k, v)
    assert c_path == [False] and got.dtype == torch.bfloat16 and got.shape == (1, 12, 2, 16)
    again = flash_attn_func(q, k, v)
    assert c_path == [False, True]
    assert torch.equal(got, again) and torch.equal(again, _python_path(monkeypatch, q, k, v))


def test_negative_view_takes_the_python_path(rng, monkeypatch, c_path):
    """A tensor with the negative bit (as the imaginary part of a conjugate view has it), with
    the strides of a plain twin whose signature is prepared, is never served as its twin."""
    plain, k, v = (_randn(rng, 1, 8, 2, 16) for _ in range(3))
    flash_attn_func(plain, k, v)
    flash_attn_func(plain, k, v)
    neg = torch._neg_view(plain)
    assert neg.is_neg() and neg.stride() == plain.stride()
    got = flash_attn_func(neg, k, v)
    assert torch.equal(got, _python_path(monkeypatch, -plain, k, v))
    assert not torch.equal(got, flash_attn_func(plain, k, v))


def test_library_failure_is_raised(rng, c_path):
    """A failing library call through the C path raises FlashAttnError and returns nothing."""
    q, k, v = (_randn(rng, 1, 8, 2, 16) for _ in range(3))
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    failing = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda args: 2)
    calls = [c for c in _cached._LOCAL.calls.values() if getattr(c, "fast", None) is not None]
    saved = [c.fast for c in calls]
    try:
        for c in calls:
            c.fast = ctypes.c_int64(ctypes.cast(failing, ctypes.c_void_p).value).value.to_bytes(
                8, "little", signed=True) + c.fast[8:]
        c_path.clear()
        with pytest.raises(FlashAttnError):
            flash_attn_func(q, k, v)
        assert c_path == []  # the C path raised: no answer recorded
    finally:
        for c, f in zip(calls, saved):
            c.fast = f
    assert torch.isfinite(flash_attn_func(q, k, v)).all()


def test_gradients_through_c_match_python(rng, monkeypatch, c_path):
    """A call that records gradients is handed from C to the autograd function, whose forward
    runs the prepared call with its lse in C too: out and every gradient as the Python path's."""
    q, k, v = (_randn(rng, 2, 9, 4, 24).requires_grad_() for _ in range(3))
    kv = dict(causal=True, window_size=(5, 0), softcap=3.0)
    dout = _randn(rng, 2, 9, 4, 24)
    lse_in_c, real_lse = [], _cached._DENSE_LSE
    monkeypatch.setattr(_cached, "_DENSE_LSE",
                        lambda *a: lse_in_c.append(real_lse(*a)) or lse_in_c[-1])
    results = []
    for path in ("python", "c", "c"):  # the second C call finds the signature prepared
        with monkeypatch.context() as m:
            if path == "python":
                m.setattr(_route, "DENSE_C", None)
                m.setattr(_cached, "_DENSE_LSE", None)
            c_path.clear()
            lse_in_c.clear()
            out = flash_attn_func(q, k, v, **kv)
            assert c_path == ([] if path == "python" else [True])
            results.append([out] + list(torch.autograd.grad(out, (q, k, v), dout)))
    assert lse_in_c and lse_in_c[-1] is not None  # the last forward ran in C with its lse
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.isfinite(a).all() and torch.equal(a, b)


def test_other_calls_go_to_python(rng, monkeypatch, c_path):
    """Dropout, probs, subclasses and NumPy arrays are not the C path's."""
    q, k, v = (_randn(rng, 1, 8, 2, 16) for _ in range(3))
    flash_attn_func(q, k, v)
    qg = q.clone().requires_grad_()
    for args, kw in (((q, k, v), dict(dropout_p=0.1)),
                     ((q, k, v), dict(return_attn_probs=True)),
                     ((torch.nn.Parameter(q), k, v), {})):
        c_path.clear()
        flash_attn_func(*args, **kw)
        assert c_path == [False], kw
    out = flash_attn_func(qg, k, v)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    for path in ("c", "python"):  # an int scale beyond a float: float()'s error either way
        with monkeypatch.context() as m:
            if path == "python":
                m.setattr(_route, "DENSE_C", None)
            with pytest.raises(OverflowError):
                flash_attn_func(q, k, v, softmax_scale=10**400)
    arrays = [x.numpy() for x in (q, k, v)]
    c_path.clear()
    got = flash_attn_func(*arrays)
    assert isinstance(got, np.ndarray) and c_path in ([], [False])


def test_split_workspace_is_given_per_call(rng, c_path):
    """A prepared call that splits its keys (a CUDA few-row call) gets a new workspace from
    torch on every call, written into its arguments before the library runs. On the CPU no
    call has one, so a prepared call is given one here; the CPU backend ignores it."""
    q, k, v = (_randn(rng, 1, 3, 2, 16) for _ in range(3))
    first = flash_attn_func(q, k, v)
    call = _cached._LOCAL.calls[_cached.dense_key(q, k, v, 0.0, None, False, (-1, -1), 0.0,
                                                  False)]
    call.ws_like = _cached._like(torch, (4096,), torch.uint8, q.device)
    call.fast = call._fast_fields()
    for _ in range(2):
        call.args.workspace = None
        c_path.clear()
        out = flash_attn_func(q, k, v)
        assert c_path == [True]
        assert call.args.workspace, "the C path wrote no workspace into the arguments"
        assert torch.equal(out, first)
