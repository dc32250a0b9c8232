"""What the tests of flex_attention's C fast path (test_fastpath_flex*.py) share: a record of
each call's path, the inputs, a reference that evaluates the mods afresh, and the check that a
change is noticed."""

import math

import pytest
import torch

import flashattn
from flashattn import _flex_prepared, flex

B, H, S, D = 1, 2, 32, 16


@pytest.fixture
def path(monkeypatch):
    """A record of each flex_attention call's path (True: served in C; False: the Python
    route, which every call it serves enters through flex._check_inputs)."""
    flashattn.flash_attn_func(*(torch.randn(1, 2, 1, 8) for _ in range(3)))  # binds the C path
    real_c = _flex_prepared.FLEX_C
    assert real_c is not None, "the C fast path (python/flashattn/_fastpath_flex.c) was not built"
    served, in_route = [], []
    check = flex._check_inputs
    monkeypatch.setattr(flex, "_check_inputs", lambda *a: in_route.append(1) or check(*a))

    def c_spy(*args):
        in_route.clear()
        out = real_c(*args)
        served.append(not in_route)
        return out

    monkeypatch.setattr(_flex_prepared, "FLEX_C", c_spy)
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


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 5)


class _Mod:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * self.scale

    def method(self, score, b, h, q_idx, kv_idx):
        return score * self.scale + (q_idx - kv_idx) * 0.1
