"""One backward of flashattn, or of SDPA's cuDNN backend, between cudaProfilerStart/Stop, for
ncu (tests/gpu/profile_bwd.sh) or torch.profiler (--kernels): the calls before it warm the
compiled kernels and the caching allocator up, so only the backward's own kernels are seen.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 tests/gpu/profile_bwd.py [--impl ours|cudnn] [--hdim 128] [--seqlen 4096]
        [--dv DV] [--causal] [--kernels]

bf16, bench_bwd's shapes (batch 16384 / seqlen, heads 2048 / hdim; --dv: V's head dim).
--kernels prints, for 10 backward calls back to back, the CUDA-event time per call beside the
kernels' summed time and span per call (torch.profiler), and each kernel's time: what the host
or the gaps between kernels add to the GPU's own work.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_func


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("ours", "cudnn"), default="ours")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--dv", type=int, default=0, help="V's head dim (default: the hdim)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--kernels", action="store_true")
    a = ap.parse_args()
    d, s = a.hdim, a.seqlen
    b, h = max(1, 16384 // s), 2048 // d
    dv = a.dv or d
    x = [torch.randn(b, s, h, n, device="cuda", dtype=torch.bfloat16).requires_grad_()
         for n in (d, d, dv)]
    dout = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
    if a.impl == "ours":
        out = flash_attn_func(*x, causal=a.causal)
    else:
        x = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in x]
        dout = dout.transpose(1, 2).contiguous()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(*x, is_causal=a.causal)

    def bwd():
        torch.autograd.grad(out, x, dout, retain_graph=True)

    for _ in range(5):
        bwd()
    torch.cuda.synchronize()
    if not a.kernels:
        torch.cuda.profiler.start()
        bwd()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    best = float("inf")
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            bwd()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / 10)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            bwd()
        torch.cuda.synchronize()
    ks = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    span = max(e.time_range.end for e in ks) - min(e.time_range.start for e in ks)
    busy = sum(e.time_range.elapsed_us() for e in ks)
    print("%s d%d s%d causal=%d: events %.3f ms/call; kernels %.3f ms/call, span %.3f ms/call"
          % (a.impl, d, s, a.causal, best, busy / 1e4, span / 1e4))
    per = {}
    for e in ks:
        per[e.name[:60]] = per.get(e.name[:60], 0) + e.time_range.elapsed_us() / 10
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print("  %8.1f us  %s" % (us, name))


if __name__ == "__main__":
    main()
