"""Ring attention (flashattn.distributed) on GPUs: what one GPU can measure, and the scaling
across GPUs where there are several.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 tests/gpu/bench_ring.py [--seqlen 32768] [--scaling-seqlen 131072] [--json PATH]

b=1, h=16 (GQA: 4 kv heads), d=128, bf16, causal, best of several timed runs (CUDA events).

1. The ring's own cost: ring_flash_attn_func with one NCCL rank (this process; one rank never
   communicates) against flash_attn_func on the same sequence, forward and forward+backward,
   contiguous and zigzag layouts.
2. One ring step on one GPU: the local attention of a (query shard, key shard) pair alone, the
   transfer of the next K/V shard alone, and both at once, as the ring issues them (the
   transfer on its own stream, as NCCL's runs). One GPU has no peer to send to, so the
   transfer is a device-to-device copy of the packed K/V shard on a side stream: it measures
   how well the attention hides a transfer that competes with it for the same GPU, not a link.
   added = (both - attn) / attn: what issuing the transfer beside the attention costs the step
   (0% when it is hidden entirely; transfer / attn when nothing overlaps).
3. With 2 or more GPUs: NCCL ranks spawned per GPU (1, 2, 4, 8 as available) on a
   --scaling-seqlen sequence in the zigzag layout; tokens/s of the forward and of forward +
   backward, and the speed-up over one GPU.
"""
import argparse
import functools
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashattn import flash_attn_func
from flashattn import distributed as ring_module
from flashattn.distributed import ring_flash_attn_func

import bench_timing  # tests/gpu/bench_timing.py, beside this script

B, H, HK, D = 1, 16, 4, 128
DTYPE = torch.bfloat16


best_ms = functools.partial(bench_timing.best_ms, reps=5, warmup=2)


def qkv(s, seed, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((B, s, H, D), (B, s, HK, D), (B, s, HK, D))
    return [torch.randn(*shape, device="cuda", generator=g).to(DTYPE).requires_grad_(grad)
            for shape in shapes]


def fwd_bwd(f, x, dout):
    def run():
        out = f(*x)
        torch.autograd.grad(out, x, dout)
    return run


def ring_cost(s):
    """Part 1: {name: ms}."""
    x = qkv(s, 1, grad=True)
    dout = torch.randn(B, s, H, D, device="cuda").to(DTYPE)
    plain = lambda *t: flash_attn_func(*t, causal=True)  # noqa: E731
    res = {
        "flash_attn_func fwd": best_ms(lambda: plain(*x)),
        "flash_attn_func fwd+bwd": best_ms(fwd_bwd(plain, x, dout)),
    }
    for layout in ("contiguous", "zigzag"):
        ring = lambda *t: ring_flash_attn_func(*t, causal=True, layout=layout)  # noqa: E731
        res["ring (1 rank, %s) fwd" % layout] = best_ms(lambda: ring(*x))
        res["ring (1 rank, %s) fwd+bwd" % layout] = best_ms(fwd_bwd(ring, x, dout))
    return res


def step_overlap(s, world):
    """Part 2 for a ring of ``world`` ranks over an ``s``-token sequence: ms of the pair's
    attention (forward; forward+backward of the pair) and of the transfer, alone and
    together."""
    s_local = s // world
    q, k, v = qkv(s_local, 2)
    k2, v2 = qkv(s_local, 3)[1:]
    dout = torch.randn(B, s_local, H, D, device="cuda").to(DTYPE)
    scale = D ** -0.5
    buf = ring_module._pack(k2, v2)
    dst = torch.empty_like(buf)
    side = torch.cuda.Stream()

    def attn():
        ring_module._block_fwd(q, k, v, scale, -1, -1, 0.0, False)

    def attn_bwd():
        out, lse = ring_module._block_fwd(q, k, v, scale, -1, -1, 0.0, False)
        ring_module._block_bwd(dout, q, k, v, out, lse, scale, -1, -1, 0.0, False,
                               torch.zeros(2, dtype=torch.int64))

    def transfer():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(buf)
        torch.cuda.current_stream().wait_stream(side)

    def both(work):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dst.copy_(buf)
            work()
            torch.cuda.current_stream().wait_stream(side)
        return run

    res = {"transfer": best_ms(transfer, reps=10), "pack": best_ms(
        lambda: ring_module._pack(k2, v2), reps=10)}
    for name, work in (("fwd", attn), ("fwd+bwd", attn_bwd)):
        res["attn " + name] = best_ms(work, reps=10)
        res["both " + name] = best_ms(both(work), reps=10)
    res["MB"] = buf.numel() * buf.element_size() / 2**20
    return res


def _scaling_worker(rank, world, init, s, reps, out_path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        s_local = s // world
        x = qkv(s_local, 10 + rank, grad=True)
        dout = torch.randn(B, s_local, H, D, device="cuda").to(DTYPE)
        ring = lambda *t: ring_flash_attn_func(*t, causal=True, layout="zigzag")  # noqa: E731

        def timed(fn):
            dist.barrier()
            ms = torch.tensor([best_ms(fn, reps=reps, warmup=1)], device="cuda")
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            return ms.item()

        res = {"fwd": timed(lambda: ring(*x)), "fwd+bwd": timed(fwd_bwd(ring, x, dout))}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def scaling(s, reps):
    """Part 3: {world: {"fwd": ms, "fwd+bwd": ms}} for the world sizes the GPUs allow."""
    worlds = [w for w in (1, 2, 4, 8) if w <= torch.cuda.device_count()]
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in worlds:
            out_path = os.path.join(tmp, "w%d.json" % w)
            mp.spawn(_scaling_worker, args=(w, "file://" + os.path.join(tmp, "rdv%d" % w), s,
                                            reps, out_path), nprocs=w, join=True)
            with open(out_path) as f:
                res[w] = json.load(f)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--scaling-seqlen", type=int, default=131072)
    ap.add_argument("--json", help="write every number to this file")
    a = ap.parse_args()
    report = {}

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method="file://" + os.path.join(tmp, "rdv"),
                                rank=0, world_size=1)
        try:
            report["ring_cost"] = cost = ring_cost(a.seqlen)
        finally:
            dist.destroy_process_group()
    print("1. ring with one NCCL rank vs flash_attn_func, %d tokens (b=%d, h=%d/%d, d=%d, "
          "bf16, causal)" % (a.seqlen, B, H, HK, D))
    for name, ms in cost.items():
        base = cost["flash_attn_func " + name.rsplit(" ", 1)[1]]
        print("   %-34s %9.3f ms  (%.2fx)" % (name, ms, ms / base))

    print("\n2. one ring step on one GPU (%d-token sequence): the pair's attention, the K/V "
          "transfer (a copy on a side stream), both" % a.seqlen)
    print("   %6s %9s %9s %9s | %9s %9s %8s | %9s %9s %8s" % (
        "world", "shard MB", "transfer", "pack", "attn fwd", "both", "added",
        "fwd+bwd", "both", "added"))
    report["step"] = {}
    for world in (2, 4, 8):
        r = report["step"][world] = step_overlap(a.seqlen, world)
        cells = []
        for name in ("fwd", "fwd+bwd"):
            t_a, t_b = r["attn " + name], r["both " + name]
            cells.append("%9.3f %9.3f %7.1f%%" % (t_a, t_b, 100 * (t_b - t_a) / t_a))
        print("   %6d %9.1f %9.3f %9.3f | %s | %s" % (world, r["MB"], r["transfer"], r["pack"],
                                                    cells[0], cells[1]))

    if torch.cuda.device_count() < 2:
        print("\n3. scaling: skipped, %d CUDA device (ranks need one GPU each; NCCL refuses "
              "two ranks on one device)" % torch.cuda.device_count())
    else:
        report["scaling"] = sc = scaling(a.scaling_seqlen, reps=3)
        print("\n3. scaling, %d tokens, zigzag causal: tokens/s (speed-up over 1 GPU)"
              % a.scaling_seqlen)
        for w, r in sc.items():
            print("   %d GPU%s  fwd %12.0f (%.2fx)   fwd+bwd %12.0f (%.2fx)" % (
                w, "s" if w > 1 else " ", a.scaling_seqlen / r["fwd"] * 1e3,
                sc[1]["fwd"] / r["fwd"], a.scaling_seqlen / r["fwd+bwd"] * 1e3,
                sc[1]["fwd+bwd"] / r["fwd+bwd"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
