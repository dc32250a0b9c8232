"""flex_attention's C fast path (python/flashattn/_fastpath_flex.c): once a call is prepared in
Python, a repeated call with the same arguments runs in C while the checks its walk of the mods
recorded hold. Each test below serves a call in C, changes what the mods or the block mask
capture, and checks that the next call took the Python route (the change was noticed) and gives
the answer of the mods evaluated afresh; then that C serves the call again."""

import functools
import math
import threading

import pytest
import torch

import flashattn
from flashattn import FlashAttnError, _flex_prepared, _route, flex

B, H, S, D = 1, 2, 32, 16


@pytest.fixture
def path(monkeypatch):
    """A record of each flex_attention call's path (True: served in C; False: the Python
    route, which every call it serves enters through flex._check_inputs)."""
    flashattn.flash_attn_func(*(torch.randn(1, 2, 1, 8) for _ in range(3)))  # binds the C path
    real_c = _route.FLEX_C
    assert real_c is not None, "the C fast path (python/flashattn/_fastpath_flex.c) was not built"
    served, in_route = [], []
    check = flex._check_inputs
    monkeypatch.setattr(flex, "_check_inputs", lambda *a: in_route.append(1) or check(*a))

    def c_spy(*args):
        in_route.clear()
        out = real_c(*args)
        served.append(not in_route)
        return out

    monkeypatch.setattr(_route, "FLEX_C", c_spy)
    return served


@pytest.fixture
def qkv(rng):
    return tuple(torch.from_numpy(rng.standard_normal((B, H, S, D))).float() for _ in range(3))


def randn(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape)).float()


def reference(q, k, v, score_mod=None, mask_mod=None):
    """The mods evaluated afresh on broadcast index tensors (torch's FlexAttention compiles a
    mod that captures Python numbers, and refuses some of these), in fp64 but the mods."""
    b, h = torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None]
    q_idx, kv_idx = torch.arange(S)[:, None], torch.arange(S)[None, :]
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, 1).double() for x in (k, v))
    s = (q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).float()
    if score_mod is not None:
        s = score_mod(s, b, h, q_idx, kv_idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, q_idx, kv_idx), -math.inf)
    return (torch.softmax(s.double(), -1) @ v).float()


def assert_noticed(path, call, change, expect):
    """call() served in C (from its third call: the route hands C a call it meets the second
    time), then change(): the next call takes the route and gives expect() (which must differ
    from the answer before the change), and the calls after are served in C again with the
    same answer."""
    with torch.no_grad():
        before = call()
        assert torch.equal(call(), before)
        path.clear()
        assert torch.equal(call(), before) and path == [True], "not served in C"
        change()
        path.clear()
        after = call()
        assert path == [False], "the change was not noticed"
        torch.testing.assert_close(after, expect(), atol=2e-5, rtol=2e-5)
        assert not torch.allclose(after, before, atol=1e-3), "the change changes nothing"
        # served in C again from the next call, or (a function with new captures: a new key)
        # from the one after
        assert all(torch.equal(call(), after) for _ in range(2)) and path[-1], path


# A plain function as score_mod is keyed by its code and captures (its own reads need no
# checks); wrapped in functools.partial it is a function the walk reaches, whose reads are
# checked: both kinds of each change.
WRAPS = {"function": lambda f: f, "partial": functools.partial}

G_SCALE = 1.0
G_BIAS = None
G_WEIGHTS = [1.0]
G_CFG = {"a": 1.0}


def global_scale(score, b, h, q_idx, kv_idx):
    return score * G_SCALE


def global_bias(score, b, h, q_idx, kv_idx):
    return score + G_BIAS[(q_idx - kv_idx).abs()]


def global_weights(score, b, h, q_idx, kv_idx):
    return score * sum(G_WEIGHTS)


def global_cfg(score, b, h, q_idx, kv_idx):
    return score * sum(G_CFG.values())


def distance(score, b, h, q_idx, kv_idx):
    return score - abs(q_idx - kv_idx) * 0.25


def test_rebound_global_number(path, qkv):
    global G_SCALE
    G_SCALE = 1.0

    def change():
        global G_SCALE
        G_SCALE = 3.0

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, global_scale), change,
                   lambda: reference(*qkv, global_scale))


@pytest.mark.parametrize("wrap", WRAPS)
def test_rebound_closure_number(path, qkv, wrap):
    s = 1.0

    def mod(score, b, h, q_idx, kv_idx):
        return score * s

    mod = WRAPS[wrap](mod)

    def change():
        nonlocal s
        s = 0.25

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, mod), change,
                   lambda: reference(*qkv, mod))


@pytest.mark.parametrize("wrap", WRAPS)
def test_filled_closure_cell(path, qkv, wrap):
    """A closure variable not yet assigned (an empty cell, which the walk passes over) that is
    assigned later."""
    def mod(score, b, h, q_idx, kv_idx):
        try:
            return score * scale
        except NameError:  # not assigned yet
            return score

    mod = WRAPS[wrap](mod)

    def change():
        nonlocal scale
        scale = 3.0

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, mod), change,
                   lambda: reference(*qkv, mod))
    scale = None  # noqa: F841  (makes scale a variable of this function, so a cell of mod's)


def test_replaced_captured_tensor(path, qkv, rng):
    global G_BIAS
    G_BIAS = randn(rng, 64)

    def change():
        global G_BIAS
        G_BIAS = randn(rng, 64)  # same shape, another tensor

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, global_bias), change,
                   lambda: reference(*qkv, global_bias))


@pytest.mark.parametrize("wrap", WRAPS)
def test_replaced_closure_tensor(path, qkv, rng, wrap):
    bias = randn(rng, 64)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx - kv_idx).abs()]

    mod = WRAPS[wrap](mod)

    def change():
        nonlocal bias
        bias = randn(rng, 64)

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, mod), change,
                   lambda: reference(*qkv, mod))


@pytest.mark.parametrize("how", ["in place", "resized", "data", "data strides", "data shape"])
def test_changed_captured_tensor(path, qkv, rng, how):
    """Values changed in place (its version), resized in place (version and shape, which the
    mod reads), and swapped under the same object through .data, which keeps the version: new
    data, or the same data with other strides, or with another shape."""
    table = randn(rng, S, S)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx, kv_idx % table.shape[1]] * 2

    def change():
        if how == "in place":
            table.mul_(-1)
        elif how == "resized":
            table.resize_(S, S // 2 - 3)
        elif how == "data":
            table.data = randn(rng, S, S)
        elif how == "data shape":
            table.data = table.data[:, :S // 2 - 3]  # the same data pointer and strides
        else:
            version = table._version
            table.data = table.data.t()  # same data pointer and shape, the strides swapped
            assert table._version == version

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, mod), change,
                   lambda: reference(*qkv, mod))


def test_resized_tensor_read_for_its_shape(path, qkv):
    """A captured tensor the mod reads only for its shape (not an aux tensor)."""
    t = torch.zeros(2)

    def mod(score, b, h, q_idx, kv_idx):
        return score * t.shape[0]

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, mod),
                   lambda: t.resize_(5), lambda: reference(*qkv, mod))


@pytest.mark.parametrize("how", ["append", "replace"])
def test_captured_list(path, qkv, how):
    G_WEIGHTS[:] = [1.0]

    def change():
        if how == "append":
            G_WEIGHTS.append(2.0)
        else:
            G_WEIGHTS[0] = 0.5

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, global_weights), change,
                   lambda: reference(*qkv, global_weights))


@pytest.mark.parametrize("how", ["new key", "replace", "swap key"])
def test_captured_dict(path, qkv, how):
    G_CFG.clear()
    G_CFG["a"] = 1.0

    def change():
        if how == "new key":
            G_CFG["b"] = 2.0
        elif how == "replace":
            G_CFG["a"] = 0.5
        else:  # the same length, another key
            del G_CFG["a"]
            G_CFG["c"] = 3.0

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, global_cfg), change,
                   lambda: reference(*qkv, global_cfg))


class _Cfg:
    pass


@pytest.mark.parametrize("how", ["changed", "new", "dict"])
def test_captured_object_attribute(path, qkv, how):
    cfg = _Cfg()
    cfg.scale = 1.0

    def mod(score, b, h, q_idx, kv_idx):
        return score * (cfg.scale + getattr(cfg, "extra", 0.0))

    def change():
        if how == "changed":
            cfg.scale = 2.5
        elif how == "new":
            cfg.extra = 1.0
        else:
            cfg.__dict__ = {"scale": 0.5}

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, mod), change,
                   lambda: reference(*qkv, mod))


class _Mod:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * self.scale

    def method(self, score, b, h, q_idx, kv_idx):
        return score * self.scale + (q_idx - kv_idx) * 0.1


@pytest.mark.parametrize("how", ["attribute", "class __call__", "bound method"])
def test_callable_object(path, qkv, how):
    obj = _Mod(1.0)
    call_attr = _Mod.__call__
    mod = obj.method if how == "bound method" else obj  # a new bound method at each call

    def change():
        if how == "class __call__":
            _Mod.__call__ = lambda self, score, b, h, q_idx, kv_idx: score * -self.scale
        else:
            obj.scale = 2.0

    try:
        assert_noticed(path, lambda: flashattn.flex_attention(
            *qkv, obj.method if how == "bound method" else obj), change,
            lambda: reference(*qkv, mod))
    finally:
        _Mod.__call__ = call_attr


class _Negated(_Mod):
    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * -self.scale


def test_callable_object_of_another_class(path, qkv):
    """obj.__class__ assigned: its instance attributes the same, its __call__ another."""
    obj = _Mod(1.0)
    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, obj),
                   lambda: setattr(obj, "__class__", _Negated), lambda: reference(*qkv, obj))


class _Plain:
    pass


def test_captured_object_whose_class_becomes_callable(path, qkv):
    """A class that gains __call__: the walk then reads that function too (the trace is made
    again; the answer is the same, the mod not calling it)."""
    cfg = _Plain()
    cfg.scale = 0.5

    def mod(score, b, h, q_idx, kv_idx):
        return score * cfg.scale

    with torch.no_grad():
        before = flashattn.flex_attention(*qkv, mod)
        flashattn.flex_attention(*qkv, mod)
        path.clear()
        flashattn.flex_attention(*qkv, mod)
        assert path == [True]
        try:
            _Plain.__call__ = lambda self: None
            path.clear()
            assert torch.equal(flashattn.flex_attention(*qkv, mod), before)
            assert path == [False]
        finally:
            del _Plain.__call__


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("how", ["defaults", "kwdefaults", "code", "partial"])
def test_function_attributes(path, qkv, how, wrap):
    def scaled(score, b, h, q_idx, kv_idx, s=1.0):
        return score * s

    def scaled_kw(score, b, h, q_idx, kv_idx, *, s=1.0):
        return score * s

    def shifted(score, b, h, q_idx, kv_idx, s=1.0):
        return score * s - (q_idx - kv_idx).abs() * 0.5

    def base(score, b, h, q_idx, kv_idx, s):
        return score * s

    mod = WRAPS[wrap]({"defaults": scaled, "kwdefaults": scaled_kw, "code": scaled,
                       "partial": functools.partial(base, s=1.0)}[how])

    def change():
        if how == "defaults":
            scaled.__defaults__ = (2.0,)
        elif how == "kwdefaults":
            scaled_kw.__kwdefaults__["s"] = 2.0  # the same dict, changed
        elif how == "code":
            scaled.__code__ = shifted.__code__
        else:  # (a partial of a partial is one partial)
            mod.keywords["s"] = 2.0

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, mod), change,
                   lambda: reference(*qkv, mod))


def test_builtin_shadowed_by_a_global(path, qkv):
    """distance() calls the builtin abs: a global abs defined later is what it calls then."""
    try:
        assert_noticed(path, lambda: flashattn.flex_attention(*qkv, distance),
                       lambda: globals().__setitem__("abs", lambda x: x * 4),
                       lambda: reference(*qkv, distance))
    finally:
        globals().pop("abs", None)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 5)


def test_another_block_mask(path, qkv):
    bms = [flashattn.create_block_mask(m, None, None, S, S, BLOCK_SIZE=16)
           for m in (causal, window)]
    with torch.no_grad():
        for i in (0, 0, 1, 1, 0):
            path.clear()
            out = flashattn.flex_attention(*qkv, block_mask=bms[i])
            torch.testing.assert_close(out, reference(*qkv, mask_mod=(causal, window)[i]),
                                       atol=2e-5, rtol=2e-5)
    assert path == [True]  # the first block mask's call is still served


def keep_all(b, h, q_idx, kv_idx):
    return kv_idx >= 0


class _ClassDefaults(flashattn.BlockMask):
    """A block mask class with class attributes of its fields' names: read with getattr."""
    mask_mod = kv_indices = None


@pytest.mark.parametrize("cls", [flashattn.BlockMask, _ClassDefaults], ids=["plain", "class"])
@pytest.mark.parametrize("how", ["in place", "rebound"])
def test_changed_block_mask_tensors(path, qkv, how, cls):
    """The block structure alone changes, its tensors changed in place (their versions) or
    rebound: causal's blocks (a mask_mod that keeps every key, so the blocks decide), then every
    block full."""
    bm = flashattn.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=16)
    bm.__class__ = cls
    bm.mask_mod = keep_all
    full = flashattn.create_block_mask(keep_all, None, None, S, S, BLOCK_SIZE=16)

    def change():
        for name in flex._BM_FIELDS:
            if how == "in place":
                getattr(bm, name).copy_(getattr(full, name))
            else:
                setattr(bm, name, getattr(full, name).clone())

    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, block_mask=bm), change,
                   lambda: reference(*qkv))


def test_changed_mask_mod(path, qkv):
    """Another mask_mod on the same block mask: its partial blocks (every block here) use it."""
    bm = flashattn.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=16,
                                     separate_full_blocks=False)
    assert_noticed(path, lambda: flashattn.flex_attention(*qkv, block_mask=bm),
                   lambda: setattr(bm, "mask_mod", window),
                   lambda: reference(*qkv, mask_mod=window))


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
                m.setattr(_route, "FLEX_C", None)
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
    """Gradients, NumPy inputs, a function of new captures at every call, kernel_options: the
    route."""
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


def test_capture_that_starts_requiring_grad(path, qkv, rng):
    """Grad mode on, inputs without gradients: served in C until a captured tensor requires
    grad, which the route refuses."""
    bias = randn(rng, 2)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    flashattn.flex_attention(*qkv, head_bias)
    flashattn.flex_attention(*qkv, head_bias)
    path.clear()
    flashattn.flex_attention(*qkv, head_bias)
    assert path == [True]
    bias.requires_grad_()
    with pytest.raises(FlashAttnError, match="requires grad"):
        flashattn.flex_attention(*qkv, head_bias)


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
