"""Decoding on CUDA: flashattn's few-query-row calls beside PyTorch SDPA's cuDNN and FLASH
backends, timed in turn in one process.

    PYTHONPATH=python FLASHATTN_LIBRARY=$PWD/build-cuda/libflashattn.so \\
        python3 bench/decode_gpu.py [--host] [--json PATH] [--batch 1,8] [--context 1k,32k] ...
    PYTHONPATH=python python3 bench/decode_gpu.py --device cpu --smoke   # tiny shapes, on the CPU

Cases (one table line each):
- kvcache contig: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=context,
  causal=True) on a [batch, capacity, kv heads, d] cache filled to `context` (capacity is
  context + 128; the rows past `context` hold a large constant, so reading them shows up in
  the error column);
- kvcache pagedP: the same keys in pages of P rows, pages in a random order (block_table);
- kvcache fp8 contig / fp8 pagedP (--kv-fp8): the same caches in float8_e4m3fn, each kv head's
  keys (and values) divided by a scale that maps their largest magnitude to 448, passed as
  k_descale / v_descale; its TB/s counts the fp8 bytes, its error bound is e4m3's ulp (0.125);
- func: flash_attn_func(q, k, v, causal=True) with k, v [batch, context, kv heads, d].
--dv gives v its own head dim; --v-in-k makes v the first dv columns of k (MLA's decode, one
cache: `--d 576 --dv 512 --gqa mqa --v-in-k`). --fa-env NAME=VALUE adds flashattn under those
environment variables as column fa* (an A/B of a plan switch in one process, e.g.
`--fa-env FLASHATTN_DECODE_WG=0`); fa/best stays the default's.
q has `rows` rows; causal is bottom-right aligned (query row i sees keys j <= i + context -
rows), so one row sees every key. No new k/v is appended: the step reads the cache only.
Default axes: d 128, 32 query heads over 8 kv heads (--gqa 4), bf16, batch 1/8/32/128 x context
1k/8k/32k/128k, contiguous/paged16/paged256, 1 and 16 rows; the flags select others (--gqa mqa:
one kv head; --page 0 is the contiguous cache).

SDPA gets the same math on [b, h, s, d] tensors of its own (contiguous; the paged rows use the
contiguous equivalent, SDPA has no paged form): one row without a mask; several rows with the
bottom-right causal mask, given to the FLASH backend as its kernel's is_causal (the aten op
behind SDPA's FLASH backend aligns causal bottom-right, as torch's causal_lower_right does;
SDPA's own is_causal is top-left) and to the other backends as an additive [rows, context]
mask. Grouped
heads go in with enable_gqa=True; a backend that refuses that gets K/V expanded to every query
head (column "sdpa kv": g = enable_gqa, x = expanded, n = no grouping, - = refused, one letter per
backend in column order). A backend that refuses the shape prints "-". On CPU tensors the cuDNN
and FLASH columns are "-" and the math backend is the reference column.

Columns: step time in us (the best of the timed runs; a run is `calls` calls back to back timed
with CUDA events, divided by `calls`); TB/s = bytes of the keys and values the step must read
(2 * batch * context * kv heads * d * element size) / step time; fa/best = best SDPA time /
flashattn time (> 1: flashattn is faster); max err = max |flashattn - SDPA| over the backends
that ran (the fp32 math backend on sequence 0 when none did). Above the dtype's tolerance (bf16
2e-2) times min(1, 2 max |SDPA's output|) the row says "!! WRONG", its ratio is "WRONG" and the
exit status is 2. --host adds the wall-clock time per call including the host (N calls, one
synchronize after them).

Memory: a row whose tensors (flashattn's and SDPA's copies) pass --mem-gb is skipped; the
library's own workspace comes on top. flashattn's API takes no `out`, so each call allocates
its output as the API does; nothing else is allocated per call here.
"""
import argparse
import contextlib
import json
import math
import os
import re
import sys
import threading
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import flashattn  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "python"))
from flashattn import _cached as fa_cached  # noqa: E402
from flashattn.flash_attn_interface import flash_attn_func, flash_attn_with_kvcache  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
FP8_TOLERANCE = 0.125  # e4m3's ulp: the cache's own rounding, little averaged over few keys
FP8_MAX = 448.0  # e4m3's largest finite value
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
GPU_ONLY = ("cudnn", "flash", "efficient")
CAPACITY_EXTRA = 128  # cache rows past `context`
POISON = 8.0  # their value: a step that reads them moves the output far from SDPA's

FULL = dict(batch="1,8,32,128", context="1k,8k,32k,128k", d="128", gqa="4", page="0,16,256",
            rows="1,16", heads=32)
SMOKE = dict(batch="1,2", context="64,300", d="64", gqa="4", page="0,16,256", rows="1,16",
             heads=8)


def parse_ints(text):
    """'1k,8k,300' -> [1024, 8192, 300]."""
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in text.split(",")]


def parse_options(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: a test)")
    ap.add_argument("--batch", help="batch sizes (default %s)" % FULL["batch"])
    ap.add_argument("--context", help="keys per sequence, k = 1024 (default %s)" % FULL["context"])
    ap.add_argument("--d", help="head dims (default %s)" % FULL["d"])
    ap.add_argument("--dv", type=int,
                    help="v's head dim, for every --d (default: d; MLA's decode: --d 576 --dv 512)")
    ap.add_argument("--v-in-k", action="store_true",
                    help="v the first dv columns of k (MLA's one cache: v_cache = k_cache[..., :dv]"
                         ", v = k[..., :dv]); TB/s then counts K's bytes alone")
    ap.add_argument("--gqa", help="query heads per kv head, or mqa (one kv head); default %s"
                    % FULL["gqa"])
    ap.add_argument("--heads", type=int, help="query heads (default %d)" % FULL["heads"])
    ap.add_argument("--page", help="kvcache layouts: 0 = contiguous, P = pages of P rows "
                    "(default %s)" % FULL["page"])
    ap.add_argument("--rows", help="query rows (default %s)" % FULL["rows"])
    ap.add_argument("--kv-fp8", action="store_true",
                    help="also the KV-cache cases with float8_e4m3fn caches and descales")
    ap.add_argument("--pages-in-order", action="store_true",
                    help="paged caches with their pages in order rather than shuffled")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--only", choices=("kvcache", "func"), help="one kind of case")
    ap.add_argument("--sdpa", help="SDPA backends to time (default cudnn,flash; on the CPU "
                    "cudnn,flash,math)")
    ap.add_argument("--host", action="store_true",
                    help="also the wall-clock time per call, host included")
    ap.add_argument("--mem-gb", type=float, default=60.0,
                    help="skip rows whose tensors need more (GB, 1e9 bytes)")
    ap.add_argument("--reps", type=int, default=30, help="timed runs per candidate, at most")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per candidate")
    ap.add_argument("--row-s", type=float,
                    help="timing budget per row in seconds (default 0.3; --smoke 0.02)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write every row here")
    ap.add_argument("--tflops", action="store_true",
                    help="also fa's TFLOP/s: 2 * batch * rows * heads * visible keys * (d + dv) "
                         "a step (MLA's measure, where many heads make the step compute-bound)")
    ap.add_argument("--fa-env", help="NAME=VALUE[,NAME=VALUE]: also flashattn with these "
                    "environment variables set (column fa*, its error checked as fa's), e.g. "
                    "FLASHATTN_DECODE_WG=0 or FLASHATTN_DECODE_TILE=128,2,1,4")
    opts = ap.parse_args(argv)
    defaults = SMOKE if opts.smoke else FULL
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    if opts.sdpa is None:
        opts.sdpa = "cudnn,flash" + (",math" if opts.device == "cpu" else "")
    if opts.row_s is None:
        opts.row_s = 0.02 if opts.smoke else 0.3
    opts.batch, opts.context = parse_ints(opts.batch), parse_ints(opts.context)
    opts.d, opts.rows = parse_ints(opts.d), parse_ints(opts.rows)
    opts.page = parse_ints(opts.page.replace("contig", "0"))
    opts.gqa = [x.lower() for x in opts.gqa.split(",")]
    opts.sdpa = opts.sdpa.split(",")
    for name in opts.sdpa:
        if name not in BACKENDS:
            ap.error("--sdpa: unknown backend %r (one of %s)" % (name, ", ".join(BACKENDS)))
    for g in opts.gqa:
        if g != "mqa" and (not g.isdigit() or int(g) < 1 or opts.heads % int(g)):
            ap.error("--gqa: %r does not divide --heads %d (or say mqa)" % (g, opts.heads))
    if min(opts.rows) < 1 or max(opts.rows) > min(opts.context):
        ap.error("--rows: each must be in 1..min(--context)")
    if min(opts.page) < 0:
        ap.error("--page: 0 (contiguous) or a page size >= 1")
    if opts.v_in_k and (opts.kv_fp8 or opts.dv is None or any(opts.dv > d for d in opts.d)):
        ap.error("--v-in-k: needs --dv no larger than each --d, and no --kv-fp8")
    if opts.fa_env:
        try:
            # a comma starts a new pair only before NAME=: values may hold commas
            # (FLASHATTN_DECODE_TILE=128,2,1,4)
            opts.fa_env = dict(x.split("=", 1) for x in
                               re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", opts.fa_env))
        except ValueError:
            ap.error("--fa-env: NAME=VALUE pairs joined by ','")
    if opts.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (try --device cpu --smoke)")
    return opts


# ---- timing ----------------------------------------------------------------------------------

def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_seconds(dev, fn, calls, clock):
    """Seconds of `calls` back-to-back calls of fn: between two CUDA events ("events"), or by
    the wall clock from a drained device to one synchronize after the last call ("wall")."""
    if clock == "events" and dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(dev)
    return time.perf_counter() - t0


_ENV_CALLS = {}  # thread -> the call cache under --fa-env


@contextlib.contextmanager
def env_set(pairs):
    """The environment with pairs set (the library reads its variables at each call's plan),
    and a call cache of its own: a cached call keeps the workspace size of its first plan."""
    old = {k: os.environ.get(k) for k in pairs}
    os.environ.update(pairs)
    local = fa_cached._LOCAL
    calls = getattr(local, "calls", None)
    local.calls = _ENV_CALLS.setdefault(threading.get_ident(), {})
    try:
        yield
    finally:
        local.calls = calls
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def best_per_call(dev, cands, reps, calls, clock):
    """{name: best seconds per call} of cands {name: (fn, context)}, the candidates taking
    turns in each round (the first moving on by one each round) so that all see the same
    device state. The context (SDPA's backend choice) is entered outside the timed part."""
    names = list(cands)
    best = dict.fromkeys(names, math.inf)
    for rep in range(reps):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            fn, ctx = cands[name]
            with ctx():
                best[name] = min(best[name], run_seconds(dev, fn, calls, clock) / calls)
    return best


def time_row(dev, cands, opts):
    """{"us": {name: us}, "host_us": {...} with --host, "calls", "reps"}: a few warm-up calls,
    one timed call each to size the runs, then rounds within the row's budget."""
    for fn, ctx in cands.values():
        with ctx():
            for _ in range(opts.warmup):
                fn()
    sync(dev)
    step = max(max(best_per_call(dev, cands, 1, 1, "events").values()), 1e-7)
    # Runs of ~2 ms: a run's fixed cost (the first launch's latency, the last call's kernel)
    # then stays a small share of a small step, as in a long decoding loop.
    calls = max(1, min(200, int(2e-3 / step)))
    reps = max(3, min(opts.reps, int(opts.row_s / (len(cands) * calls * step))))
    res = {"calls": calls, "reps": reps,
           "us": {n: t * 1e6 for n, t in best_per_call(dev, cands, reps, calls, "events").items()}}
    if opts.host:
        host_calls = max(1, min(100, int(2e-3 / step)))  # one synchronize per ~2 ms of calls
        host_reps = max(3, min(opts.reps, int(opts.row_s / (len(cands) * host_calls * step))))
        res["host_us"] = {n: t * 1e6 for n, t in
                          best_per_call(dev, cands, host_reps, host_calls, "wall").items()}
    return res


# ---- inputs ----------------------------------------------------------------------------------

class Shape:
    """One (batch, context, d, heads, kv heads) point: SDPA's K/V [b, hk, context, d], made once
    and shared by its cases, and their expansion to every query head when a backend needs it."""

    def __init__(self, opts, dev, dt, b, ctx, d, h, hk):
        self.opts, self.dev, self.dt = opts, dev, dt
        self.b, self.ctx, self.d, self.h, self.hk = b, ctx, d, h, hk
        self.dv = opts.dv or d
        self.v_in_k = opts.v_in_k and self.dv <= d
        self.esize = torch.finfo(dt).bits // 8
        self.gen = torch.Generator(device=dev).manual_seed(
            opts.seed * 1000003 + b * 7919 + ctx * 31 + d * 7 + hk)
        # what one step must read
        self.kv_bytes = b * ctx * hk * (d + (0 if self.v_in_k else self.dv)) * self.esize
        self.k = self.k_expanded = self.v = self.v_expanded = None

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.dev, dtype=self.dt)

    def make(self):
        self.k = self.randn(self.b, self.hk, self.ctx, self.d)  # [b, hk, ctx, d]
        self.v = (self.k[..., :self.dv] if self.v_in_k
                  else self.randn(self.b, self.hk, self.ctx, self.dv))

    def held_bytes(self):
        return self.kv_bytes * (1 + (self.h // self.hk if self.k_expanded is not None else 0))

    def drop_expanded(self):
        self.k_expanded = self.v_expanded = None

    def expanded(self, budget_left):
        """K/V [b, h, ctx, d] (query head i on kv head i // g), or None past the budget."""
        if self.k_expanded is None:
            if self.kv_bytes * self.h // self.hk > budget_left:
                return None
            g = self.h // self.hk
            self.k_expanded = self.k.repeat_interleave(g, dim=1)
            self.v_expanded = self.v.repeat_interleave(g, dim=1)
        return self.k_expanded, self.v_expanded


def case_bytes(shape, kind, page):
    """Bytes of flashattn's K/V for one case (SDPA's copy is counted once per shape)."""
    per_row = shape.hk * (shape.d + shape.dv) * (1 if kind == "kvcache8" else shape.esize) * shape.b
    if kind == "func":
        return per_row * shape.ctx
    cap = shape.ctx + CAPACITY_EXTRA
    return per_row * (cap if page == 0 else -(-cap // page) * page)


def flashattn_kv(shape, kind, page, in_order=False):
    """flashattn's inputs holding SDPA's keys: (k, v, extra kwargs); a paged cache's pages in
    a random order, or in_order (sequence after sequence, as a contiguous cache lies)."""
    s, dev = shape, shape.dev
    if kind == "func":
        k = s.k.transpose(1, 2).contiguous()
        return (k, k[..., :s.dv] if s.v_in_k else s.v.transpose(1, 2).contiguous(), {})
    lens = torch.full((s.b,), s.ctx, dtype=torch.int32, device=dev)
    cap = s.ctx + CAPACITY_EXTRA
    if kind == "kvcache8":
        # fp8 caches: each kv head's keys and values scaled into e4m3's range (the poison too)
        ks = (s.k.abs().amax(dim=(0, 2, 3)).float() / FP8_MAX).clamp(min=1e-12)  # [hk]
        vs = (s.v.abs().amax(dim=(0, 2, 3)).float() / FP8_MAX).clamp(min=1e-12)
        k, v, kwargs = flashattn_kv(shape, "kvcache", page, in_order)
        # in place in the caches' dtype (no fp32 copy of a large cache); [..., hk, d]
        k8 = k.div_(ks.to(k.dtype)[:, None]).to(torch.float8_e4m3fn)
        v8 = v.div_(vs.to(v.dtype)[:, None]).to(torch.float8_e4m3fn)
        del k, v
        kwargs.update(k_descale=ks.expand(s.b, s.hk).contiguous(),
                      v_descale=vs.expand(s.b, s.hk).contiguous())
        return k8, v8, kwargs
    if page == 0:
        kc = torch.full((s.b, cap, s.hk, s.d), POISON, dtype=s.dt, device=dev)
        kc[:, :s.ctx].copy_(s.k.transpose(1, 2))
        if s.v_in_k:
            return kc, kc[..., :s.dv], dict(cache_seqlens=lens)
        vc = torch.full((s.b, cap, s.hk, s.dv), POISON, dtype=s.dt, device=dev)  # [.., dv]
        vc[:, :s.ctx].copy_(s.v.transpose(1, 2))
        return kc, vc, dict(cache_seqlens=lens)
    pages = -(-cap // page)  # per sequence
    order = torch.arange(s.b * pages) if in_order else \
        torch.randperm(s.b * pages, generator=torch.Generator().manual_seed(s.b + page))
    table = order.view(s.b, pages).to(device=dev, dtype=torch.int32)  # [b, pages]
    kp = torch.full((s.b * pages, page, s.hk, s.d), POISON, dtype=s.dt, device=dev)
    vp = None if s.v_in_k else torch.full((s.b * pages, page, s.hk, s.dv), POISON, dtype=s.dt,
                                          device=dev)
    for i in range(s.b):  # one sequence at a time: no second full-size copy
        for src, pool in ((s.k, kp),) if s.v_in_k else ((s.k, kp), (s.v, vp)):
            w = src.shape[-1]
            seq = torch.full((pages * page, s.hk, w), POISON, dtype=s.dt, device=dev)
            seq[:s.ctx].copy_(src[i].transpose(0, 1))
            pool[table[i].long()] = seq.view(pages, page, s.hk, w)
    return kp, kp[..., :s.dv] if s.v_in_k else vp, dict(cache_seqlens=lens, block_table=table)


def causal_bias(rows, ctx, dt, dev):
    """[1, 1, rows, ctx] additive mask: 0 where query row i sees key j (j <= i + ctx - rows)."""
    i = torch.arange(rows, device=dev)[:, None]
    j = torch.arange(ctx, device=dev)[None, :]
    bias = torch.zeros(rows, ctx, dtype=dt, device=dev)
    return bias.masked_fill_(j > i + ctx - rows, -math.inf)[None, None]


def sdpa_call(name, q, k, v, bias, gqa, scale):
    """SDPA's call for one backend: q [b, h, rows, d], k/v [b, hk or h, ctx, d]."""
    if bias is not None and name == "flash":
        op = torch.ops.aten._scaled_dot_product_flash_attention
        return lambda: op(q, k, v, 0.0, True, False, scale=scale)[0]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                                  enable_gqa=gqa)


def sdpa_candidate(name, shape, q, bias, budget_left):
    """(fn, context, mode letter, output) of one SDPA backend, or (None, None, "-", None)."""
    if shape.dev.type != "cuda" and name in GPU_ONLY:
        return None, None, "-", None
    scale = shape.d ** -0.5
    ctx = lambda: sdpa_kernel([BACKENDS[name]])  # noqa: E731
    tries = [("n", shape.k, shape.v, False)] if shape.h == shape.hk else [
        ("g", shape.k, shape.v, True), ("x", None, None, False)]
    for mode, k, v, gqa in tries:
        if mode == "x":
            kv = shape.expanded(budget_left)
            if kv is None:
                break
            k, v = kv
        fn = sdpa_call(name, q, k, v, bias, gqa, scale)
        try:
            with ctx(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn()
                sync(shape.dev)
        except RuntimeError:
            continue
        return fn, ctx, mode, out
    return None, None, "-", None


def reference_error(shape, q, bias, out):
    """max |out - fp32 math SDPA| on sequence 0, when no timed backend gave an output."""
    g = shape.h // shape.hk
    k, v = (x[:1].float().repeat_interleave(g, dim=1) for x in (shape.k, shape.v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(
            q[:1].float(), k, v, attn_mask=None if bias is None else bias.float())
    return compare(out[:1], ref)


def compare(out, ref):
    """(max |out - ref|, max |ref|) of out [b, rows, h, d] and ref [b, h, rows, d]."""
    ref = ref.transpose(1, 2).float()
    return (out.float() - ref).abs().max().item(), ref.abs().max().item()


# ---- one row ---------------------------------------------------------------------------------

def row_key(shape, kind, page, rows):
    case = kind if kind == "func" else ("kvcache fp8 " if kind == "kvcache8" else "kvcache ") + (
        "contig" if page == 0 else "paged%d" % page)
    return dict(case=case, batch=shape.b, context=shape.ctx, rows=rows, d=shape.d, dv=shape.dv,
                heads=shape.h, kv_heads=shape.hk)


def run_case(opts, shape, kind, page, rows):
    s, dev = shape, shape.dev
    row = row_key(s, kind, page, rows)
    row.update(dtype=str(s.dt).replace("torch.", ""), kv_gb=s.kv_bytes / 1e9)
    need = case_bytes(s, kind, page) + 2 * s.b * rows * s.h * (s.d + s.dv) * s.esize
    if s.held_bytes() + need > opts.mem_gb * 1e9:
        s.drop_expanded()  # made again below if it fits beside this case
    need += s.kv_bytes
    if need > opts.mem_gb * 1e9:
        row["note"] = "skipped: needs %.3g GB > --mem-gb %g" % (need / 1e9, opts.mem_gb)
        return row
    if s.k is None:
        s.make()
    k, v, kwargs = flashattn_kv(s, kind, page, opts.pages_in_order)
    q = s.randn(s.b, rows, s.h, s.d)  # [b, rows, h, d]
    if kind == "func":
        fa = lambda: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    else:
        fa = lambda: flash_attn_with_kvcache(q, k, v, causal=True, **kwargs)  # noqa: E731
    try:
        out = fa()
        sync(dev)
    except Exception as ex:  # report the row and go on with the others
        row["note"] = "flashattn failed: %s" % str(ex).splitlines()[0][:120]
        return row
    out_env = None
    if opts.fa_env:
        try:
            with env_set(opts.fa_env):
                out_env = fa()
                sync(dev)
        except Exception as ex:
            row["note"] = "fa* failed: %s" % str(ex).splitlines()[0][:120]
    qt = q.transpose(1, 2).contiguous()  # [b, h, rows, d]
    bias = causal_bias(rows, s.ctx, s.dt, dev) if rows > 1 else None
    cands = {"flashattn": (fa, contextlib.nullcontext)}
    if out_env is not None:
        cands["fa*"] = (fa, lambda: env_set(opts.fa_env))
    modes, errs, errs_env = [], {}, {}
    for name in opts.sdpa:
        left = opts.mem_gb * 1e9 - need
        fn, ctx, mode, ref = sdpa_candidate(name, s, qt, bias, left)
        modes.append(mode)
        if fn is not None:
            cands[name] = (fn, ctx)
            errs[name], scale = compare(out, ref)
            if out_env is not None:
                errs_env[name], _ = compare(out_env, ref)
            del ref
    row["sdpa_kv"] = ",".join(modes)
    if not errs:
        errs["math fp32, seq 0"], scale = reference_error(s, qt, bias, out)
    del out
    # Relative to the output's size where that is small: over long contexts the outputs are
    # averages of many values, so small that an absolute bound would miss a lost share of the
    # keys; 2e-2 of twice the largest output is still a few bf16 ulps of it.
    limit = (FP8_TOLERANCE if kind == "kvcache8" else TOLERANCE[s.dt]) * min(1.0, 2 * scale)
    if out_env is not None and not errs_env:
        errs_env["math fp32, seq 0"], _ = reference_error(s, qt, bias, out_env)
    del out_env
    row.update(errs=errs, err=max(errs.values()), err_limit=limit)
    if errs_env:
        row.update(errs_env=errs_env, err=max(row["err"], max(errs_env.values())))
    row["wrong"] = not row["err"] <= limit
    off = [n for n, e in errs.items() if not e <= limit]
    if off and len(off) < len(errs):  # one backend disagrees with flashattn and the others
        row["note"] = "off: " + ",".join(off)
    row.update(time_row(dev, cands, opts))
    row["tbs"] = {n: s.kv_bytes / t / 1e6 for n, t in row["us"].items()}
    # bottom-right causal: query row i of `rows` sees context - rows + 1 + i keys
    keys = rows * (s.ctx - rows + 1) + rows * (rows - 1) // 2
    flops = 2.0 * s.b * s.h * keys * (s.d + s.dv)
    row["tflops"] = {n: flops / t / 1e6 for n, t in row["us"].items()}
    if kind == "kvcache8":  # flashattn read one byte an element
        for n in ("flashattn", "fa*"):
            if n in row["tbs"]:
                row["tbs"][n] *= 1 / s.esize
    sdpa_us = [row["us"][n] for n in opts.sdpa if n in row["us"]]
    row["ratio"] = min(sdpa_us) / row["us"]["flashattn"] if sdpa_us else None
    return row


# ---- output ----------------------------------------------------------------------------------

def header_line(dev):
    if dev.type == "cuda":
        where = "%s (%d SMs), CUDA %s, cuDNN %s" % (
            torch.cuda.get_device_name(dev), torch.cuda.get_device_properties(dev)
            .multi_processor_count, torch.version.cuda, torch.backends.cudnn.version())
    else:
        where = "CPU (torch threads: %d)" % torch.get_num_threads()
    return "decode: %s, torch %s" % (where, torch.__version__)


def fa_names(opts):
    return ["flashattn"] + (["fa*"] if opts.fa_env else [])


def table_columns(opts):
    names = fa_names(opts) + opts.sdpa
    short = {"flashattn": "fa"}
    cols = ["case", "batch", "context", "rows", "d", "h/hk"]
    cols += ["%s us" % short.get(n, n) for n in names]
    cols += ["%s TB/s" % short.get(n, n) for n in names]
    if opts.tflops:
        cols += ["%s TF/s" % short.get(n, n) for n in fa_names(opts)]
    cols += ["fa/best", "sdpa kv (%s)" % ",".join(opts.sdpa), "max err"]
    if opts.host:
        cols += ["fa host us", "sdpa host us"]
    return cols + ["note"]


def table_line(opts, r):
    names = fa_names(opts) + opts.sdpa
    num = lambda x, f: "-" if x is None else f % x  # noqa: E731
    us, tbs = r.get("us", {}), r.get("tbs", {})
    cells = [r["case"], str(r["batch"]), str(r["context"]), str(r["rows"]),
             str(r["d"]) if r["dv"] == r["d"] else "%d/%d" % (r["d"], r["dv"]),
             "%d/%d" % (r["heads"], r["kv_heads"])]
    cells += [num(us.get(n), "%.1f") for n in names]
    cells += [num(tbs.get(n), "%.3f") for n in names]
    if opts.tflops:
        cells += [num(r.get("tflops", {}).get(n), "%.1f") for n in fa_names(opts)]
    wrong = r.get("wrong")
    cells += ["WRONG" if wrong else num(r.get("ratio"), "%.2f"), r.get("sdpa_kv", "-"),
              num(r.get("err"), "%.1e") + (" !! WRONG" if wrong else "")]
    if opts.host:
        host = r.get("host_us", {})
        sdpa_host = [host[n] for n in opts.sdpa if n in host]
        cells += [num(host.get("flashattn"), "%.1f"),
                  num(min(sdpa_host) if sdpa_host else None, "%.1f")]
    note = r.get("note", "")
    if "math fp32, seq 0" in r.get("errs", {}):
        note = (note + "; " if note else "") + "err vs math fp32, seq 0"
    return "| " + " | ".join(cells + [note]) + " |"


def shapes(opts, dev, dt):
    for d in opts.d:
        for g in opts.gqa:
            hk = 1 if g == "mqa" else opts.heads // int(g)
            for b in opts.batch:
                for ctx in opts.context:
                    yield Shape(opts, dev, dt, b, ctx, d, opts.heads, hk)


def main(argv=None):
    opts = parse_options(argv)
    dev, dt = torch.device(opts.device), DTYPES[opts.dtype]
    kinds = [("kvcache", p) for p in opts.page] if opts.only != "func" else []
    kinds += [("kvcache8", p) for p in opts.page] if opts.kv_fp8 and opts.only != "func" else []
    kinds += [("func", None)] if opts.only != "kvcache" else []
    clock = "CUDA events" if dev.type == "cuda" else "wall clock"
    print(header_line(dev) + "; %s; step us = best of runs of back-to-back calls, %s"
          % (opts.dtype, clock), flush=True)
    cols = table_columns(opts)
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
    rows = []
    for shape in shapes(opts, dev, dt):
        for kind, page in kinds:
            for n in opts.rows:
                try:
                    r = run_case(opts, shape, kind, page, n)
                except torch.cuda.OutOfMemoryError as ex:
                    r = row_key(shape, kind, page, n)
                    r["note"] = "out of memory: %s" % str(ex).splitlines()[0][:80]
                rows.append(r)
                print(table_line(opts, r), flush=True)
        del shape  # its K/V, before the next shape's
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    wrong = [r for r in rows if r.get("wrong")]
    if wrong:
        print("\n!! %d row(s) where flashattn's output is off SDPA's by more than %g"
              % (len(wrong), TOLERANCE[dt]), file=sys.stderr)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(header=header_line(dev), options=vars(opts), rows=rows), f, indent=1)
    return 2 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
