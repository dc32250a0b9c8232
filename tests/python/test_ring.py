"""Ring attention (flashattn.distributed) against single-process flash_attn_func.

2 and 4 ranks are spawned with the gloo backend on CPU tensors (file:// rendezvous in the test's
tmp dir). Every rank draws the same full-sequence inputs from one seed (derived from the
conftest rng, so FLASHATTN_TEST_SEED reproduces a run; it is also in every failure message),
runs flash_attn_func + autograd on the whole sequence, and compares its own shard of out, dq,
dk, dv with what ring_flash_attn_func gives it. The cases of one world size run in one spawn
(process start-up dominates the cost).
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashattn import flash_attn_func
from flashattn.distributed import ring_flash_attn_func, zigzag_shard, zigzag_unshard

TOL = {torch.float64: 1e-11, torch.float32: 2e-5}

# (layout, causal, window, h, hk, dtype, softcap)
CASES = [
    ("contiguous", False, (-1, -1), 4, 4, torch.float64, 0.0),
    ("contiguous", True, (-1, -1), 4, 2, torch.float64, 0.0),
    ("zigzag", True, (-1, -1), 4, 1, torch.float64, 0.0),
    ("zigzag", False, (-1, -1), 2, 2, torch.float64, 0.0),
    ("contiguous", True, (-1, -1), 4, 2, torch.float32, 0.0),
    ("zigzag", True, (-1, -1), 4, 2, torch.float32, 0.0),
    ("contiguous", False, (-1, -1), 2, 1, torch.float32, 0.0),
    ("contiguous", False, (5, 3), 4, 2, torch.float64, 0.0),
    ("zigzag", True, (7, -1), 2, 1, torch.float64, 0.0),
    ("zigzag", False, (2, 9), 4, 4, torch.float32, 2.5),
]


def _shard(x, layout, rank, world):
    if layout == "zigzag":
        return zigzag_shard(x, rank, world)
    return x.chunk(world, dim=1)[rank]


def _check(name, got, want, tol, what):
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= tol * scale, "%s: %s max abs error %.3g > %.3g" % (what, name, err, tol * scale)


def _worker(rank, world, init, seed):
    os.environ.setdefault("FLASHATTN_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    passed = False
    try:
        for i, (layout, causal, window, h, hk, dtype, softcap) in enumerate(CASES):
            what = "seed %d, world %d, case %d %s" % (seed, world, i, CASES[i])
            gen = torch.Generator().manual_seed(seed * 131 + i)
            b, s_local, d, dv = 2, 6, 8, 12
            s = s_local * world
            full = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
            q, k, v = full(b, s, h, d), full(b, s, hk, d), full(b, s, hk, dv)
            dout = full(b, s, h, dv)
            scale = 0.3 + 0.4 * torch.rand((), generator=gen).item()
            opts = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)

            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
            ref = flash_attn_func(q, k, v, **opts)
            ref_grads = torch.autograd.grad(ref, (q, k, v), dout)

            ql, kl, vl = (_shard(x.detach(), layout, rank, world).requires_grad_()
                          for x in (q, k, v))
            out, lse = ring_flash_attn_func(ql, kl, vl, layout=layout, return_lse=True, **opts)
            grads = torch.autograd.grad(out, (ql, kl, vl), _shard(dout, layout, rank, world))

            tol = TOL[dtype]
            _check("out", out, _shard(ref.detach(), layout, rank, world), tol, what)
            for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
                _check(name, g, _shard(r, layout, rank, world), tol, what)
            _, ref_lse, _ = flash_attn_func(q.detach(), k.detach(), v.detach(),
                                            return_attn_probs=True, **opts)
            ref_lse = _shard(ref_lse.transpose(1, 2), layout, rank, world).transpose(1, 2)
            _check("lse", lse.float(), ref_lse, 2e-5, what)

            if i == 0 or layout == "zigzag":
                # The shards of every rank put back together give the full output.
                parts = [torch.empty_like(out) for _ in range(world)]
                dist.all_gather(parts, out.detach().contiguous())
                whole = zigzag_unshard(parts) if layout == "zigzag" else torch.cat(parts, 1)
                _check("gathered out", whole, ref.detach(), tol, what)
        # gloo aborts a rank whose peers close their connections under it: leave together.
        dist.barrier()
        passed = True
    finally:
        dist.destroy_process_group()
    # gloo's background threads can still be joinable when the interpreter tears down its
    # C++ statics, which aborts the process ("terminate called without an active exception")
    # after every check has passed: leave without running those destructors.
    if passed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_single_process(world, rng, tmp_path):
    seed = int(rng.integers(0, 2**31 - 1))
    init = "file://" + str(tmp_path / "rendezvous")
    mp.spawn(_worker, args=(world, init, seed), nprocs=world, join=True)


def test_zigzag_round_trip(rng):
    world = 3
    x = torch.tensor(rng.standard_normal((2, 6 * world, 3)))
    shards = [zigzag_shard(x, r, world) for r in range(world)]
    assert torch.equal(zigzag_unshard(shards), x)
    # Rank r holds chunks r and 2*world-1-r.
    c = x.chunk(2 * world, dim=1)
    assert torch.equal(shards[1], torch.cat([c[1], c[4]], 1))
    with pytest.raises(ValueError):
        zigzag_shard(x[:, :5], 0, world)


def test_single_rank_group(rng, tmp_path):
    """world 1 (no communication) with both layouts, through the pair planner."""
    mp.spawn(_worker, args=(1, "file://" + str(tmp_path / "rdv1"),
                            int(rng.integers(0, 2**31 - 1))), nprocs=1, join=True)


def test_rejects_unsupported():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(NotImplementedError):
        ring_flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError):
        ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError):
        ring_flash_attn_func(q, q, q, layout="striped")
    with pytest.raises(ValueError):
        ring_flash_attn_func(q[:, :3], q[:, :3], q[:, :3], layout="zigzag")
