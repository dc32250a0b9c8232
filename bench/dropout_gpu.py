"""What dropout costs on CUDA: flashattn's flash_attn_func (forward, and forward + backward) with
dropout_p 0 and P, beside PyTorch SDPA's FLASH (FA2) and cuDNN backends with and without dropout
(forward), in one process.

    PYTHONPATH=python FLASHATTN_LIBRARY=$PWD/build-cuda/libflashattn.so \\
        python3 bench/dropout_gpu.py [--hdims 64,128] [--seqlens 2048,8192] [--p 0.1] [--no-torch]

bf16, FlashAttention's benchmark shapes (16k tokens a call: batch = 16384 / seqlen; hidden 2048:
heads = 2048 / hdim), causal and not. Each time is the best of 5 runs of 5 calls back to back
(CUDA events), in ms; a ratio is the time without dropout over the time with it (1 = free).
--ring 1,2 adds the forward with dropout on the producer's Philox ring, a column per form
(FLASHATTN_SM90_DROP_RING=1; 2 waits for the previous P V after the softmax); --fa-env
"NAME=V;NAME=V" a column per setting, e.g. FLASHATTN_SM90_DROP_EARLY=1 (the consumers' Philox
during each key block's GEMMs).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "gpu"))
import bench_timing  # noqa: E402  (tests/gpu/bench_timing.py: the GPU benchmarks' timer)


def best_ms(fn):
    return bench_timing.best_ms(fn, reps=5, warmup=1, calls=5)


def sdpa_ms(backend, q, k, v, p, causal):
    """SDPA's forward on [b, h, s, d] views, or nan where the backend refuses the call."""
    try:
        with sdpa_kernel(backend), torch.no_grad():
            return best_ms(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p,
                                                                  is_causal=causal))
    except RuntimeError:
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--p", type=float, default=0.1, help="dropout_p of the timed calls")
    ap.add_argument("--no-torch", action="store_true", help="skip SDPA's backends")
    ap.add_argument("--ring", nargs="?", const="1", default="",
                    help="also ours fwd with FLASHATTN_SM90_DROP_RING=F for each form F of the "
                         "list (the producer's Philox ring; default 1), after the default in "
                         "the same process")
    ap.add_argument("--fa-env", default="",
                    help="NAME=V settings separated by ';': ours fwd with dropout under each, a "
                         "column each, after the default in the same process")
    ap.add_argument("--alibi", action="store_true",
                    help="every flashattn call with ALiBi (slopes 2^(-8 (i + 1) / h))")
    opts = ap.parse_args()
    p = opts.p
    envs = [("FLASHATTN_SM90_DROP_RING", f) for f in opts.ring.split(",") if f]
    envs += [tuple(e.split("=", 1)) for e in opts.fa_env.split(";") if e]
    print(f"ms, bf16{', ALiBi' if opts.alibi else ''}, {torch.cuda.get_device_name()}; each cell: without / with dropout {p} (ratio)")
    print("hdim seqlen causal | ours fwd            | ours fwd+bwd          | "
          + "".join("%-21s | " % ("fwd " + n[len("FLASHATTN_"):] + "=" + v)[:21] for n, v in envs) + "FA2 fwd             | cuDNN fwd")
    for d in [int(x) for x in opts.hdims.split(",")]:
        for s in [int(x) for x in opts.seqlens.split(",")]:
            b, h = 16384 // s, 2048 // d
            q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3)]
            dout = torch.randn_like(q)
            slopes = (torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)],
                                   device="cuda") if opts.alibi else None)
            for causal in (False, True):
                cells = []
                fwd = [0.0, 0.0]
                both = [0.0, 0.0]
                for i, dp in enumerate((0.0, p)):
                    with torch.no_grad():
                        fwd[i] = best_ms(lambda: flashattn.flash_attn_func(
                            q, k, v, dropout_p=dp, causal=causal, alibi_slopes=slopes))
                    both[i] = best_ms(lambda: torch.autograd.grad(flashattn.flash_attn_func(
                        q, k, v, dropout_p=dp, causal=causal, alibi_slopes=slopes),
                        (q, k, v), dout))
                cells += [fwd, both]
                for name, value in envs:
                    os.environ[name] = value
                    with torch.no_grad():
                        other = best_ms(lambda: flashattn.flash_attn_func(
                            q, k, v, dropout_p=p, causal=causal, alibi_slopes=slopes))
                    del os.environ[name]
                    cells.append([fwd[0], other])
                if not opts.no_torch:
                    qt, kt, vt = [x.detach().transpose(1, 2) for x in (q, k, v)]
                    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                        cells.append([sdpa_ms(backend, qt, kt, vt, dp, causal)
                                      for dp in (0.0, p)])
                text = " | ".join(f"{a:7.3f} / {c:7.3f} ({a / c:4.2f})" for a, c in cells)
                print(f"{d:4d} {s:6d} {str(causal):6s} | {text}", flush=True)


if __name__ == "__main__":
    main()
