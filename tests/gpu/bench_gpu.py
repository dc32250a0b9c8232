"""flashattn's CUDA forward beside PyTorch's SDPA backends, measured in the same process.

Run by `make gpu-check` on a CUDA machine (needs torch with CUDA):
    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so python3 tests/gpu/bench_gpu.py
Shapes are upstream's benchmark grid: 16k tokens (batch = 16384 / seqlen), hidden 2048
(heads = 2048 / hdim), bf16. TFLOP/s by FlashAttention's convention: 4*b*h*s*s*d, halved when
causal; with --dv (V's head dim, e.g. --hdims 192 --dv 128, DeepSeek's MLA prefill)
2*b*h*s*s*(d + dv). PyTorch's cuDNN backend takes dv != d (torch >= 2.5); its flash backend
does not and shows '-'. Also reports the first call's time (JIT compile, or a disk-cache hit,
plus module load) and the host cost of a cached call. Prints a short table last; --json PATH
keeps every number.
"ours" is the default plan (on Hopper the sm_90a family where it supports the case); "sm80" is
the same call with FLASHATTN_SM90=0 (the sm80 family), on Hopper only. --variants times more
plans of the sm_90a family (FLASHATTN_SM90_TILE=BN,STAGES,PINGPONG each, or a NAME=VALUE
setting) beside them.
--dropout P also times the same calls with dropout_p = P ("drop", and "drop sm80" on Hopper)
and prints drop/ours. --softcap C gives every flashattn call (not SDPA's) that softcap. --fp8
(Hopper, d = dv) also times the fp8 (e4m3) forward on the same shapes ("fp8": q, k, v cast to
float8_e4m3fn, out bf16; the same FLOP count) and prints fp8/ours; --fp8-variants times more
fp8 plans beside it (FLASHATTN_SM90_FP8_TILE=BN,STAGES,PINGPONG[,TRANSPOSE[,ORDER]] each, or a
NAME=VALUE setting such as FLASHATTN_SM90_FP8_VT=0; columns f0, f1, ...). Each call gets the workspace the library
asks for, allocated once (fp8: the V^T its kernel reads; the time includes writing it).
Each figure is the best of --reps rounds in which every column's call runs in turn (--calls
calls back to back; tests/gpu/bench_timing.py): one after another, the same kernel read up to
12% apart on an H100 as its clock fell.
"""
import argparse
import contextlib
import ctypes
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import _lib

import bench_timing  # tests/gpu/bench_timing.py, beside this script

DTYPE = torch.bfloat16
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def fa_view(t):
    """An FaTensor over a CUDA tensor (device pointer, element strides)."""
    ft = _lib.FaTensor()
    ft.data = t.data_ptr()
    ft.dtype = {torch.bfloat16: _lib.DTYPE_BF16,
                torch.float8_e4m3fn: _lib.DTYPE_F8E4M3}.get(t.dtype, _lib.DTYPE_F16)
    ft.ndim = t.dim()
    for i in range(t.dim()):
        ft.shape[i] = t.shape[i]
        ft.stride[i] = t.stride(i)
    return ft


class Call:
    """One prepared fa_attention_forward call on the current torch stream."""

    def __init__(self, q, k, v, out, causal, dropout_p=0.0, softcap=0.0):
        self.lib = _lib.get_lib()
        self.views = [fa_view(x) for x in (q, k, v, out)]
        self.args = _lib.FaFwdArgs()
        self.lib.fa_fwd_args_init(ctypes.byref(self.args))
        a = self.args
        a.q, a.k, a.v, a.out = [ctypes.pointer(x) for x in self.views]
        a.causal = int(causal)
        a.dropout_p = dropout_p
        a.softcap = softcap
        a.seed = 1234
        a.device = q.device.index or 0
        a.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        # The workspace the call asks for (fp8: V^T), allocated once as a C caller would.
        size = self.lib.fa_attention_forward_workspace_size(ctypes.byref(a))
        self.ws = torch.empty(size, dtype=torch.uint8, device=q.device) if size else None
        if size:
            a.workspace, a.workspace_size = self.ws.data_ptr(), size

    def __call__(self):
        st = self.lib.fa_attention_forward(ctypes.byref(self.args))
        if st != 0:
            raise RuntimeError(self.lib.fa_last_error().decode())


@contextlib.contextmanager
def settings(env):
    """The environment variables env ((name, value) pairs) set for the block."""
    for var, value in env:
        os.environ[var] = value
    try:
        yield
    finally:
        for var, _ in env:
            os.environ.pop(var, None)


def first_call_ms(d, causal=False):
    """Wall time of the first call in this process (compile or disk hit + load + run)."""
    q = torch.randn(1, 128, 2, d, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    call = Call(q, q, q, out, causal)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def call_overhead_us():
    """Host time of one cached call on a tiny problem (no synchronisation inside the loop)."""
    q = torch.randn(1, 64, 1, 64, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    call = Call(q, q, q, out, False)
    call()
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--dv", type=int, default=0,
                    help="V's head dim for every row (default: each row's hdim)")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--backends", default="flash,cudnn",
                    help="PyTorch SDPA backends to time beside ours ('none' for ours alone)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_gpu.json"))
    ap.add_argument("--no-jit", action="store_true",
                    help="skip the first-call and host-overhead timings (tile sweeps)")
    ap.add_argument("--no-sm80", action="store_true", help="skip the FLASHATTN_SM90=0 column")
    ap.add_argument("--variants", default="",
                    help="';'-separated FLASHATTN_SM90_TILE values to time as extra columns")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="softcap of every flashattn call (SDPA's backends have none)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="also time each call with this dropout_p (columns drop, drop sm80)")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the fp8 (e4m3) forward (Hopper)")
    ap.add_argument("--fp8-variants", default="",
                    help="with --fp8: ';'-separated FLASHATTN_SM90_FP8_TILE values (or NAME=VALUE "
                         "settings, e.g. FLASHATTN_SM90_FP8_VT=0) as extra columns")
    ap.add_argument("--reps", type=int, default=20, help="timed rounds (the best is kept)")
    ap.add_argument("--calls", type=int, default=1, help="calls per timed run, back to back")
    ap.add_argument("--first-call", type=int, default=0, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.first_call:
        print(json.dumps({"ms": first_call_ms(opts.first_call)}))
        return

    # JIT: compile in a fresh cache, then a new process that finds it on disk.
    cache = tempfile.mkdtemp(prefix="fa-cache-")
    os.environ["FLASHATTN_CACHE_DIR"] = cache
    jit = []
    for d in () if opts.no_jit else (64, 128, 256):
        compiled = first_call_ms(d)
        r = subprocess.run([sys.executable, __file__, "--first-call", str(d)], env=os.environ,
                           capture_output=True, text=True, check=True)
        disk = json.loads(r.stdout.strip().splitlines()[-1])["ms"]
        jit.append(dict(hdim=d, compile_ms=compiled, disk_hit_ms=disk))
    overhead = float("nan") if opts.no_jit else call_overhead_us()

    rows = []
    for d in [int(x) for x in opts.hdims.split(",")]:
        h = 2048 // d
        dv = opts.dv or d
        for s in [int(x) for x in opts.seqlens.split(",")]:
            b = max(1, 16384 // s)
            for causal in (False, True):
                flops = 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
                q, k = (torch.randn(b, s, h, d, device="cuda", dtype=DTYPE) for _ in range(2))
                v = torch.randn(b, s, h, dv, device="cuda", dtype=DTYPE)
                out = torch.empty(b, s, h, dv, device="cuda", dtype=DTYPE)
                row = dict(hdim=d, hdim_v=dv, seqlen=s, batch=b, heads=h, causal=causal)
                hopper = torch.cuda.get_device_capability() == (9, 0)
                # Every candidate: (name, its settings, a function that makes the call under
                # them); each is called once to see that it runs (and to compile it), then all
                # are timed in turn (bench_timing.best_ms_rotated: the GPU's clock drifts over a
                # long run by as much as the differences measured).
                cands = [("ours", (), lambda: Call(q, k, v, out, causal, 0.0, opts.softcap))]
                outs = {"ours": out}
                others = [] if not hopper or opts.no_sm80 else [("sm80", "FLASHATTN_SM90", "0")]
                others += [(f"tile {t}",) + (tuple(t.split("=", 1)) if "=" in t
                                              else ("FLASHATTN_SM90_TILE", t))
                           for t in opts.variants.split(";") if t and hopper]
                if opts.dropout:
                    others += [("drop", None, None)]
                    others += [("drop sm80", "FLASHATTN_SM90", "0")] if hopper and not opts.no_sm80 else []
                for name, var, value in others:
                    outs[name] = torch.empty_like(out)
                    p = opts.dropout if name.startswith("drop") else 0.0
                    cands.append((name, ((var, value),) if var else (),
                                  lambda o=outs[name], p=p: Call(q, k, v, o, causal, p,
                                                                 opts.softcap)))
                if opts.fp8 and hopper and dv == d:
                    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
                    fp8_tiles = [("fp8", None)] + [(f"fp8 {t}", t)
                                                   for t in opts.fp8_variants.split(";") if t]
                    for name, tile in fp8_tiles:
                        var, val = (tile.split("=", 1) if tile and "=" in tile
                                    else ("FLASHATTN_SM90_FP8_TILE", tile))
                        outs[name] = torch.empty_like(out)
                        cands.append((name, ((var, val),) if tile else (),
                                      lambda o=outs[name]: Call(q8, k8, v8, o, causal)))
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa
                timed = {}
                for name, env, make in cands:
                    ctx = functools.partial(settings, env)
                    try:
                        with ctx():
                            fn = make()
                            fn()
                        timed[name] = (fn, ctx)
                    except RuntimeError as ex:
                        row[name] = None
                        row[name + "_error"] = str(ex).splitlines()[0][:100]
                for name, be in BACKENDS.items():
                    if name not in opts.backends.split(","):
                        continue
                    ctx = functools.partial(sdpa_kernel, [be])
                    try:
                        with ctx():
                            ref = sdpa()
                        timed[name] = (sdpa, ctx)
                        if name == "flash":
                            row["maxdiff_vs_flash"] = (out.float() - ref.transpose(1, 2).float()
                                                       ).abs().max().item()
                    except RuntimeError as ex:
                        row[name] = None
                        row[name + "_error"] = str(ex).splitlines()[0][:100]
                if opts.fp8 and hopper and dv == d:
                    # cuDNN's fp8 attention, where SDPA exposes it (the error says why not).
                    q8t, k8t, v8t = (x.to(torch.float8_e4m3fn) for x in (qt, kt, vt))
                    sdpa8 = lambda: F.scaled_dot_product_attention(q8t, k8t, v8t,  # noqa
                                                                   is_causal=causal)
                    ctx = functools.partial(sdpa_kernel, [BACKENDS["cudnn"]])
                    try:
                        with ctx():
                            sdpa8()
                        timed["cudnn fp8"] = (sdpa8, ctx)
                    except (RuntimeError, TypeError) as ex:
                        row["cudnn fp8"] = None
                        row["cudnn fp8_error"] = str(ex).splitlines()[0][:100]
                ms = bench_timing.best_ms_rotated(timed, reps=opts.reps, warmup=2,
                                                  calls=opts.calls)
                for name, t in ms.items():
                    row[name] = flops / t / 1e9
                    if name in outs and name != "ours" and not name.startswith("drop"):
                        row["maxdiff_" + name] = (outs[name].float() - out.float()).abs().max().item()
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v, out, qt, kt, vt, timed, outs, cands

    with open(opts.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), jit=jit, call_overhead_us=overhead,
                       rows=rows), f, indent=1)
    fp8_cudnn = [r for r in rows if "cudnn fp8" in r]
    if fp8_cudnn:
        got = [r for r in fp8_cudnn if r["cudnn fp8"]]
        print("cuDNN fp8 (SDPA): " + (", ".join(
            f"{r['hdim']}/{r['seqlen']}{' causal' if r['causal'] else ''} {r['cudnn fp8']:.0f}"
            for r in got) if got else "not exposed: " + fp8_cudnn[0]["cudnn fp8_error"]))
    print("\nJIT first call (ms): " + ", ".join(
        f"hdim {j['hdim']}: compile {j['compile_ms']:.0f}, disk hit {j['disk_hit_ms']:.0f}" for j in jit))
    print(f"cached call, host time: {overhead:.1f} us")
    fmt = lambda x: f"{x:6.0f}" if x else "     -"
    extra = [f"tile {t}" for t in opts.variants.split(";") if t]
    drops = [] if not opts.dropout else ["drop", "drop sm80"]
    fp8x = [f"fp8 {t}" for t in opts.fp8_variants.split(";") if t] if opts.fp8 else []
    drops += ["fp8"] + fp8x if opts.fp8 else []
    print(f"\nTFLOP/s fwd, bf16, {torch.cuda.get_device_name()}" +
          "".join(f"; t{i} = FLASHATTN_SM90_TILE={t[5:]}" for i, t in enumerate(extra)) +
          "".join(f"; f{i} = " + (t[4:] if "=" in t else f"FLASHATTN_SM90_FP8_TILE={t[4:]}")
                  for i, t in enumerate(fp8x)))
    # V's head dim gets a column only when --dv sets it.
    dv_col = lambda r: f"{r['hdim_v']:5d} " if opts.dv else ""
    print("hdim " + ("   dv " if opts.dv else "") + "seqlen causal |   ours   sm80" +
          "".join(f"    t{i}" for i in range(len(extra))) +
          ("   drop  d.sm80" if opts.dropout else "") + ("    fp8" if opts.fp8 else "") +
          "".join(f"    f{i}" for i in range(len(fp8x))) +
          "  flash  cudnn | ours/cudnn ours/flash maxdiff" +
          (" drop/ours" if opts.dropout else "") + (" fp8/ours" if opts.fp8 else ""))
    ratio = lambda a, b: a / b if a and b else float("nan")
    for r in rows:
        print(f"{r['hdim']:4d} {dv_col(r)}{r['seqlen']:6d} {str(r['causal']):6s} | "
              f"{fmt(r['ours'])} {fmt(r.get('sm80'))}" + "".join(f" {fmt(r.get(t))}" for t in extra + drops) +
              f" {fmt(r.get('flash'))} {fmt(r.get('cudnn'))} | "
              f"{ratio(r['ours'], r.get('cudnn')):10.2f} {ratio(r['ours'], r.get('flash')):10.2f} "
              f"{r.get('maxdiff_vs_flash', float('nan')):.1e}" +
              (f" {ratio(r.get('drop'), r['ours']):9.2f}" if opts.dropout else "") +
              (f" {ratio(r.get('fp8'), r['ours']):8.2f}" if opts.fp8 else ""))


if __name__ == "__main__":
    main()
