"""create_block_mask's time beside torch's (FlexAttention's, on the same device): the causal and
the document mask (8 documents, a captured int tensor) over b 1, h 1, SEQ x SEQ, 128-blocks;
ours on the CPU (the host build, then copied when --device cuda) and on the device. Best of
--reps calls, ms; the masks are checked equal first.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 bench/flex_block_mask.py [--device cuda] [--seqlen 16384] [--reps 5]
"""
import argparse

import torch
from torch.nn.attention import flex_attention as tflex

import flashattn
from flex import best_ms  # bench/flex.py: the best of reps calls, each waited for

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    opts = ap.parse_args()
    S, dev = opts.seqlen, opts.device
    where = torch.device(dev)
    docs = torch.sort(torch.randint(0, 8, (S,), generator=torch.Generator().manual_seed(0)))[0]
    docs_dev = docs.to(dev)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return (docs_dev[q_idx] == docs_dev[kv_idx]) & (q_idx >= kv_idx)

    print("mask      ours (host, %s) | ours (%s) | torch (%s), ms" % (dev, dev, dev))
    for name, mask in (("causal", causal), ("document", document)):
        ours = flashattn.create_block_mask(mask, 1, 1, S, S, device=dev)
        theirs = tflex.create_block_mask(mask, 1, 1, S, S, device=dev)
        for f in FIELDS:
            assert torch.equal(getattr(ours, f), getattr(theirs, f)), (name, f)

        def host():
            bm = flashattn.create_block_mask(mask, 1, 1, S, S, device="cpu")
            return [getattr(bm, f).to(dev) for f in FIELDS]

        row = [best_ms(host, opts.reps, where),
               best_ms(lambda: flashattn.create_block_mask(mask, 1, 1, S, S, device=dev),
                       opts.reps, where),
               best_ms(lambda: tflex.create_block_mask(mask, 1, 1, S, S, device=dev),
                       opts.reps, where)]
        print("%-9s %9.2f | %9.2f | %9.2f" % ((name,) + tuple(row)))


if __name__ == "__main__":
    main()
