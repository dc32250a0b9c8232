"""flashattn's CPU backend beside PyTorch's CPU scaled_dot_product_attention, in one process,
with the same thread count, on the shapes the CPU performance issue names. Prints a table last:
time per call (best of interleaved rounds, --reps at least), the ratio torch/ours (> 1: we are faster), our GFLOP/s by
FlashAttention's convention and its fraction of the cores' FMA peak measured in the same run
(`flashattn peak`). The decode rows also time torch reading K and V once (a sum of each), in
the same rounds: torch's decode time over that read is the most any read-once kernel can gain.

    PYTHONPATH=python python3 bench/cpu_vs_torch.py [--threads N] [--reps R] [--quick]
                                                    [--only REGEX]

The CPU description printed with the table names the kernels in use (fp32 micro-kernels, bf16
products on AMX, AVX512-BF16 or converted to fp32); FLASHATTN_CPU_AMX=0 and FLASHATTN_CPU_BF16=0
turn the bf16 kernels off for a comparison run.
"""

import argparse
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "python"))

import flashattn  # noqa: E402


SETTLE_S = 0.02  # --settle-ms


def best_times(fns, reps):
    """Best seconds per call of each of `fns`, over interleaved rounds (each in turn, so that
    all see the same machine): at least `reps` rounds, more for short calls (up to ~0.3 s
    of each, at most 200 rounds), whose best-of-few on a shared machine is mostly noise.
    Each call starts SETTLE_S after the previous one ends: torch's OpenMP workers spin for about
    a millisecond after each parallel region (libgomp's default wait policy) and would take the
    cores from whichever call comes next (measured on the H200 host: our 4k decode 1.58 ms
    right after torch's call, 0.53 with OMP_WAIT_POLICY=PASSIVE)."""
    first = []
    for fn in fns:
        t = time.perf_counter()
        fn()
        first.append(time.perf_counter() - t)
    rounds = max(reps, min(200, int(0.3 / max(max(first), 1e-6))))
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            time.sleep(SETTLE_S)
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def peak_gflops(threads):
    """The best of three `flashattn peak` runs (a core shared with another job halves one run).
    The command sits beside the library FLASHATTN_LIBRARY names, else in build/."""
    lib = os.environ.get("FLASHATTN_LIBRARY")
    exe = os.path.join(os.path.dirname(lib) if lib else os.path.join(REPO, "build"), "flashattn")
    best = 0.0
    for _ in range(3):
        out = subprocess.run([exe, "peak", "--threads", str(threads)], capture_output=True,
                             text=True, check=True).stdout
        best = max(best, float(re.search(r"peak fp32 FMA: ([0-9.]+) GFLOP/s", out).group(1)))
    return best


def visible_pairs(sq, sk, causal, window):
    """Exact count of (query, key) pairs the mask lets through."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    vis = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    return int(vis.sum()), vis


def prefill_case(name, b, h, s, d, dtype, causal=False, window=(-1, -1), dropout=0.0,
                 backward=False):
    def run(reps):
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        pairs, vis = visible_pairs(s, s, causal, window)
        mask = None if window == (-1, -1) else vis
        flops = 4.0 * b * h * pairs * d
        if not backward:
            ours = lambda: flashattn.flash_attn_func(q, k, v, dropout_p=dropout, causal=causal,
                                                     window_size=window)
            theirs = lambda: F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, dropout_p=dropout,
                is_causal=causal and mask is None)
        else:
            flops *= 3.5  # forward + backward (2.5x)
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            qtg, ktg, vtg = (x.clone().requires_grad_() for x in (qt, kt, vt))
            dout = torch.randn_like(q)
            doutt = dout.transpose(1, 2).contiguous()

            def ours():
                flashattn.flash_attn_func(qg, kg, vg, causal=causal).backward(dout)

            def theirs():
                F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=causal).backward(doutt)
        return (*best_times((ours, theirs), reps), flops, None)
    return name, run


def decode_case(name, h, hk, ctx, d, dtype, func=False):
    """One query row against ctx keys: through the KV cache, or (func) flash_attn_func."""
    def run(reps):
        b = 1
        q = torch.randn(b, 1, h, d, dtype=dtype)
        kc = torch.randn(b, ctx, hk, d, dtype=dtype)
        vc = torch.randn(b, ctx, hk, d, dtype=dtype)
        qt = q.transpose(1, 2).contiguous()
        kt, vt = (x.transpose(1, 2).contiguous() for x in (kc, vc))
        ours = lambda: (flashattn.flash_attn_func(q, kc, vc) if func
                        else flashattn.flash_attn_with_kvcache(q, kc, vc))
        theirs = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        # What reading K and V once costs here, timed in the same rounds: no kernel that reads
        # them once can beat torch by more than torch's time over this one.
        read = lambda: (kc.sum(), vc.sum())
        t_ours, t_theirs, t_read = best_times((ours, theirs, read), reps)
        return t_ours, t_theirs, 4.0 * b * h * ctx * d, t_read
    return name, run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smaller shapes (s=1024, h=8)")
    ap.add_argument("--only", default="", help="run the cases whose name matches this regex")
    ap.add_argument("--settle-ms", type=float, default=20.0,
                    help="idle time before each timed call (0: back to back)")
    a = ap.parse_args()
    global SETTLE_S
    SETTLE_S = a.settle_ms * 1e-3
    torch.set_num_threads(a.threads)
    os.environ["FLASHATTN_NUM_THREADS"] = str(a.threads)
    h, s = (8, 1024) if a.quick else (32, 2048)
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [
        prefill_case("fp32 d128", 1, h, s, 128, f32),
        prefill_case("fp32 d128 causal", 1, h, s, 128, f32, causal=True),
        prefill_case("bf16 d128", 1, h, s, 128, bf16),
        prefill_case("bf16 d128 causal", 1, h, s, 128, bf16, causal=True),
        prefill_case("fp32 d64", 1, h, s, 64, f32),
        prefill_case("fp32 window 512", 1, h, s, 128, f32, window=(511, 0)),
        prefill_case("fp32 dropout 0.1", 1, h, s, 128, f32, dropout=0.1),
        decode_case("fp32 decode 4k", 32, 8, 4096, 128, f32),
        decode_case("fp32 decode 32k", 32, 8, 32768, 128, f32),
        decode_case("fp32 func 1 row 4k", 32, 8, 4096, 128, f32, func=True),
        decode_case("fp32 func 1 row 32k", 32, 8, 32768, 128, f32, func=True),
        decode_case("bf16 func 1 row 4k", 32, 8, 4096, 128, bf16, func=True),
        decode_case("bf16 func 1 row 32k", 32, 8, 32768, 128, bf16, func=True),
        prefill_case("fp32 fwd+bwd", 1, h, s, 128, f32, backward=True),
        prefill_case("fp32 fwd+bwd causal", 1, h, s, 128, f32, causal=True, backward=True),
        prefill_case("bf16 fwd+bwd", 1, h, s, 128, bf16, backward=True),
        prefill_case("bf16 fwd+bwd causal", 1, h, s, 128, bf16, causal=True, backward=True),
    ]
    cases = [(name, run) for name, run in cases if re.search(a.only, name)]
    peak = peak_gflops(a.threads)
    rows = []
    for name, run in cases:
        ours, theirs, flops, read = run(a.reps)
        rows.append((name, ours, theirs, flops, read))
        print("%-22s ours %9.2f ms  torch %9.2f ms" % (name, ours * 1e3, theirs * 1e3),
              flush=True)
    print()
    print("threads=%d, FMA peak %.0f GFLOP/s (flashattn peak), torch %s, %s" % (
        a.threads, peak, torch.__version__, flashattn._lib.cpu_description()))
    print("| case | ours ms | torch ms | torch/ours | ours GFLOP/s | % of peak |")
    print("|---|---|---|---|---|---|")
    for name, ours, theirs, flops, _ in rows:
        gf = flops / ours * 1e-9
        print("| %s | %.2f | %.2f | %.2fx | %.0f | %.0f%% |" % (
            name, ours * 1e3, theirs * 1e3, theirs / ours, gf, 100 * gf / peak))
    for name, ours, theirs, _, read in rows:
        if read is not None:
            print("%s: reading K and V once (torch's sum of each) takes %.2f ms, so a "
                  "read-once kernel is at most %.2fx torch" % (name, read * 1e3, theirs / read))


if __name__ == "__main__":
    main()
