"""One decode step (flash_attn_with_kvcache, one query row, bf16, 32 query heads over 8 kv heads,
batch 32, 1k keys) from a contiguous cache and from pages of 16 in random order, µs a call: a
loop of back-to-back calls (host included), the host's issue time alone, and on CUDA a graph's
replay (GPU time). Where the loop reads above the replay, the step waits for the host.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so python3 bench/decode_host.py \\
        [--d 64] [--batch 32] [--context 1024] [--device cuda]

--device cpu runs the same loop without the graph (a smoke run of the script).
"""
import argparse
import time

import torch

from flashattn import flash_attn_with_kvcache

PAGE = 16


def calls(d, batch, context, dev):
    """{name: the step's call} for the contiguous and the paged cache of the same shape."""
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    heads, kv_heads, cap = 32, 8, context + 128
    q = torch.randn(batch, 1, heads, d, generator=g).to(dev, dt)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    kc, vc = (torch.randn(batch, cap, kv_heads, d, generator=g).to(dev, dt) for _ in range(2))
    blocks = cap // PAGE
    kp, vp = (torch.randn(batch * blocks, PAGE, kv_heads, d, generator=g).to(dev, dt)
              for _ in range(2))
    table = torch.randperm(batch * blocks, generator=g).view(batch, blocks).to(dev, torch.int32)
    return {
        "contiguous": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
        "paged 16": lambda: flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens,
                                                    block_table=table),
    }


def loop_us(fn, sync, n):
    """Best of 5 loops of n calls, waited for at the end: µs a call."""
    for _ in range(5):
        fn()
    sync()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def issue_us(fn, sync, n):
    """The host's time to issue n calls (not waited for): µs a call."""
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    sync()
    return us


def graph_us(fn, n):
    """Best of 5 replays of a CUDA graph of 10 calls, n calls each: GPU µs a call."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    best = float("inf")
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n // 10):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / n)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    opts = ap.parse_args()
    dev = torch.device(opts.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = 400 if cuda else 5
    print("%s, d %d, batch %d, %d keys; µs a call: loop (host included) / issue alone / graph"
          % (torch.cuda.get_device_name() if cuda else "cpu", opts.d, opts.batch, opts.context))
    for _ in range(2):
        for name, fn in calls(opts.d, opts.batch, opts.context, dev).items():
            graph = "%.1f" % graph_us(fn, n) if cuda else "-"
            print("%-10s %7.1f / %7.1f / %s" % (name, loop_us(fn, sync, n),
                                                issue_us(fn, sync, n), graph), flush=True)


if __name__ == "__main__":
    main()
