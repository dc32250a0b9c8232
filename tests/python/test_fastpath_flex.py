"""flex_attention's C fast path (python/flashattn/_fastpath_flex.c): once a call is prepared in
Python, a repeated call with the same arguments runs in C while the checks its walk of the mods
recorded hold. Each test below serves a call in C, changes what the mods or the block mask
capture, and checks that the next call took the Python route (the change was noticed) and gives
the answer of the mods evaluated afresh; then that C serves the call again."""

import functools

import pytest
import torch

import flashattn
from flashattn import flex
from flexfast import (S, _Mod, assert_noticed, causal, path, qkv, randn,  # noqa: F401
                      reference, window)


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
