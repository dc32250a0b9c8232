"""Ring attention (flashattn.distributed) on CUDA tensors, fp16 and bf16, forward and backward,
against flash_attn_func on the gathered sequence and an fp32 CPU reference.

    PYTHONPATH=python FLASHATTN_LIBRARY=build-cuda/libflashattn.so \\
        python3 -m pytest -q tests/gpu/test_ring_cuda.py

- One rank with the NCCL backend, in this process: the public function with autograd. With one
  rank the ring never communicates (a rank would otherwise send to itself, which
  torch.distributed refuses); the test checks that no point-to-point call is made.
- 2 and 4 ranks on one GPU as threads of this process, with an in-process ring in place of
  torch.distributed: the ring's forward and backward (pair planning, lse merges, dK/dV
  travelling back) on CUDA tensors, which one GPU cannot run over NCCL (NCCL refuses two ranks
  on one device).
- 2 and 4 NCCL ranks, one GPU each, spawned by the test: skipped where fewer GPUs are present.
"""
import os
import queue
import sys
import threading

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

from flashattn import flash_attn_func  # noqa: E402
from flashattn import distributed as ring_module  # noqa: E402
from flashattn.distributed import (ring_flash_attn_func, zigzag_shard,  # noqa: E402
                                   zigzag_unshard)

DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}

# (layout, causal, window, h, hk, softcap)
CASES = [
    ("contiguous", False, (-1, -1), 8, 2, 0.0),
    ("zigzag", True, (-1, -1), 8, 2, 0.0),
    ("contiguous", True, (-1, -1), 4, 4, 0.0),
    ("zigzag", True, (100, -1), 8, 1, 0.0),
    ("contiguous", False, (70, 30), 4, 2, 20.0),
]
CASE_IDS = ["-".join(str(x) for x in c) for c in CASES]


def _shard(x, layout, rank, world):
    if layout == "zigzag":
        return zigzag_shard(x, rank, world)
    return x.chunk(world, dim=1)[rank]


def _inputs(seed, s, h, hk, dtype, device):
    """q, k, v, dout for the whole sequence (b = 2, d = 64), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, s, h, 64), (2, s, hk, 64), (2, s, hk, 64), (2, s, h, 64))
    return [torch.randn(*shape, generator=g).to(device, dtype) for shape in shapes]


def _reference(q, k, v, dout, opts):
    """flash_attn_func on the whole sequence: (out, dq, dk, dv) on the tensors' device and in
    fp32 on the CPU."""
    results = []
    for device, dtype in ((q.device, q.dtype), ("cpu", torch.float32)):
        x = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*x, **opts)
        results.append([out.detach()] + list(torch.autograd.grad(out, x,
                                                                 dout.to(device, dtype))))
    return results


def _check(name, got, want, tol, what):
    want = want.float().cpu()
    err = (got.float().cpu() - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= tol * scale, "%s: %s max abs error %.3g > %.3g" % (what, name, err,
                                                                     tol * scale)


def _compare(results, refs, layout, rank, world, dtype, what):
    """Each of (out, dq, dk, dv) against this rank's shard of the fp32 reference, and not much
    further from it than flash_attn_func on the device gets."""
    device_ref, cpu_ref = refs
    for name, got, dev, ref in zip(("out", "dq", "dk", "dv"), results, device_ref, cpu_ref):
        assert got.dtype == dtype and got.is_cuda, (name, got.dtype, got.device)
        ref = _shard(ref, layout, rank, world)
        _check(name, got, ref, TOL[dtype], what)
        # The ring rounds each pair's result to the dtype before merging: a few roundings more.
        floor = (_shard(dev, layout, rank, world).float().cpu() - ref).abs().max().item()
        err = (got.float().cpu() - ref).abs().max().item()
        slack = 2 * torch.finfo(dtype).eps * max(1.0, ref.abs().max().item())
        assert err <= 8 * floor + slack, (
            "%s: %s error %.3g vs flash_attn_func's %.3g" % (what, name, err, floor))


# --------------------------------------------------------------------------------------------
# One NCCL rank in this process


@pytest.fixture(scope="module")
def nccl_one_rank(tmp_path_factory):
    torch.cuda.set_device(0)
    init = "file://" + str(tmp_path_factory.mktemp("nccl") / "rendezvous")
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_nccl_one_rank(nccl_one_rank, gen, monkeypatch, dtype, case):
    layout, causal, window, h, hk, softcap = case
    sent = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: sent.append(ops) or [])
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    q, k, v, dout = _inputs(seed, 512, h, hk, dtype, "cuda")
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    refs = _reference(q, k, v, dout, opts)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_flash_attn_func(*x, layout=layout, **opts)
    grads = torch.autograd.grad(out, x, dout)
    assert sent == [], "one rank must not send to itself"
    _compare([out.detach()] + list(grads), refs, layout, 0, 1, dtype,
             "seed %d, one NCCL rank, %s" % (seed, case))


# --------------------------------------------------------------------------------------------
# Several ranks on one GPU: threads and an in-process ring


class _ThreadRing:
    """The ring of ``flashattn.distributed`` (``_Ring``'s interface) between threads of this
    process: a transfer puts a copy of the sent tensor in the next rank's mailbox; waiting on
    it copies the mailbox's tensor into the receive buffer. Every thread issues its work on the
    device's default stream, so a transfer is ordered after the sender's writes."""

    def __init__(self, boxes, rank, world):
        self.boxes, self.rank, self.world = boxes, rank, world
        self.next = (rank + 1) % world

    def exchange(self, send, recv, tag):
        self.boxes[(self.next, tag)].put(send.clone())
        box = self.boxes[(self.rank, tag)]

        class Transfer:
            @staticmethod
            def wait():
                recv.copy_(box.get(timeout=120))

        return [Transfer()]


def _threaded_ring(world, fn):
    """fn(ring, rank) on ``world`` threads; returns their results in rank order."""
    boxes = {(r, tag): queue.Queue() for r in range(world)
             for tag in (ring_module._TAG_KV, ring_module._TAG_DKV)}
    results, errors = [None] * world, []

    def run(rank):
        try:
            with torch.cuda.stream(torch.cuda.default_stream()):
                results[rank] = fn(_ThreadRing(boxes, rank, world), rank)
        except BaseException as e:  # reported below, with the rank
            errors.append((rank, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_ring_threads_one_gpu(gen, dtype, world, case):
    layout, causal, window, h, hk, softcap = case
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    q, k, v, dout = _inputs(seed, 128 * world, h, hk, dtype, "cuda")
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    refs = _reference(q, k, v, dout, opts)
    scale = 64 ** -0.5
    left, right = window[0], 0 if causal else window[1]

    def rank_fn(ring, rank):
        ql, kl, vl, dl = (_shard(t, layout, rank, world).contiguous() for t in (q, k, v, dout))
        out, lse = ring_module._ring_forward(ring, ql, kl, vl, scale, left, right, softcap,
                                             False, layout)
        grads = ring_module._ring_backward(ring, dl, ql, kl, vl, out, lse, scale, left, right,
                                           softcap, False, layout)
        torch.cuda.synchronize()
        return [out] + list(grads)

    results = _threaded_ring(world, rank_fn)
    what = "seed %d, %d threaded ranks, %s" % (seed, world, case)
    for rank, res in enumerate(results):
        _compare(res, refs, layout, rank, world, dtype, "%s, rank %d" % (what, rank))
    if layout == "zigzag":
        whole = zigzag_unshard([r[0] for r in results])
        _check("gathered out", whole, refs[1][0], TOL[dtype], what)


# --------------------------------------------------------------------------------------------
# NCCL across GPUs


def _nccl_worker(rank, world, init, seed):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        for i, case in enumerate(CASES):
            layout, causal, window, h, hk, softcap = case
            for dtype in DTYPES:
                q, k, v, dout = _inputs(seed + i, 128 * world, h, hk, dtype, "cuda")
                opts = dict(causal=causal, window_size=window, softcap=softcap)
                refs = _reference(q, k, v, dout, opts)
                x = [_shard(t, layout, rank, world).contiguous().requires_grad_()
                     for t in (q, k, v)]
                out = ring_flash_attn_func(*x, layout=layout, **opts)
                grads = torch.autograd.grad(out, x, _shard(dout, layout, rank, world))
                _compare([out.detach()] + list(grads), refs, layout, rank, world, dtype,
                         "seed %d, %d NCCL ranks, %s, %s" % (seed + i, world, case, dtype))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_ranks_on_gpus(gen, tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip("%d CUDA devices, %d ranks need one each" % (torch.cuda.device_count(),
                                                                 world))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    mp.spawn(_nccl_worker, args=(world, "file://" + str(tmp_path / "rendezvous"), seed),
             nprocs=world, join=True)
