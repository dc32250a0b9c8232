"""A decoding step by split count: the time per call of an eager loop (host included, CUDA
events around back-to-back calls) and the GPU's own time (replay of a CUDA graph of 20 calls),
for flash_attn_with_kvcache at num_splits 0 (the library's choice), 1, 2, ... 32 (or --splits), beside SDPA's
cuDNN and FLASH backends on the same keys. bf16, 32 query heads over 8 kv heads (--kv-heads),
d 128 (--d), one query row, every sequence full.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 tests/gpu/bench_decode_splits.py [--batch 1,8] [--context 1024,8192,32768]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import bench_timing  # tests/gpu/bench_timing.py, beside this script
from flashattn import flash_attn_with_kvcache

SPLITS = "0,1,2,4,8,16,32"


def loop_us(fn, calls=200, reps=5):
    """Best time per call of `calls` back-to-back calls (CUDA events)."""
    return bench_timing.best_ms(fn, reps=reps, warmup=10, calls=calls) * 1e3


def graph_us(fn, calls=20):
    """The GPU's time per call: a CUDA graph of `calls` calls, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return loop_us(graph.replay, calls=20) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", default="1024,8192,32768")
    ap.add_argument("--splits", default=SPLITS, help="num_splits values (default %s)" % SPLITS)
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--kv-heads", type=int, default=8, help="kv heads (of 32 query heads)")
    a = ap.parse_args()
    torch.manual_seed(0)
    print("batch context case | loop us | gpu us")
    for b in (int(x) for x in a.batch.split(",")):
        for ctx in (int(x) for x in a.context.split(",")):
            q = torch.randn(b, 1, 32, a.d, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(b, ctx, a.kv_heads, a.d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            for sp in (int(x) for x in a.splits.split(",")):
                def fn(sp=sp):
                    return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                                   num_splits=sp)
                print("%d %d splits=%d | %.1f | %.1f" % (b, ctx, sp, loop_us(fn), graph_us(fn)),
                      flush=True)
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            def sdpa():
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(backend):  # around the timing, not inside each call
                        times = loop_us(sdpa), graph_us(sdpa)
                    print("%d %d sdpa %s | %.1f | %.1f" % (b, ctx, name, *times), flush=True)
                except RuntimeError as e:
                    print("%d %d sdpa %s | refused: %s" % (b, ctx, name, str(e)[:80]))


if __name__ == "__main__":
    main()
