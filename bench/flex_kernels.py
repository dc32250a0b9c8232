"""The CUDA kernels of flashattn.flex_attention's calls, timed one by one (torch.profiler),
beside the built-in call that means the same and, for the document mask, beside the same tiles
run as a dense batch (8 sequences of s / 8, built-in causal): what the mods cost on the GPU, kernel
by kernel, without the host time bench/flex.py's figures include.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 bench/flex_kernels.py [--only "document|causal"] [--backward]

Shapes and cases are bench/flex.py's on CUDA (b 1, h 16, s 16k, d 128, bf16). Each row: the best
wall time of --reps calls (host included, each waited for), then the kernels' mean times over
three profiled calls, largest first, ms. An A/B of two builds: run it once with each library
(FLASHATTN_LIBRARY), in turn, in one session.
"""

import argparse
import collections
import re

import torch
from torch.profiler import ProfilerActivity, profile

import flashattn
from flashattn import flash_attn_func

from flex import best_ms, cases


def kernel_ms(fn, reps):
    """The best wall time of reps calls and {kernel name: mean ms} over three profiled calls."""
    best = best_ms(fn, reps, torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:32]] += e.device_time / 3 / 1000
    return best, tot


def show(name, fn, reps):
    ms, tot = kernel_ms(fn, reps)
    top = sorted(tot.items(), key=lambda x: -x[1])[:6]
    print("%-34s %8.3f | %s" % (name, ms, "  ".join("%s %.3f" % kv for kv in top)), flush=True)


def call(fn, grads, backward):
    """fn's call, then its backward with gradients new tensors (as after zero_grad())."""
    def run():
        for x in grads:
            x.grad = None
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="a regular expression: the cases whose names match")
    ap.add_argument("--backward", action="store_true", help="forward and backward")
    ap.add_argument("--reps", type=int, default=10)
    opts = ap.parse_args()
    dev = torch.device("cuda")
    s, h, d = 16384, 16, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, generator=g).to(dev, torch.bfloat16)
               .requires_grad_(opts.backward) for _ in range(3))
    print("flex_kernels: %s; b 1, h %d, s %d, d %d, bf16, %s; wall ms (best of %d) | kernels, ms"
          % (torch.cuda.get_device_name(dev), h, s, d,
             "forward + backward" if opts.backward else "forward", opts.reps))
    for name, (score_mod, mask_mod, builtin) in cases(s, h, dev).items():
        if opts.only and not re.search(opts.only, name):
            continue
        bm = flashattn.create_block_mask(mask_mod, None, None, s, s, device=dev)
        show("flex " + name, call(lambda: flashattn.flex_attention(
            q, k, v, score_mod=score_mod, block_mask=bm), (q, k, v), opts.backward), opts.reps)
        if builtin is not None:
            show("built-in " + name, call(lambda: flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **builtin),
                (q, k, v), opts.backward), opts.reps)
        if name.startswith("document"):
            # The same tiles as 8 sequences of s / 8: [8, s / 8, h, d].
            qb, kb, vb = (x.detach().reshape(h, 8, s // 8, d).permute(1, 2, 0, 3).contiguous()
                          .requires_grad_(opts.backward) for x in (q[0], k[0], v[0]))
            show("dense 8 x %d built-in causal" % (s // 8), call(lambda: flash_attn_func(
                qb, kb, vb, causal=True), (qb, kb, vb), opts.backward), opts.reps)


if __name__ == "__main__":
    main()
