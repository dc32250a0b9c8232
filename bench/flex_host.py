"""Per-call host time of flex_attention's repeated no-grad call beside flash_attn_func's, the C
fast path (_fastpath_flex.c) and, with --route, the Python route in the same process
(_flex_prepared.FLEX_C = None: the path every call took before the C one).

    FLASHATTN_LIBRARY=build/libflashattn.so PYTHONPATH=python python3 bench/flex_host.py \
        [--calls N] [--device cpu|cuda] [--route] [--grad]

Best of REPS loops of N calls per row; on CUDA each loop ends with a synchronize (the kernels
of these shapes take a few microseconds: the loop is bound by the host).
"""
import argparse
import time

import torch

import flashattn
from flashattn import _flex_prepared, _route

ap = argparse.ArgumentParser()
ap.add_argument("--calls", type=int, default=2000)
ap.add_argument("--device", default="cpu")
ap.add_argument("--route", action="store_true", help="also time the Python route")
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--grad", action="store_true",
                help="instead: host time of a call with gradients and of its backward()")
opt = ap.parse_args()
torch.set_num_threads(1)
dev = torch.device(opt.device)
dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def best(fn):
    for _ in range(50):
        fn()
    sync()
    ts = []
    for _ in range(opt.reps):
        t0 = time.perf_counter()
        for _ in range(opt.calls):
            fn()
        sync()
        ts.append((time.perf_counter() - t0) / opt.calls * 1e6)
    return min(ts)


bias = torch.randn(64, device=dev)


def causal(b, h, qi, ki):
    return qi >= ki


def rel(score, b, h, qi, ki):
    return score + bias[(qi - ki).abs()]


def softcap(score, b, h, qi, ki):
    return 30 * torch.tanh(score / 30)


def shapes(b, h, s, d):
    q, k, v = (torch.randn(b, h, s, d, device=dev).to(dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return q, k, v, qt, kt, vt


def grad_rows():
    """With gradients (b 1, h 16, s 256, d 64 on CUDA, whose kernels take a few microseconds;
    h 2, s 16, d 8 on the CPU): per case the host time of the call, of ``backward()`` (the
    autograd engine's hand-off included) and of both with the wait for the device, median of
    REPS x 20 calls, each pair waited for."""
    import statistics
    s, h, d = (256, 16, 64) if dev.type == "cuda" else (16, 2, 8)
    q, k, v = (torch.randn(1, h, s, d, device=dev).to(dtype).requires_grad_() for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    bm = flashattn.create_block_mask(causal, None, None, s, s, device=dev)
    cases = [
        ("flash_attn_func causal", lambda: flashattn.flash_attn_func(qt, kt, vt, causal=True)),
        ("flex causal block mask", lambda: flashattn.flex_attention(q, k, v, block_mask=bm)),
        ("flex softcap score_mod", lambda: flashattn.flex_attention(q, k, v, softcap)),
        ("torch q * 2 (the engine alone)", lambda: q * 2),
    ]
    print("%-32s %12s %12s %12s" % ("case (grad)", "call", "backward()", "with wait"))
    for name, fn in cases:
        t = {"call": [], "bwd": [], "all": []}
        for i in range(opt.reps * 20 + 5):
            sync()
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            if i >= 5:
                t["call"].append(t1 - t0), t["bwd"].append(t2 - t1), t["all"].append(t3 - t0)
        print("%-32s %9.1f us %9.1f us %9.1f us" % ((name,) + tuple(
            statistics.median(t[x]) * 1e6 for x in ("call", "bwd", "all"))))


if opt.grad:
    flashattn.flash_attn_func(*(torch.randn(1, 2, 1, 8) for _ in range(3)))  # binds C
    grad_rows()
    raise SystemExit(0)

rows = []
with torch.no_grad():
    flashattn.flash_attn_func(*(torch.randn(1, 2, 1, 8) for _ in range(3)))  # binds C
    c_entry = getattr(_flex_prepared, "FLEX_C", None)  # None: a tree without the C path
    assert _route.DENSE_C is not None
    d = 8 if dev.type == "cpu" else 64
    for label, (b, h, s, d, bs) in (("b1 h2 s16 d64", (1, 2, 16, 64, 16)),
                                    ("b1 h1 s1 d%d (host)" % d, (1, 1, 1, d, 16))):
        q, k, v, qt, kt, vt = shapes(b, h, s, d)
        bm = flashattn.create_block_mask(causal, None, None, s, s, BLOCK_SIZE=bs, device=dev)
        cases = [
            ("flash_attn_func causal", lambda: flashattn.flash_attn_func(qt, kt, vt,
                                                                          causal=True)),
            ("flex causal block mask", lambda: flashattn.flex_attention(q, k, v, block_mask=bm)),
            ("flex softcap score_mod", lambda: flashattn.flex_attention(q, k, v, softcap)),
            ("flex rel-bias score_mod", lambda: flashattn.flex_attention(q, k, v, rel)),
            ("flex rel-bias + causal bm",
             lambda: flashattn.flex_attention(q, k, v, rel, block_mask=bm)),
            ("flex a new lambda each call",
             lambda: flashattn.flex_attention(q, k, v, lambda sc, b, h, qi, ki: sc * 0.5)),
            ("flex rel, bias.add_(0) each", lambda: (bias.add_(0),
                                                     flashattn.flex_attention(q, k, v, rel))),
        ]
        for name, fn in cases:
            _flex_prepared.FLEX_C = c_entry
            c = best(fn)
            r = None
            if opt.route and c_entry is not None and name.startswith("flex"):
                _flex_prepared.FLEX_C = None
                r = best(fn)
                _flex_prepared.FLEX_C = c_entry
            rows.append((label, name, c, r))
base = {}
print("%-20s %-30s %9s %12s %9s %12s" % ("shape", "case", "C", "over fa_func", "route",
                                          "over fa_func"))
for label, name, c, r in rows:
    if name.startswith("flash_attn_func"):
        base[label] = c
    print("%-20s %-30s %6.2f us %+9.2f us %s" % (
        label, name, c, c - base[label],
        "" if r is None else "%6.2f us %+9.2f us" % (r, r - base[label])))
