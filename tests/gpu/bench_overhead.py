"""Host overhead of one attention call on tiny CUDA inputs: flashattn's flash_attn_func (and a
decoding step through flash_attn_with_kvcache) beside F.scaled_dot_product_attention on each of
PyTorch's SDPA backends, measured side by side in one process.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 tests/gpu/bench_overhead.py [--json PATH] [--profile]

b=1, h=4, d=64, bf16, seqlen 16..128: the kernels take a few microseconds, so a loop of calls
is bound by the CPU and its wall time per call is the host cost of a call (launch included).
Each figure is the best of several loops of many calls, the rows taking turns loop by loop;
"gpu busy" is the GPU time of the loop (CUDA events) over its wall time, well below 100% when
the GPU is not what limits it.
Rows: the public function without and with inputs that require grad (the forward records
the autograd node), the same through the custom op (torch.ops.flashattn.fwd, what compiled
graphs call), the bare C call with prepared arguments (the library's own host cost), and SDPA
per backend. The KV-cache rows are one decoding step (one query row, the cache holding seqlen
keys, 2 kv heads): without and with the append of a new key, the same on float8_e4m3fn caches
with k_descale / v_descale, and the bare C call; from seqlen 128 the step splits its keys, which
adds the merge's launch and a workspace.
--profile prints where flashattn's Python time goes (cProfile).
"""
import argparse
import contextlib
import cProfile
import ctypes
import functools
import json
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import _arrays, _core, _kvcache, _lib, flash_attn_func, flash_attn_with_kvcache

B, H, D = 1, 4, 64
HK = 2  # kv heads of the KV-cache rows
SEQLENS = (16, 32, 64, 128)
DTYPE = torch.bfloat16
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def timed_loop(fn, calls):
    """(wall seconds, GPU seconds) of one loop of calls, started on a drained GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return wall, start.elapsed_time(end) * 1e-3


def measure_rows(rows, calls, repeats):
    """{name: (best wall microseconds per call, GPU busy fraction of that loop) or None}, for
    rows of (name, fn, context) where context makes the context manager each loop runs in (or
    is None). The rows take turns, one loop each per round, so a noisy stretch of the host falls
    on all of them alike rather than on whichever row it met."""
    def within(context):
        return context() if context is not None else contextlib.nullcontext()

    best = {}
    for name, fn, context in rows:
        try:
            with within(context):
                for _ in range(50):
                    fn()
            best[name] = (float("inf"), 0.0)
        except RuntimeError as e:  # a backend this torch build or GPU does not have
            best[name] = None
            print("%s: unavailable (%s)" % (name, str(e).splitlines()[0]))
    for _ in range(repeats):
        for name, fn, context in rows:
            if best[name] is not None:
                with within(context):
                    wall, gpu = timed_loop(fn, calls)
                if wall < best[name][0]:
                    best[name] = (wall, gpu / wall)
    return {n: None if r is None else (r[0] / calls * 1e6, r[1]) for n, r in best.items()}


def inputs(seqlen, grad):
    g = torch.Generator(device="cuda").manual_seed(seqlen)
    q, k, v = (torch.randn(B, seqlen, H, D, device="cuda", generator=g).to(DTYPE)
               .requires_grad_(grad) for _ in range(3))
    return q, k, v


def c_call(q, k, v):
    """fa_attention_forward with arguments prepared once (outputs reused): the library's host
    cost alone."""
    args, keep, arrays, out, lse, _, _ = _core._prepare_forward(
        q, k, v, _arrays.TORCH, None, None, None, 0, 0, 0.0, None, False, (-1, -1), 0.0, None,
        None, False, 0, 0, None, None, None, None, 0)
    fn = _lib.get_lib().fa_attention_forward
    ref = ctypes.byref(args)

    def call():
        if fn(ref) != 0:
            raise RuntimeError(_lib.last_error())

    call.keep = (args, keep, arrays, out, lse)
    return call


def kv_rows(seqlen):
    """The KV-cache rows: a decoding step on a cache of seqlen keys (capacity one more)."""
    g = torch.Generator(device="cuda").manual_seed(seqlen + 1)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(DTYPE)

    q, kn, vn = rand(B, 1, H, D), rand(B, 1, HK, D), rand(B, 1, HK, D)
    kc, vc = rand(B, seqlen + 1, HK, D), rand(B, seqlen + 1, HK, D)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    kd, vd = (torch.rand(B, HK, device="cuda", generator=g) + 0.5 for _ in range(2))
    lens = torch.full((B,), seqlen, dtype=torch.int32, device="cuda")
    prepared = _kvcache.kvcache_prepare(_arrays.TORCH, q, kc, vc, None, None, None, None, lens,
                                        None, None, None, None, None, None, True, (-1, -1), 0.0,
                                        True, 0)
    fn, ref = _kvcache.kv_lib().fa_attention_kvcache, ctypes.byref(prepared[0])

    def c_only():
        if fn(ref) != 0:
            raise RuntimeError(_lib.last_error())

    c_only.keep = prepared
    return [
        ("kvcache step", lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                         causal=True), None),
        ("kvcache step, append", lambda: flash_attn_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=lens, causal=True), None),
        ("kvcache step, fp8", lambda: flash_attn_with_kvcache(
            q, kc8, vc8, cache_seqlens=lens, causal=True, k_descale=kd, v_descale=vd), None),
        ("kvcache step, fp8, append", lambda: flash_attn_with_kvcache(
            q, kc8, vc8, kn, vn, cache_seqlens=lens, causal=True, k_descale=kd,
            v_descale=vd), None),
        ("fa_attention_kvcache (C only)", c_only, None),
    ]


def rows(seqlen):
    """(name, callable, what makes its context manager or None) per measured row."""
    q, k, v = inputs(seqlen, False)
    qg, kg, vg = inputs(seqlen, True)
    sd = [x.transpose(1, 2) for x in (q, k, v)]   # SDPA's (b, h, s, d) views of the same data
    sdg = [x.transpose(1, 2) for x in (qg, kg, vg)]
    out = [
        ("flashattn", lambda: flash_attn_func(q, k, v), None),
        ("flashattn, requires_grad", lambda: flash_attn_func(qg, kg, vg), None),
        ("torch.ops.flashattn.fwd", lambda: torch.ops.flashattn.fwd(
            q, k, v, None, None, None, 0.0, None, False, -1, -1, 0.0, False, False), None),
        ("fa_attention_forward (C only)", c_call(q, k, v), None),
    ]
    for name, backend in BACKENDS.items():
        out.append(("sdpa %s" % name, lambda: F.scaled_dot_product_attention(*sd),
                    functools.partial(sdpa_kernel, [backend])))
        out.append(("sdpa %s, requires_grad" % name,
                    lambda: F.scaled_dot_product_attention(*sdg),
                    functools.partial(sdpa_kernel, [backend])))
    return out + kv_rows(seqlen)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile flash_attn_func's Python path (seqlen 64)")
    a = ap.parse_args()

    torch.cuda.init()
    flash_attn_func(*inputs(16, False))  # compile/load the kernels before timing
    results = {}
    for s in SEQLENS:
        for name, r in measure_rows(rows(s), a.calls, a.repeats).items():
            results[(name, s)] = r

    names = list(dict.fromkeys(n for n, _ in results))
    print("\nhost time per call, microseconds (b=%d, h=%d, d=%d, bf16; gpu busy in %%)"
          % (B, H, D))
    print("%-32s" % "" + "".join("%16s" % ("seqlen %d" % s) for s in SEQLENS))
    for n in names:
        cells = []
        for s in SEQLENS:
            r = results[(n, s)]
            cells.append("%16s" % ("-" if r is None else "%7.1f (%3.0f%%)" % (r[0], 100 * r[1])))
        print("%-32s" % n + "".join(cells))
    for grad, suffix in ((False, ""), (True, ", requires_grad")):
        ours = [results[("flashattn" + suffix, s)][0] for s in SEQLENS]
        fastest = [min(r[0] for (n, s2), r in results.items() if r is not None and s2 == s
                       and n.startswith("sdpa") and n.endswith("grad") == grad)
                   for s in SEQLENS]
        print("flashattn%s / fastest SDPA backend: %s" % (
            suffix, "  ".join("%.2fx" % (o / f) for o, f in zip(ours, fastest))))

    if a.json:
        with open(a.json, "w") as f:
            json.dump({"%s|%d" % k: v for k, v in results.items()}, f, indent=1)
    if a.profile:
        q, k, v = inputs(64, False)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            flash_attn_func(q, k, v)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
