"""PyTorch SDPA's flash and cuDNN backward at the shapes of `test_gpu_backward --bench`
(b 4, h 16, seqlen 4096, hdim 128, bf16, causal and not), for the table in bench/NOTES.md.
Times out.backward(dout) with CUDA events (best of 10 after 3 warm-ups); TFLOP/s counts the
backward as upstream's benchmark does: 2.5 x 4 b h s^2 d, halved when causal."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, S, D = 4, 16, 4096, 128


def bench(backend, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        best = float("inf")
        for it in range(13):
            q.grad = k.grad = v.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out.backward(dout, retain_graph=True)
            end.record()
            torch.cuda.synchronize()
            if it >= 3:
                best = min(best, start.elapsed_time(end))
    flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
    return best, flops / best * 1e-9


for causal in (False, True):
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            ms, tf = bench(backend, causal)
            print(f"torch {name} bwd b{B} h{H} s{S} d{D} bf16 causal={int(causal)}: "
                  f"{ms:.3f} ms, {tf:.1f} TFLOP/s")
        except Exception as e:  # a backend missing on this build of torch
            print(f"torch {name} causal={int(causal)}: unavailable ({e})")
