"""flex_attention's C fast path (python/flashattn/_fastpath_flex.c) on CUDA tensors, which
FLASHATTN_FLEX_FASTPATH_CUDA=0 turns off (every CUDA call then takes the route): a repeated call
is served in C on the caller's current stream, with the route's answer, and a captured tensor
changed in place or a block mask's tensors changed in place send the next call back to the
route, which reads them (tests/python/test_fastpath_flex.py has every kind of change, on the
CPU).

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        [FLASHATTN_FLEX_FASTPATH_CUDA=0] python3 -m pytest -q tests/gpu/test_flex_fastpath_cuda.py
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import flashattn  # noqa: E402
from flashattn import _flex_prepared, flex  # noqa: E402

B, H, L, D = 1, 4, 256, 64


@pytest.fixture
def path(monkeypatch):
    """True per call served in C, False per call the Python route served."""
    flashattn.flash_attn_func(*(torch.randn(1, 2, 1, 8) for _ in range(3)))  # binds the C path
    real_c = _flex_prepared.FLEX_C
    assert real_c is not None, "the C fast path (_fastpath_flex.c) was not built"
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


def test_cuda_calls_take_the_route_when_switched_off(path, gen):
    if _flex_prepared.CUDA_IN_C:
        pytest.skip("without FLASHATTN_FLEX_FASTPATH_CUDA=0 CUDA calls are served in C")
    q, k, v = (torch.randn(B, H, L, D, generator=gen).half().cuda() for _ in range(3))

    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5

    with torch.no_grad():
        outs = [flashattn.flex_attention(q, k, v, halve) for _ in range(3)]
    assert path == [False] * 3 and all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_served_on_the_current_stream_and_changes_seen(path, monkeypatch, gen, dtype):
    if not _flex_prepared.CUDA_IN_C:
        pytest.skip("FLASHATTN_FLEX_FASTPATH_CUDA=0 turns the C path off for CUDA calls")
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(dtype).cuda() for _ in range(3))
    bias = torch.randn(H, 2 * L, generator=gen).cuda()

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + L]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = flashattn.create_block_mask(causal, None, None, L, L, device="cuda", BLOCK_SIZE=64)

    def route():
        with monkeypatch.context() as m:
            m.setattr(_flex_prepared, "FLEX_C", None)
            return flashattn.flex_attention(q, k, v, rel, block_mask=bm, return_lse=True)

    with torch.no_grad():
        for _ in range(2):  # the route hands C a call it meets twice
            flashattn.flex_attention(q, k, v, rel, block_mask=bm, return_lse=True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            path.clear()
            out, lse = flashattn.flex_attention(q, k, v, rel, block_mask=bm, return_lse=True)
            assert path == [True]
            streams = [c.args.stream for c in _flex_prepared._LOCAL.calls.values()]
            assert s.cuda_stream in streams
        s.synchronize()
        want_out, want_lse = route()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)

        bias.mul_(-1)  # in place: the next call reads the new values
        path.clear()
        out2, _ = flashattn.flex_attention(q, k, v, rel, block_mask=bm, return_lse=True)
        assert path == [False] and not torch.equal(out2, out)
        assert torch.equal(out2, route()[0])

        # C served no call since: the second change is not yet one at every call
        full = flashattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, None, None,
                                           L, L, device="cuda", BLOCK_SIZE=64)
        for name in flex._BM_FIELDS:
            getattr(bm, name).copy_(getattr(full, name))
        bm.mask_mod = full.mask_mod
        path.clear()
        out3, _ = flashattn.flex_attention(q, k, v, rel, block_mask=bm, return_lse=True)
        assert path == [False] and not torch.equal(out3, out2)
        assert torch.equal(out3, route()[0])
        path.clear()
        assert all(torch.equal(flashattn.flex_attention(q, k, v, rel, block_mask=bm,
                                                        return_lse=True)[0], out3)
                   for _ in range(2))
        assert path == [True, True]
