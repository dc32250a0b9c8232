"""Ring attention (context parallelism) over ``torch.distributed``.

    import torch.distributed as dist
    from flashattn.distributed import ring_flash_attn_func, zigzag_shard, zigzag_unshard

    # every rank of the group holds the same-sized shard of the sequence, [b, s_local, h, d]
    out = ring_flash_attn_func(q, k, v, causal=True)                 # contiguous shards
    out = ring_flash_attn_func(zigzag_shard(q, rank, world), ...,    # load-balanced causal
                               causal=True, layout="zigzag")

Each rank keeps its query shard; the K/V shards travel around the ring (rank r sends to r + 1
and receives from r - 1, ``dist.batch_isend_irecv``), the transfer of the next shard overlapping
the attention of the shard in hand. The partial results of a query shard are merged exactly
through their log-sum-exp, in fp32 (fp64 for fp64 inputs):

    lse = logaddexp(lse_acc, lse_i);  out = out_acc * exp(lse_acc - lse) + out_i * exp(lse_i - lse)

Backward (``torch.autograd.Function``): the K/V shards travel the same way, and with each one a
dK/dV accumulator that every rank adds its contribution to; after a full turn it reaches its
owner. dQ accumulates locally. Each (q shard, kv shard) pair calls the library's backward with
the GLOBAL ``out`` and ``lse`` of the query rows: the backward recomputes P = exp(S - lse) and
D = rowsum(dout * out), so those are the probabilities and the D of the full attention, and the
pairwise gradients sum exactly to the full gradient.

Masks. Positions are global: query i sees key j when j - i lies in [-left, right] (``causal``
sets right = 0), exactly as ``flash_attn_func`` on the gathered sequence (seqlen_q == seqlen_k).
Each rank holds one chunk (``layout="contiguous"``: rank r holds positions [r*s, (r+1)*s)) or
two (``layout="zigzag"``: the sequence cut into 2*world chunks, rank r holds chunks r and
2*world-1-r, so that causal work is the same on every rank). For every pair of chunks the
visible block of the global mask is cut out (rows and keys that see nothing are skipped) and
expressed to the library as a bottom-right aligned window: pairs that see nothing cost nothing,
fully visible pairs run unmasked.

Devices. The code is device-neutral: CPU tensors with the gloo backend, CUDA tensors with NCCL
(one GPU per rank, selected with ``torch.cuda.set_device`` before the first call, as NCCL's
batched point-to-point operations require). On CUDA tensors the backward is the library's CUDA
backward (fp16/bf16). A group of one rank never communicates: there is no transfer at the last
step, and a one-rank ring has only that step, so the send to oneself that torch.distributed
refuses never happens.
tests/gpu/test_ring_cuda.py runs the CUDA path (one NCCL rank, several ranks as threads on one
GPU, NCCL across GPUs where there are several).

Not supported: dropout and ALiBi (they raise NotImplementedError); learnable sinks and varlen
are not parameters yet.
"""

import torch
import torch.distributed as dist

__all__ = ["ring_flash_attn_func", "zigzag_shard", "zigzag_unshard"]

_LAYOUTS = ("contiguous", "zigzag")
_TAG_KV = 11
_TAG_DKV = 12


# --------------------------------------------------------------------------------------------
# Layout helpers


def zigzag_shard(x, rank, world, dim=1):
    """Rank ``rank``'s shard of the full sequence ``x`` in the zigzag layout.

    ``x`` is cut along ``dim`` into 2*world equal chunks c_0 .. c_{2w-1}; rank r gets
    cat(c_r, c_{2w-1-r}), one early and one late chunk, so that with a causal mask every rank
    has the same amount of work. The sequence length must be a multiple of 2*world."""
    n = x.shape[dim]
    if n % (2 * world) != 0:
        raise ValueError("zigzag_shard: the sequence length %d (dim %d) is not a multiple of "
                         "2 * world = %d" % (n, dim, 2 * world))
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards, dim=1):
    """The full sequence from the zigzag shards of every rank, in rank order (for example what
    ``dist.all_gather`` returns): the inverse of ``zigzag_shard``."""
    early, late = [], []
    for s in shards:
        a, b = s.chunk(2, dim=dim)
        early.append(a)
        late.append(b)
    return torch.cat(early + late[::-1], dim=dim)


def _chunks(layout, rank, world, s_local):
    """(global start, length, offset in the local shard) of each chunk a rank holds."""
    if layout == "contiguous":
        return [(rank * s_local, s_local, 0)]
    c = s_local // 2
    return [(rank * c, c, 0), ((2 * world - 1 - rank) * c, c, c)]


def _pair_plan(qc, kc, left, right):
    """The visible block of a (query chunk, key chunk) pair, or None when nothing is visible.

    Returns (q_lo, q_hi, k_lo, k_hi, win_left, win_right): local row ranges in the two shards
    and the window (bottom-right aligned, -1 unbounded) that gives the library the global
    mask on that block. ``left``/``right`` are the global window (-1 unbounded)."""
    qs, lq, qo = qc
    ks, lk, ko = kc
    # query row i (local to the chunk) sees key column j when j - i is in [lo, hi].
    lo = None if left < 0 else qs - ks - left
    hi = None if right < 0 else qs - ks + right
    i0 = 0 if hi is None else max(0, -hi)
    i1 = lq if lo is None else min(lq, lk - lo)
    if i0 >= i1:
        return None
    j0 = 0 if lo is None else max(0, i0 + lo)
    j1 = lk if hi is None else min(lk, i1 - 1 + hi + 1)
    if j0 >= j1:
        return None
    # The last visible row's last visible key is the block's bottom-right corner, so the
    # block's diagonal offset lies inside [lo, hi] and both window sides are >= 0.
    diag = (j1 - j0) - (i1 - i0)
    wl = -1 if lo is None else diag - (lo - j0 + i0)
    wr = -1 if hi is None else (hi - j0 + i0) - diag
    assert wl >= -1 and wr >= -1, (qc, kc, left, right)
    return qo + i0, qo + i1, ko + j0, ko + j1, wl, wr


# --------------------------------------------------------------------------------------------
# Communication


class _Ring:
    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        nxt = (self.rank + 1) % self.world
        prv = (self.rank - 1) % self.world
        if group is None or group is dist.group.WORLD:
            self.next, self.prev = nxt, prv
        else:
            self.next = dist.get_global_rank(group, nxt)
            self.prev = dist.get_global_rank(group, prv)

    def exchange(self, send, recv, tag):
        """Starts sending ``send`` to the next rank and receiving ``recv`` from the previous;
        returns the requests (``_wait``). ``send`` must not change until they complete."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops)


def _wait(reqs):
    for r in reqs:
        r.wait()


def _pack(a, b):
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(buf, shape_a, shape_b):
    na = 1
    for n in shape_a:
        na *= n
    return buf[:na].view(shape_a), buf[na:].view(shape_b)


# --------------------------------------------------------------------------------------------
# Local attention on one block


def _acc_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _block_fwd(q, k, v, scale, wl, wr, softcap, deterministic):
    out, lse, _, _ = torch.ops.flashattn.fwd(q, k, v, None, None, None, 0.0, scale, False, wl,
                                             wr, softcap, False, deterministic)
    return out, lse


def _block_bwd(dout, q, k, v, out, lse, scale, wl, wr, softcap, deterministic, rng):
    dq, dk, dv, _ = torch.ops.flashattn.bwd(dout, q, k, v, out, lse, None, None, rng, 0.0,
                                            scale, False, wl, wr, softcap, deterministic)
    return dq, dk, dv


def _merge(acc_out, acc_lse, out, lse):
    """acc_out [b, n, h, dv] and acc_lse [b, h, n] (views, updated in place) absorb a partial
    result whose rows all see at least one key (finite lse)."""
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    w_old = torch.exp(acc_lse - new).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_old).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new)


def _ring_forward(ring, q, k, v, scale, left, right, softcap, deterministic, layout):
    b, s, h, _ = q.shape
    acc = _acc_dtype(q)
    acc_out = torch.zeros((b, s, h, v.shape[-1]), dtype=acc, device=q.device)
    acc_lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    mine = _chunks(layout, ring.rank, ring.world, s)
    cur = _pack(k, v)
    for step in range(ring.world):
        reqs = None
        if step < ring.world - 1:
            nxt = torch.empty_like(cur)
            reqs = ring.exchange(cur, nxt, _TAG_KV)
        src = (ring.rank - step) % ring.world
        ks, vs = _unpack(cur, k.shape, v.shape)
        for qc in mine:
            for kc in _chunks(layout, src, ring.world, s):
                plan = _pair_plan(qc, kc, left, right)
                if plan is None:
                    continue
                q0, q1, k0, k1, wl, wr = plan
                o, l = _block_fwd(q[:, q0:q1], ks[:, k0:k1], vs[:, k0:k1], scale, wl, wr,
                                  softcap, deterministic)
                _merge(acc_out[:, q0:q1], acc_lse[:, :, q0:q1], o, l)
        if reqs is not None:
            _wait(reqs)
            cur = nxt
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(ring, dout, q, k, v, out, lse, scale, left, right, softcap, deterministic,
                   layout):
    s = q.shape[1]
    acc = _acc_dtype(q)
    lse_lib = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    rng = torch.zeros((2,), dtype=torch.int64, device=q.device)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    mine = _chunks(layout, ring.rank, ring.world, s)
    cur = _pack(k, v)
    dkv = None          # the accumulator of the kv shard in hand, complete up to this rank
    dkv_reqs = None     # its transfer from the previous rank, into dkv_recv
    dkv_recv = None
    for step in range(ring.world):
        reqs = None
        if step < ring.world - 1:
            nxt = torch.empty_like(cur)
            reqs = ring.exchange(cur, nxt, _TAG_KV)
        src = (ring.rank - step) % ring.world
        ks, vs = _unpack(cur, k.shape, v.shape)
        local = torch.zeros(cur.shape, dtype=acc, device=q.device)
        dks, dvs = _unpack(local, k.shape, v.shape)
        for qc in mine:
            for kc in _chunks(layout, src, ring.world, s):
                plan = _pair_plan(qc, kc, left, right)
                if plan is None:
                    continue
                q0, q1, k0, k1, wl, wr = plan
                g = _block_bwd(dout[:, q0:q1], q[:, q0:q1], ks[:, k0:k1], vs[:, k0:k1],
                               out[:, q0:q1], lse_lib[:, :, q0:q1].contiguous(), scale, wl, wr,
                               softcap, deterministic, rng)
                dq[:, q0:q1] += g[0]
                dks[:, k0:k1] += g[1]
                dvs[:, k0:k1] += g[2]
        if dkv_reqs is not None:
            _wait(dkv_reqs)
            local += dkv_recv
        dkv = local
        if ring.world > 1:
            # The last step sends the complete accumulator to its owner (the next rank).
            dkv_recv = torch.empty_like(dkv)
            dkv_reqs = ring.exchange(dkv, dkv_recv, _TAG_DKV)
        if reqs is not None:
            _wait(reqs)
            cur = nxt
    if dkv_reqs is not None:
        _wait(dkv_reqs)
        dkv = dkv_recv
    dk, dv = _unpack(dkv, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingFlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, left, right, softcap, deterministic, layout):
        out, lse = _ring_forward(ring, q, k, v, scale, left, right, softcap, deterministic,
                                 layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (ring, scale, left, right, softcap, deterministic, layout)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, left, right, softcap, deterministic, layout = ctx.options
        dq, dk, dv = _ring_backward(ring, dout.contiguous(), q, k, v, out, lse, scale, left,
                                    right, softcap, deterministic, layout)
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, deterministic=False,
                         layout="contiguous", return_lse=False, dropout_p=0.0,
                         alibi_slopes=None):
    """Attention over a sequence sharded across the ranks of ``group`` (ring attention).

    Arguments:
        q: (batch_size, s_local, nheads, headdim), this rank's query shard.
        k, v: (batch_size, s_local, nheads_k, headdim[_v]), its key/value shard (GQA/MQA:
            nheads % nheads_k == 0). Every rank of the group has the same shapes and dtype.
        group: a ``torch.distributed`` process group (default: the world).
        causal, softmax_scale, window_size, softcap, deterministic: as ``flash_attn_func`` on
            the gathered sequence (window_size in global positions).
        layout: "contiguous" (rank r holds positions [r*s_local, (r+1)*s_local)) or "zigzag"
            (``zigzag_shard``: chunks r and 2*world-1-r of 2*world; s_local must be even).
        return_lse: also return the global log-sum-exp of this rank's rows, (b, nheads,
            s_local), fp32 (fp64 for fp64 inputs).
    Return:
        out (batch_size, s_local, nheads, headdim_v) for this rank's queries; with
        ``return_lse``, (out, lse). Differentiable (q, k, v get the gradients of their
        shards); on CUDA tensors as far as the library's CUDA backward goes.
    """
    if float(dropout_p) != 0.0:
        raise NotImplementedError("ring_flash_attn_func: dropout is not supported")
    if alibi_slopes is not None:
        raise NotImplementedError("ring_flash_attn_func: alibi_slopes is not supported")
    if layout not in _LAYOUTS:
        raise ValueError("ring_flash_attn_func: layout must be one of %s, got %r"
                         % (_LAYOUTS, layout))
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ring_flash_attn_func: q, k, v must be (batch, s_local, heads, dim)")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError("ring_flash_attn_func: q, k and v shards must have the same length, "
                         "got %d, %d, %d" % (q.shape[1], k.shape[1], v.shape[1]))
    if layout == "zigzag" and q.shape[1] % 2 != 0:
        raise ValueError("ring_flash_attn_func: the zigzag layout needs an even s_local, got %d"
                         % q.shape[1])
    if k.dtype != v.dtype:
        raise ValueError("ring_flash_attn_func: k and v must have the same dtype")
    from . import _core
    from . import _torch_ops  # noqa: F401  (registers torch.ops.flashattn.*)

    left, right = _core.window_pair(window_size)
    if causal:
        right = 0
    scale = None if softmax_scale is None else float(softmax_scale)  # None: C's default
    ring = _Ring(group)
    out, lse = _RingFlashAttn.apply(q, k, v, ring, scale, left, right, float(softcap),
                                    bool(deterministic), layout)
    return (out, lse) if return_lse else out
