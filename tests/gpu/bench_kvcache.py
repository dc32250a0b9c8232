"""A decoding step through flash_attn_with_kvcache on CUDA tensors beside PyTorch SDPA on the same
keys, measured side by side in one process, for bench/NOTES.md.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 tests/gpu/bench_kvcache.py [--contexts 1024,8192,32768] [--batches 1,8]

bf16, 32 query heads over 8 kv heads, d 128, one new token appended per sequence (all
sequences of one length, so SDPA sees the same keys as a dense tensor without padding). Ours
runs with num_splits 0 (the library's choice), 1 (no split) and 8 (keys in 8 chunks, the query
heads of a kv head packed as rows, merged by their lse). SDPA gets the cache
prefix already transposed and the new key already written: it does less work than the step.
Each figure is the best of 20 timed runs after 5 warm-ups (CUDA events); GB/s counts the K/V
bytes read once.
"""
import argparse
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_with_kvcache

import bench_timing  # tests/gpu/bench_timing.py, beside this script

H, HK, D = 32, 8, 128


best_ms = functools.partial(bench_timing.best_ms, reps=20, warmup=5)


def row(b, ctx):
    g = torch.Generator(device="cuda").manual_seed(b * 7919 + ctx)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=dt)

    kc, vc = randn(b, ctx, HK, D), randn(b, ctx, HK, D)
    q, k, v = randn(b, 1, H, D), randn(b, 1, HK, D), randn(b, 1, HK, D)
    lens = torch.full((b,), ctx - 1, dtype=torch.int32, device="cuda")
    r = {"batch": b, "context": ctx}
    for splits in (0, 1, 8):
        r[f"ours splits={splits}"] = best_ms(lambda: flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=lens, causal=True, num_splits=splits))
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    for name, be in (("sdpa flash", SDPBackend.FLASH_ATTENTION),
                     ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                r[name] = best_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt,
                                                                         enable_gqa=True))
        except RuntimeError:
            r[name] = float("nan")
    r["GB"] = 2 * b * ctx * HK * D * 2 / 1e9
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batches", default="1,8")
    a = ap.parse_args()
    rows = [row(b, c) for b in map(int, a.batches.split(","))
            for c in map(int, a.contexts.split(","))]
    names = [n for n in rows[0] if n not in ("batch", "context", "GB")]
    print(f"\ndecode step, ms (bf16, h {H}/{HK}, d {D}); GB/s of K/V read in brackets")
    print(f"{'batch':>5} {'context':>7} | " + " | ".join(f"{n:>20}" for n in names))
    for r in rows:
        cells = [f"{r[n]:8.4f} ({r['GB'] / r[n] * 1e3:6.0f})" for n in names]
        print(f"{r['batch']:5d} {r['context']:7d} | " + " | ".join(f"{c:>20}" for c in cells))
    fastest = [min(r[n] for n in names if n.startswith("sdpa") and r[n] == r[n]) for r in rows]
    print("fastest SDPA / ours (splits=0): " +
          "  ".join(f"{f / r['ours splits=0']:.2f}x" for f, r in zip(fastest, rows)))


if __name__ == "__main__":
    main()
