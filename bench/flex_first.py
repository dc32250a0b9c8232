"""The first call of each of bench/flex.py's mods in a process whose kernel cache starts empty:
create_block_mask, the forward and the forward + backward, each timed the first time (the
kernels compiled by NVRTC and written to the cache) and the second (found in memory), ms.

    PYTHONPATH=python:bench FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 bench/flex_first.py [--device cuda] [--seqlen 1024]

The built-in kernels a flex call shares with every call (the backward's pre- and post-pass) are
compiled first by a built-in causal call, outside the figures. The shapes are small (b 1, h 4,
d 128), so the figures are the host's and the compiler's, not the kernels'. --train-first
skips the forward-only column: the first call is a training step's, whose backward kernels
compile on a thread beside the forward's (fa_attention_backward_prepare); run it in its own
process, as the cache must start empty. NVRTC (CUDA 12.9+) keeps a cache of its own in the
driver's compute cache, so CUDA_CACHE_PATH points at an empty directory too.
"""
import argparse
import os
import tempfile
import time

os.environ["FLASHATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="flex_first_")
os.environ["CUDA_CACHE_PATH"] = tempfile.mkdtemp(prefix="flex_first_nv_")

import torch  # noqa: E402

import flashattn  # noqa: E402
from flashattn import flash_attn_func  # noqa: E402

from flex import cases  # noqa: E402


def timed_ms(fn, sync):
    t = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--train-first", action="store_true",
                    help="no forward-only call: fwd+bwd is each mod's first call")
    opts = ap.parse_args()
    dev = torch.device(opts.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    s, h, d = opts.seqlen, 4, 128
    q, k, v = (torch.randn(1, h, s, d, device=dev, dtype=dt, requires_grad=True)
               for _ in range(3))

    def builtin():
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        flash_attn_func(qt, kt, vt, causal=True).sum().backward()

    print("flex_first: %s, cache %s; b 1, h %d, s %d, d %d, %s; ms, first call / second"
          % (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
             os.environ["FLASHATTN_CACHE_DIR"], h, s, d, str(dt)[6:]))
    print("built-in causal fwd+bwd (shared kernels): %.0f / %.1f"
          % (timed_ms(builtin, sync), timed_ms(builtin, sync)))
    cols = ["create_block_mask"] + ([] if opts.train_first else ["fwd"]) + ["fwd+bwd"]
    print("| case | %s | total first |" % " | ".join(cols))
    print("|---|%s---|" % ("---|" * len(cols)))
    for name, (score_mod, mask_mod, _) in cases(s, h, dev).items():
        bm = [None]

        def make():
            bm[0] = flashattn.create_block_mask(mask_mod, None, None, s, s, device=dev)

        def fwd():
            with torch.no_grad():
                flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm[0])

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            flashattn.flex_attention(q, k, v, score_mod=score_mod,
                                     block_mask=bm[0]).sum().backward()

        calls = (make, fwd_bwd) if opts.train_first else (make, fwd, fwd_bwd)
        row = [(timed_ms(f, sync), timed_ms(f, sync)) for f in calls]
        print("| %s | %s | %.0f |" % (name, " | ".join("%.0f / %.1f" % r for r in row),
                                      sum(r[0] for r in row)), flush=True)


if __name__ == "__main__":
    main()
