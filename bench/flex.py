"""flashattn.flex_attention beside torch's FlexAttention, timed in turn in one process, and
beside flashattn's built-in option where one means the same; on the CPU or a CUDA device.

    PYTHONPATH=python python3 bench/flex.py [--threads 16] [--seqlen 4096] [--backward]
    PYTHONPATH=python python3 bench/flex.py --smoke     # tiny shapes, every case once
    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \
        python3 bench/flex.py --device cuda               # b 1, h 16, s 16k, d 128, bf16

Cases (b 1; on the CPU h 8, d 64, fp32; on CUDA h 16, d 128, bf16, the FlashAttention
benchmark's 16k tokens at hidden 2048; mods written for torch, run unchanged by both):
- causal, sliding window 256, prefix-LM (prefix 1/4), document (8 documents, causal): mask_mods
  with a block mask from each library's create_block_mask (128-blocks);
- softcap 30, ALiBi, relative bias (a captured [h, 2s] table): score_mods over causal; with
  --backward also the table learnt (it requires grad, so the backward gives it a gradient).
torch's column is torch.compile(flex_attention) (Inductor's CPU kernel, or its Triton kernel on
CUDA), its own fast path; flashattn's runs as called (the mods traced once, then cached). "built-in" is
flash_attn_func with causal, window_size, softcap or alibi_slopes where the case has one.
Every output is checked against the other library's before it is timed. --backward times the
forward and the backward of flashattn, and on CUDA torch's compiled forward and backward beside
them (torch's FlexAttention has no CPU backward), each call's gradients new tensors (the inputs'
.grad set to None first, as optimizer.zero_grad() does), not added into the last call's.
"""

import argparse
import math
import re
import time

import torch
import torch.nn.functional as F

import flashattn
from flashattn import flash_attn_func

try:
    from torch.nn.attention import flex_attention as tflex
except ImportError:  # torch < 2.5
    tflex = None


def cases(s, h, dev):
    """{name: (score_mod or None, mask_mod, built-in kwargs of flash_attn_func or None)}."""
    docs = (torch.arange(s) * 8 // s).to(dev)
    rel = torch.randn(h, 2 * s, generator=torch.Generator().manual_seed(1)).to(dev)
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]).to(dev)
    prefix = s // 4

    def causal(b, hh, q, k):
        return k <= q

    def window(b, hh, q, k):
        return (k <= q) & (q - k <= 256)

    def prefix_lm(b, hh, q, k):
        return (k <= q) | (k < prefix)

    def document(b, hh, q, k):
        return (docs[q] == docs[k]) & (k <= q)

    def softcap(score, b, hh, q, k):
        return 30 * torch.tanh(score / 30)

    def alibi(score, b, hh, q, k):
        return score - slopes[hh] * (q - k)

    def relbias(score, b, hh, q, k):
        return score + rel[hh, k - q + s]

    relg = rel.clone().requires_grad_()

    def relbias_learnt(score, b, hh, q, k):
        return score + relg[hh, k - q + s]

    relbias_learnt.trainable = (relg,)  # its backward gives the table a gradient

    return {
        "causal": (None, causal, dict(causal=True)),
        "window 256": (None, window, dict(causal=True, window_size=(256, 0))),
        "prefix-LM": (None, prefix_lm, None),
        "document x8": (None, document, None),
        "softcap 30": (softcap, causal, dict(causal=True, softcap=30.0)),
        "alibi": (alibi, causal, dict(causal=True, alibi_slopes=slopes)),
        "relative bias": (relbias, causal, None),
        "relative bias, learnt": (relbias_learnt, causal, None),
    }


def best_ms(fn, reps, dev):
    """The best of reps timed calls, ms (on CUDA each call waited for)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--seqlen", type=int, default=0, help="0: 4096 on the CPU, 16384 on CUDA")
    ap.add_argument("--heads", type=int, default=0, help="0: 8 on the CPU, 16 on CUDA")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--only", default="", help="a regular expression: the cases whose names match")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one timed run")
    ap.add_argument("--no-torch", action="store_true",
                    help="flashattn alone (A/B runs of two builds: bench/ab.sh)")
    opts = ap.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dev = torch.device(opts.device)
    gpu = dev.type == "cuda"
    s, h, d = (opts.seqlen or (16384 if gpu else 4096), opts.heads or (16 if gpu else 8),
               128 if gpu else 64)
    s, h, d = (256, 2, 32) if opts.smoke else (s, h, d)
    dt = torch.bfloat16 if gpu else torch.float32
    tol = 2e-2 if gpu else 1e-3
    reps = 1 if opts.smoke else opts.reps
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, generator=g).to(dev, dt) for _ in range(3))
    compiled = None
    if (tflex is not None and not opts.smoke and not opts.no_torch and
            (gpu or not opts.backward)):
        compiled = torch.compile(tflex.flex_attention, dynamic=False)
    print("flex: torch %s, %s; b 1, h %d, s %d, d %d, %s, ms (best of %d)"
          % (torch.__version__, torch.cuda.get_device_name(dev) if gpu else
             "%d threads" % torch.get_num_threads(), h, s, d, str(dt)[6:], reps))
    if opts.backward:
        print("| case | flashattn fwd | flashattn fwd+bwd | torch compiled fwd+bwd | ratio | "
              "built-in fwd+bwd |")
        print("|---|---|---|---|---|---|")
    else:
        print("| case | flashattn | torch compiled | ratio | built-in | max diff |")
        print("|---|---|---|---|---|---|")
    for name, (score_mod, mask_mod, builtin) in cases(s, h, dev).items():
        if opts.only and not re.search(opts.only, name):
            continue
        if not opts.backward and getattr(score_mod, "trainable", None):
            continue  # its forward is the relative bias's
        ours_bm = flashattn.create_block_mask(mask_mod, None, None, s, s, device=dev)
        ours = lambda: flashattn.flex_attention(q, k, v, score_mod=score_mod,  # noqa: E731
                                                block_mask=ours_bm)
        base = None
        if builtin is not None:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            base = lambda: flash_attn_func(qt, kt, vt, **builtin)  # noqa: E731
        if opts.backward:
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

            def fresh():
                # as optimizer.zero_grad() leaves them: each backward's gradients are new
                # tensors, not added into the last ones
                qg.grad = kg.grad = vg.grad = None
                for x in getattr(score_mod, "trainable", ()):
                    x.grad = None

            def ours_fb():
                fresh()
                out = flashattn.flex_attention(qg, kg, vg, score_mod=score_mod,
                                               block_mask=ours_bm)
                out.backward(torch.ones_like(out))

            def base_fb():
                fresh()
                qt, kt, vt = (x.transpose(1, 2) for x in (qg, kg, vg))
                out = flash_attn_func(qt, kt, vt, **builtin)
                out.backward(torch.ones_like(out))

            theirs_fb_ms = None
            if compiled is not None:
                tbm = tflex.create_block_mask(mask_mod, None, None, s, s, device=dev)

                def theirs_fb():
                    fresh()
                    out = compiled(qg, kg, vg, score_mod=score_mod, block_mask=tbm)
                    out.backward(torch.ones_like(out))

                try:
                    theirs_fb_ms = best_ms(theirs_fb, reps, dev)
                except Exception as e:  # torch 2.11's Triton backward of a learnt table
                    print("torch compiled, %s: %s" % (name, str(e).strip().splitlines()[-1]))
            with torch.no_grad():
                fwd = best_ms(ours, reps, dev)
            fb = best_ms(ours_fb, reps, dev)
            print("| %s | %.2f | %.2f | %s | %s | %s |" % (
                name, fwd, fb, "%.2f" % theirs_fb_ms if theirs_fb_ms else "-",
                "%.2fx" % (theirs_fb_ms / fb) if theirs_fb_ms else "-",
                "%.2f" % best_ms(base_fb, reps, dev) if builtin is not None else "-"),
                flush=True)
            continue
        with torch.no_grad():
            out = ours()
            ref, theirs_ms, diff = None, None, None
            if compiled is not None:
                tbm = tflex.create_block_mask(mask_mod, None, None, s, s, device=dev)
                theirs = lambda: compiled(q, k, v, score_mod=score_mod,  # noqa: E731
                                          block_mask=tbm)
                ref = theirs()
                theirs_ms = best_ms(theirs, reps, dev)
            elif tflex is not None and not opts.no_torch:
                tbm = tflex.create_block_mask(mask_mod, None, None, s, s, device=dev)
                ref = tflex.flex_attention(q, k, v, score_mod=score_mod, block_mask=tbm)
            if ref is not None:
                diff = (out.float() - ref.float()).abs().max().item()
                if not diff <= tol:
                    raise SystemExit("%s: flashattn and torch differ by %g" % (name, diff))
            ms = best_ms(ours, reps, dev)
            base_ms = best_ms(base, reps, dev) if base is not None else None
        print("| %s | %.2f | %s | %s | %s | %s |" % (
            name, ms, "%.2f" % theirs_ms if theirs_ms else "-",
            "%.2fx" % (theirs_ms / ms) if theirs_ms else "-",
            "%.2f" % base_ms if base_ms else "-", "%.1e" % diff if diff is not None else "-"),
            flush=True)


if __name__ == "__main__":
    main()
