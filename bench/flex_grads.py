"""Captured tensors' gradients through flex_attention: forward + backward of a relative-position
table (score + rel[h, kv - q + s]) with and without its gradient, and of a per-head scale with
the table (score * sc[h] + rel[h, kv - q + s], both learnt), causal block mask, b 1, h 16,
d 128, bf16, ours only (torch's compiled FlexAttention does not compile the table's gradient).

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 bench/flex_grads.py --seqlens 4096,16384

Prints ms (best of --reps calls, each waited for) and the table gradient's sum, which two
builds should agree on to about 1e-3 (fp32 atomics add in varying order).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashattn  # noqa: E402
from flex import best_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tag", default="", help="a word printed first on each line")
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, D = 16, 128
    for S in [int(x) for x in args.seqlens.split(",")]:
        g = torch.Generator(device=dev).manual_seed(1)
        q, k, v = (torch.randn(1, H, S, D, device=dev, generator=g).to(torch.bfloat16)
                   .requires_grad_() for _ in range(3))
        rel = torch.randn(H, 2 * S, device=dev, generator=g)
        sc = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).requires_grad_()
        dout = torch.randn(1, H, S, D, device=dev, generator=g).to(torch.bfloat16)
        bm = flashattn.create_block_mask(lambda b, h, qi, ki: ki <= qi, 1, 1, S, S,
                                         device="cuda")

        def relbias(score, b, h, qi, ki):
            return score + rel[h, ki - qi + S]

        def scaled(score, b, h, qi, ki):
            return score * sc[h] + rel[h, ki - qi + S]

        def step(mod, leaves):
            def run():
                for x in leaves:
                    x.grad = None
                flashattn.flex_attention(q, k, v, score_mod=mod, block_mask=bm).backward(dout)
            return run

        for name, mod, grad in (("table, no gradient", relbias, False),
                                ("table with gradient", relbias, True),
                                ("scale and table with gradients", scaled, True)):
            rel.requires_grad_(grad)
            leaves = (q, k, v, rel, sc)
            run = step(mod, leaves)
            ms = best_ms(run, args.reps, dev)
            run()
            total = float(rel.grad.double().sum()) if grad else 0.0
            print("%s S %5d %-31s %7.2f ms  table gradient sum %.6e"
                  % (args.tag, S, name, ms, total), flush=True)


if __name__ == "__main__":
    main()
