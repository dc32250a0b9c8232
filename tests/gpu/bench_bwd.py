"""Forward, backward and forward + backward of flashattn beside PyTorch SDPA's flash and cuDNN
backends, measured side by side in one process, for the backward's table in bench/NOTES.md.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 tests/gpu/bench_bwd.py [--hdims 64,128] [--seqlens 2048,4096,8192,16384]
        [--json PATH] [--calls N] [--dv DV] [--softcap C]

bf16, FlashAttention's benchmark shapes (16k tokens: batch 16384 / seqlen; hidden 2048: heads 2048
/ hdim), causal and not. Each figure is the best of 10 timed runs after 3 warm-ups (CUDA events),
the three implementations' runs taken in turn (bench_timing.best_ms_rotated: timed one
implementation after another, ours lost 7-10% in a long table that it did not lose alone, so the
GPU's state drifts; in turn, all see the same state; the SM clock after each row is recorded to see
whether that state is the clock); a run is one call, or with --calls N, N calls back to back (the
host's work per call hidden behind the GPU's, as upstream's benchmark and a training loop have it).
TFLOP/s as upstream counts them: forward 4 b h s^2 d (halved when causal), backward 2.5x that,
forward + backward 3.5x; with --dv (V's head dim, e.g. --hdims 192 --dv 128) the forward counts
2 b h s^2 (d + dv). PyTorch's flash backend refuses dv != d (its column then reads "-"). On sm_90 the Hopper backward runs; FLASHATTN_BWD_SM90=0 measures the sm80
family instead. --softcap C gives our calls that softcap (SDPA's have none: compare ours only).
--check also compares each row's gradients once, before the timing: the largest difference of
ours from cuDNN's, and of torch's flash backend from cuDNN's (the two bf16 kernels' own spread),
each over the largest cuDNN gradient, dq / dk / dv's worst; printed after the table.
"""
import argparse
import contextlib
import functools
import json
import subprocess
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_func

import bench_timing  # tests/gpu/bench_timing.py, beside this script

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
PASSES = ("fwd", "bwd", "fwd+bwd")


def pass_fns(attn, x, dout, ctx):
    """{pass: (fn, ctx)} running attn(*x) (its inputs require grad) under the context ctx."""
    with ctx():
        out = attn(*x)
    return {
        "fwd": (lambda: attn(*x), ctx),
        "bwd": (lambda: torch.autograd.grad(out, x, dout, retain_graph=True), ctx),
        "fwd+bwd": (lambda: torch.autograd.grad(attn(*x), x, dout), ctx),
    }


def grad_spread(impls):
    """{name: max |grad - cuDNN's| / max |cuDNN's|, the worst of dq, dk, dv} for ours and
    flash, from one backward each (impls' "bwd" passes; ours is transposed to SDPA's
    [b, h, s, d] layout)."""
    grads = {}
    for name, fns in impls.items():
        fn, ctx = fns["bwd"]
        with ctx():
            g = fn()
        grads[name] = [t.transpose(1, 2) if name == "ours" else t for t in g]
    ref = grads["cudnn"]
    return {name: max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in zip(g, ref))
            for name, g in grads.items() if name != "cudnn"}


def sm_clock_mhz():
    """The SM clock now (nvidia-smi), or None where it cannot be read."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                            "-i", str(torch.cuda.current_device())],
                           capture_output=True, text=True, timeout=10)
        return int(q.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def row(d, s, causal, calls, dv=0, softcap=0.0, check=False):
    dv = dv or d
    b, h = max(1, 16384 // s), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(s * 131 + d)
    x = [torch.randn(b, s, h, n, device="cuda", generator=g, dtype=torch.bfloat16)
         .requires_grad_() for n in (d, d, dv)]
    dout = torch.randn(b, s, h, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    fwd_flops = 2.0 * b * h * s * s * (d + dv) / (2 if causal else 1)
    flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
    r = dict(hdim=d, hdim_v=dv, seqlen=s, batch=b, heads=h, causal=causal)
    impls = {"ours": pass_fns(lambda q, k, v: flash_attn_func(q, k, v, causal=causal,
                                                              softcap=softcap), x, dout,
                              contextlib.nullcontext)}
    xt = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in x]
    dt = dout.transpose(1, 2).contiguous()
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa
    for name, be in BACKENDS.items():
        try:
            # A backend that refuses the shape warns at each try as well as raising: the
            # error alone is kept (the warnings filled the device's output tails).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                impls[name] = pass_fns(sdpa, xt, dt, functools.partial(sdpa_kernel, [be]))
        except RuntimeError as e:  # a backend this build of torch lacks, or the shape
            r[name] = None
            r[name + "_error"] = str(e).splitlines()[0][:100]
    if check and "cudnn" in impls:
        r["check"] = grad_spread(impls)
    for name in impls:
        r[name] = {}
    for p in PASSES:
        ms = bench_timing.best_ms_rotated({n: f[p] for n, f in impls.items()}, reps=10,
                                          warmup=3, calls=calls)
        for name, t in ms.items():
            r[name][p] = flops[p] / t * 1e-9
    r["sm_mhz"] = sm_clock_mhz()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--calls", type=int, default=1, help="calls per timed run, back to back")
    ap.add_argument("--dv", type=int, default=0, help="V's head dim (default: the hdim)")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="softcap of our calls (SDPA's backends have none)")
    ap.add_argument("--check", action="store_true",
                    help="compare each row's gradients with cuDNN's once (printed at the end)")
    a = ap.parse_args()
    rows = []
    for d in [int(x) for x in a.hdims.split(",")]:
        for s in [int(x) for x in a.seqlens.split(",")]:
            for causal in (False, True):
                rows.append(row(d, s, causal, a.calls, a.dv, a.softcap, a.check))
                print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("\nTFLOP/s, bf16, %s, %d call(s) per timed run: ours / flash / cudnn, and ours over "
          "cudnn" % (torch.cuda.get_device_name(), a.calls))
    print("hdim seqlen causal |        fwd        |        bwd        |      fwd+bwd      | "
          "bwd/cudnn fwd+bwd/cudnn | SM MHz after")
    fmt = lambda r, p: "%5.0f" % r[p] if r else "    -"  # noqa: E731
    for r in rows:
        cells = " | ".join(" ".join(fmt(r.get(k), p) for k in ("ours", "flash", "cudnn"))
                           for p in PASSES)
        ratio = lambda p: (r["ours"][p] / r["cudnn"][p]) if r.get("cudnn") else float("nan")  # noqa
        print("%4d %6d %-6s | %s | %9.2f %13.2f | %s" % (
            r["hdim"], r["seqlen"], r["causal"], cells, ratio("bwd"), ratio("fwd+bwd"),
            r["sm_mhz"] or "-"))
    if a.check:
        print("\ngradients against cuDNN's, max |diff| / max |cuDNN|, dq / dk / dv's worst: "
              "ours, torch's flash")
        for r in rows:
            c = r.get("check") or {}
            print("%4d %6d %-6s | %s | %s" % (r["hdim"], r["seqlen"], r["causal"],
                                              *("%.2e" % c[n] if n in c else "-"
                                                for n in ("ours", "flash"))))


if __name__ == "__main__":
    main()
