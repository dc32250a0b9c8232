"""Forward, backward and forward + backward of flashattn beside PyTorch SDPA's flash and cuDNN
backends, measured side by side in one process, for the backward's table in bench/NOTES.md.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 tests/gpu/bench_bwd.py [--hdims 64,128] [--seqlens 2048,4096,8192,16384]
        [--json PATH] [--calls N]

bf16, FlashAttention's benchmark shapes (16k tokens: batch 16384 / seqlen; hidden 2048: heads
2048 / hdim), causal and not. Each figure is the best of 10 timed runs after 3 warm-ups (CUDA
events); a run is one call, or with --calls N, N calls back to back (the host's work per call
hidden behind the GPU's, as upstream's benchmark and a training loop have it). TFLOP/s as upstream counts them: forward 4 b h s^2 d (halved when causal), backward 2.5x
that, forward + backward 3.5x. On sm_90 the Hopper backward runs; FLASHATTN_BWD_SM90=0 measures
the sm80 family instead.
"""
import argparse
import functools
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_func

import bench_timing  # tests/gpu/bench_timing.py, beside this script

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
PASSES = ("fwd", "bwd", "fwd+bwd")


def passes(attn, x, dout, calls):
    """{pass: ms} of attn(*x) (its inputs require grad)."""
    best_ms = functools.partial(bench_timing.best_ms, reps=10, warmup=3, calls=calls)
    out = attn(*x)
    return {
        "fwd": best_ms(lambda: attn(*x)),
        "bwd": best_ms(lambda: torch.autograd.grad(out, x, dout, retain_graph=True)),
        "fwd+bwd": best_ms(lambda: torch.autograd.grad(attn(*x), x, dout)),
    }


def row(d, s, causal, calls):
    b, h = max(1, 16384 // s), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(s * 131 + d)
    x = [torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
         .requires_grad_() for _ in range(3)]
    dout = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    fwd_flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
    r = dict(hdim=d, seqlen=s, batch=b, heads=h, causal=causal)
    ms = passes(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), x, dout, calls)
    r["ours"] = {p: flops[p] / ms[p] * 1e-9 for p in PASSES}
    xt = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in x]
    dt = dout.transpose(1, 2).contiguous()
    for name, be in BACKENDS.items():
        try:
            with sdpa_kernel([be]):
                ms = passes(lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                           is_causal=causal),
                            xt, dt, calls)
            r[name] = {p: flops[p] / ms[p] * 1e-9 for p in PASSES}
        except RuntimeError as e:  # a backend this build of torch lacks
            r[name] = None
            r[name + "_error"] = str(e).splitlines()[0][:100]
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--calls", type=int, default=1, help="calls per timed run, back to back")
    a = ap.parse_args()
    rows = []
    for d in [int(x) for x in a.hdims.split(",")]:
        for s in [int(x) for x in a.seqlens.split(",")]:
            for causal in (False, True):
                rows.append(row(d, s, causal, a.calls))
                print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("\nTFLOP/s, bf16, %s, %d call(s) per timed run: ours / flash / cudnn, and ours over "
          "cudnn" % (torch.cuda.get_device_name(), a.calls))
    print("hdim seqlen causal |        fwd        |        bwd        |      fwd+bwd      | "
          "bwd/cudnn fwd+bwd/cudnn")
    fmt = lambda r, p: "%5.0f" % r[p] if r else "    -"  # noqa: E731
    for r in rows:
        cells = " | ".join(" ".join(fmt(r[k], p) for k in ("ours", "flash", "cudnn"))
                           for p in PASSES)
        ratio = lambda p: (r["ours"][p] / r["cudnn"][p]) if r["cudnn"] else float("nan")  # noqa
        print("%4d %6d %-6s | %s | %9.2f %13.2f" % (r["hdim"], r["seqlen"], r["causal"], cells,
                                                     ratio("bwd"), ratio("fwd+bwd")))


if __name__ == "__main__":
    main()
