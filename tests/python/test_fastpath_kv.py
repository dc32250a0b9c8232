"""flash_attn_with_kvcache's C fast path (python/flashattn/_fastpath_kv.c): once a call signature
is prepared in Python, later calls run in C, fp8 caches with their descales among them. Each test
checks the C path's answer (out, lse and the appended caches) against the Python path's on
copies of the same inputs, bitwise, and that the C path, not the Python route
(_torch_ops.kvcache_call, where C hands the calls it does not serve), served it."""
import ctypes

import pytest
import torch

from flashattn import FlashAttnError, _cached, _route, _torch_ops, flash_attn_with_kvcache


@pytest.fixture
def c_path(monkeypatch):
    """A record of each flash_attn_with_kvcache call's path (True: served in C; False: the
    Python route), the extension required."""
    q = torch.randn(1, 1, 2, 8)
    flash_attn_with_kvcache(q, torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))  # binds C
    real_c = _route.KVCACHE_C
    assert real_c is not None, "the C fast path (python/flashattn/_fastpath_kv.c) was not built"
    served, in_route = [], []
    real_route = _torch_ops.kvcache_call

    def route_spy(*args, **kwargs):
        in_route.append(True)
        return real_route(*args, **kwargs)

    def c_spy(*args):
        in_route.clear()
        out = real_c(*args)
        served.append(not in_route)
        return out

    monkeypatch.setattr(_torch_ops, "kvcache_call", route_spy)
    monkeypatch.setattr(_route, "KVCACHE_C", c_spy)
    return served


def _randn(rng, *shape, dtype=torch.float32):
    return torch.tensor(rng.standard_normal(shape), dtype=torch.float32).to(dtype)


def _case(rng, kind, dtype):
    """(tensors, options) of one call: b 3, 2 new rows, 4 query heads over 2 kv heads, d 16.
    fp8: e4m3 caches with both descales and rotary; fp8_paged: paged e5m2 caches with
    k_descale alone."""
    b, s_new, h, hk, d = 3, 2, 4, 2, 16
    t = dict(q=_randn(rng, b, s_new, h, d, dtype=dtype),
             k=_randn(rng, b, s_new, hk, d, dtype=dtype),
             v=_randn(rng, b, s_new, hk, d, dtype=dtype),
             cache_seqlens=torch.tensor([5, 0, 9], dtype=torch.int32))
    opts = dict(causal=True)
    if kind in ("paged", "fp8_paged"):
        pages, page = 9, 4
        t["k_cache"] = _randn(rng, pages, page, hk, d, dtype=dtype)
        t["v_cache"] = _randn(rng, pages, page, hk, d, dtype=dtype)
        t["block_table"] = torch.randperm(pages, dtype=torch.int32)[:b * 3].reshape(b, 3)
    else:
        cap = 12
        t["k_cache"] = _randn(rng, b + 1, cap, hk, d, dtype=dtype)
        t["v_cache"] = _randn(rng, b + 1, cap, hk, d, dtype=dtype)
    if kind in ("rotary", "fp8"):
        angle = _randn(rng, 16, 4).abs()
        t["rotary_cos"], t["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
        opts["rotary_interleaved"] = False
    if kind == "batch_idx":
        t["cache_batch_idx"] = torch.tensor([3, 0, 1], dtype=torch.int32)
        t["cache_leftpad"] = torch.tensor([1, 0, 2], dtype=torch.int32)
        t["cache_seqlens"] = torch.tensor([5, 2, 9], dtype=torch.int32)
    if kind == "options":
        t["alibi_slopes"] = _randn(rng, h).abs()
        t["learnable_sink"] = _randn(rng, h)
        opts.update(window_size=(3, 0), softcap=4, softmax_scale=0.3, num_splits=2)
    if kind == "no_append":
        del t["k"], t["v"]
        opts = dict(causal=False, window_size=[-1, -1])
    if kind.startswith("fp8"):
        code = torch.float8_e4m3fn if kind == "fp8" else torch.float8_e5m2
        for name in ("k_cache", "v_cache"):
            t[name] = t[name].float().to(code)
        t["k_descale"] = _randn(rng, b, hk).abs() + 0.25
        if kind == "fp8":
            t["v_descale"] = _randn(rng, b, hk).abs() + 0.25
    return t, opts


def _bits(x):
    """x's bytes, so that fp8 codes (and the sign of zero) compare exactly."""
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _run(tensors, opts, lse):
    """The call on copies of the caches (the append writes them): (out, lse or None, k_cache,
    v_cache)."""
    t = dict(tensors, k_cache=tensors["k_cache"].clone(), v_cache=tensors["v_cache"].clone())
    res = flash_attn_with_kvcache(**t, **opts, return_softmax_lse=lse)
    out, lse_out = res if lse else (res, None)
    return out, lse_out, t["k_cache"], t["v_cache"]


@pytest.mark.parametrize("kind", ["contiguous", "paged", "rotary", "batch_idx", "options",
                                  "no_append", "fp8", "fp8_paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_call_runs_in_c_and_matches(rng, monkeypatch, c_path, kind, dtype):
    """Every tensor the call takes and every option: the second call of a signature is served
    in C, with and without the lse, with the Python path's bits (out, lse and the caches)."""
    tensors, opts = _case(rng, kind, dtype)
    getattr(_cached._LOCAL, "calls", {}).clear()
    c_path.clear()
    first = _run(tensors, opts, True)
    assert c_path == [False]  # not prepared yet: the route prepares it
    with monkeypatch.context() as m:
        m.setattr(_route, "KVCACHE_C", None)
        expect = _run(tensors, opts, True)
    assert torch.isfinite(expect[0]).all() and expect[0].abs().sum() > 0
    for lse in (True, False, True):
        c_path.clear()
        got = _run(tensors, opts, lse)
        assert c_path == [True], lse
        assert got[1] is None if not lse else torch.equal(got[1], expect[1])
        for a, b in zip(got[::2] + first[::2], expect[::2] * 2):
            assert torch.equal(_bits(a), _bits(b)), (kind, lse)
        assert torch.equal(_bits(got[3]), _bits(expect[3]))


def test_new_tensors_each_call(rng, c_path):
    """The prepared call takes each call's tensors: new values give new answers, as the Python
    path would give them."""
    tensors, opts = _case(rng, "contiguous", torch.float32)
    _run(tensors, opts, False)
    outs = []
    for _ in range(2):
        tensors = dict(tensors, q=_randn(rng, *tensors["q"].shape))
        c_path.clear()
        outs.append(_run(tensors, opts, False)[0])
        assert c_path == [True]
    assert not torch.equal(outs[0], outs[1])


def test_other_calls_go_to_python(rng, c_path):
    """An int cache_seqlens, a Parameter, gradients, a non-bool flag: the route's, answered as
    the route answers them."""
    tensors, opts = _case(rng, "contiguous", torch.float32)
    _run(tensors, opts, False)
    _run(tensors, opts, False)
    variants = [dict(tensors, cache_seqlens=4), dict(tensors, q=torch.nn.Parameter(tensors["q"])),
                dict(tensors, q=tensors["q"].clone().requires_grad_())]
    for t in variants:
        c_path.clear()
        _run(t, opts, False)
        assert c_path == [False]
    c_path.clear()
    _run(tensors, dict(opts, causal=1), False)
    assert c_path == [False]


def test_bad_seqlens_are_refused_in_c(rng, c_path):
    """Values are checked by the library on every call: a prepared signature with cache_seqlens
    past the cache raises the route's error naming the argument, and writes nothing."""
    tensors, opts = _case(rng, "contiguous", torch.float32)
    _run(tensors, opts, False)
    bad = dict(tensors, cache_seqlens=torch.tensor([5, 11, 9], dtype=torch.int32))
    k_before = tensors["k_cache"].clone()
    c_path.clear()
    with pytest.raises(FlashAttnError, match="cache_seqlens"):
        flash_attn_with_kvcache(**bad, **opts)
    assert c_path == []  # the C path raised
    assert torch.equal(tensors["k_cache"], k_before)


def test_library_failure_is_raised(rng, c_path):
    """A failing library call through the C path raises FlashAttnError and returns nothing."""
    tensors, opts = _case(rng, "no_append", torch.float32)
    _run(tensors, opts, False)
    failing = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda args: 2)
    calls = [c for c in _cached._LOCAL.calls.values()
             if isinstance(c, _cached._CachedKvcache) and c.fast is not None]
    assert calls
    saved = [c.fast for c in calls]
    try:
        for c in calls:
            c.fast = ctypes.cast(failing, ctypes.c_void_p).value.to_bytes(8, "little") + c.fast[8:]
        c_path.clear()
        with pytest.raises(FlashAttnError):
            _run(tensors, opts, False)
        assert c_path == []
    finally:
        for c, f in zip(calls, saved):
            c.fast = f
    assert torch.isfinite(_run(tensors, opts, False)[0]).all()


def test_split_workspace_is_given_per_call(rng, c_path):
    """A prepared call that splits its keys (on CUDA) gets a new workspace from torch on every
    call, written into its arguments before the library runs. CPU calls have none, so a
    prepared call is given one here; the CPU backend ignores it."""
    tensors, opts = _case(rng, "no_append", torch.float32)
    first = _run(tensors, opts, False)[0]
    calls = [c for c in _cached._LOCAL.calls.values() if isinstance(c, _cached._CachedKvcache)]
    for call in calls:
        call.ws_like = _cached._like(torch, (4096,), torch.uint8, first.device)
        call.fast = call._fast_fields()
    for _ in range(2):
        for call in calls:
            call.args.workspace = None
        c_path.clear()
        out = _run(tensors, opts, False)[0]
        assert c_path == [True]
        assert any(call.args.workspace for call in calls), "no workspace written"
        assert torch.equal(out, first)


@pytest.mark.parametrize("c_on", [True, False], ids=["c", "python"])
def test_lse_after_a_call_without_it(rng, monkeypatch, c_path, c_on):
    """A call of a signature without the lse, then one with it: the second gets its own lse
    (each call on new queries, so a stale lse cannot pass), on the C path and on the Python
    path alike."""
    tensors, opts = _case(rng, "no_append", torch.float32)
    getattr(_cached._LOCAL, "calls", {}).clear()
    if not c_on:
        monkeypatch.setattr(_route, "KVCACHE_C", None)
    lses = []
    for lse in (True, False, True):
        tensors = dict(tensors, q=_randn(rng, *tensors["q"].shape))
        got = _run(tensors, opts, lse)
        if lse:
            lses.append(got[1])
            getattr(_cached._LOCAL, "calls", {}).clear()
            with monkeypatch.context() as m:  # a first call of the signature: prepared anew
                m.setattr(_route, "KVCACHE_C", None)
                want = _run(tensors, opts, True)[1]
            assert torch.equal(got[1], want)  # +inf for the sequence without keys
            _run(tensors, opts, True)  # prepared again for the next round
    assert not torch.equal(lses[0], lses[1])


def _fresh(monkeypatch, tensors, opts):
    """The route's answer (out, lse, k_cache, v_cache) on a signature prepared anew: no prepared
    call can be reused. It leaves the signature prepared."""
    getattr(_cached._LOCAL, "calls", {}).clear()
    with monkeypatch.context() as m:
        m.setattr(_route, "KVCACHE_C", None)
        return _run(tensors, opts, True)


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", ["fp8", "fp8_paged"])
def test_fp8_descales_are_read_per_call(rng, monkeypatch, c_path, kind):
    """The prepared call takes each call's descales: new scales (and queries) give the answer
    of a call prepared anew, bit for bit, served in C."""
    tensors, opts = _case(rng, kind, torch.bfloat16)
    _fresh(monkeypatch, tensors, opts)
    outs = []
    for _ in range(2):
        tensors = dict(tensors, q=_randn(rng, *tensors["q"].shape, dtype=torch.bfloat16),
                       k_descale=_randn(rng, *tensors["k_descale"].shape).abs() + 0.25)
        c_path.clear()
        got = _run(tensors, opts, True)
        assert c_path == [True]
        _assert_same(got, _fresh(monkeypatch, tensors, opts))
        outs.append(got[0])
    assert not torch.equal(outs[0], outs[1])


def test_descale_signature_is_exact(rng, monkeypatch, c_path):
    """A call whose descales differ from a prepared signature's in presence or strides is
    prepared anew rather than served from the other's arguments: its answer is that of a fresh
    preparation (a strided descale's gaps hold NaN, which a misread stride would let in), and
    its own repeat is then served in C."""
    tensors, opts = _case(rng, "fp8", torch.bfloat16)
    b, hk = tensors["k_descale"].shape
    wide = torch.full((b, 2 * hk), float("nan"))
    wide[:, ::2] = tensors["k_descale"]
    variants = [
        dict(tensors, v_descale=None),
        dict(tensors, k_descale=None, v_descale=None),
        dict(tensors, k_descale=wide[:, ::2]),  # strides (2 hk, 2): the last one not 1
        dict(tensors, k_descale=torch.cat([tensors["k_descale"], wide], 1)[:, :hk]),
        dict(tensors, v_descale=tensors["v_descale"][:1].expand(b, hk)),
    ]
    for t in variants:
        contiguous = {n: x.contiguous() if n.endswith("descale") and x is not None else x
                      for n, x in t.items()}
        want = _fresh(monkeypatch, contiguous, opts)
        _fresh(monkeypatch, tensors, opts)  # only the signature with both descales prepared
        calls = len(_cached._LOCAL.calls)
        c_path.clear()
        got = _run(t, opts, True)
        assert c_path == [False], "served from another signature's prepared arguments"
        _assert_same(got, want)
        if t["k_descale"] is None or t["k_descale"].stride(-1) == 1:
            assert len(_cached._LOCAL.calls) == calls + 1  # its own signature, prepared
            c_path.clear()
            _assert_same(_run(t, opts, True), want)
            assert c_path == [True]


def test_bad_descales_are_refused_by_name(rng, c_path):
    """Descales of the wrong dtype, shape, device or kind, after a good call of the signature
    was prepared: the route's error naming the descale, and nothing is appended."""
    tensors, opts = _case(rng, "fp8", torch.bfloat16)
    _run(tensors, opts, False)
    b, hk = tensors["k_descale"].shape
    bad = [
        (dict(k_descale=tensors["k_descale"].double()), FlashAttnError, "^k_descale"),
        (dict(v_descale=tensors["v_descale"].bfloat16()), FlashAttnError, "^v_descale"),
        (dict(v_descale=tensors["v_descale"][:, :1]), FlashAttnError, "^v_descale"),
        (dict(k_descale=tensors["k_descale"][:2]), FlashAttnError, "^k_descale"),
        (dict(k_descale=tensors["k_descale"].reshape(b * hk)), FlashAttnError, "^k_descale"),
        (dict(k_descale=torch.empty(b, hk, device="meta")), FlashAttnError, "^k_descale"),
        (dict(v_descale=tensors["v_descale"].numpy()), TypeError, "^v_descale"),
        (dict(v_descale=0.5), TypeError, "^v_descale"),
    ]
    k_before, v_before = tensors["k_cache"].clone(), tensors["v_cache"].clone()
    for change, error, match in bad:
        with pytest.raises(error, match=match):
            flash_attn_with_kvcache(**dict(tensors, **change), **opts)
        assert torch.equal(_bits(tensors["k_cache"]), _bits(k_before)), match
        assert torch.equal(_bits(tensors["v_cache"]), _bits(v_before)), match
    c_path.clear()
    _run(tensors, opts, False)
    assert c_path == [True]
