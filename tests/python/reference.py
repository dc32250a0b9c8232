"""Float64 reference for the flashattn tests, written from the semantics in
include/flashattn.h and upstream flash_attn (not from the C code).

Everything is vectorised NumPy in float64:

* ``attention_ref``: dense attention with causal (bottom-right aligned), window (-1 unbounded),
  softcap, ALiBi, sinks, GQA, dropout through an explicit keep mask; returns out, lse and
  (optionally) upstream's S_dmask encoding of the probabilities.
* ``varlen_ref``: the same per sequence of a varlen batch.
* ``philox4x32`` / ``dropout_keep_mask``: the keep bits exactly as the header defines them.
* ``attention_naive_lowp``: naive attention computed in a low-precision torch dtype (the
  baseline of upstream's accuracy criterion).
"""

import numpy as np

# --------------------------------------------------------------------------------------------
# Philox4x32-R (Salmon et al. 2011), vectorised over arrays of counters; dropout runs 7 rounds.

_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=7):
    """Four uint32 arrays (broadcast together) and a key (two python ints) -> four uint32 words."""
    c = [np.asarray(x, dtype=np.uint64) & _MASK32 for x in np.broadcast_arrays(c0, c1, c2, c3)]
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for r in range(rounds):
        if r > 0:
            k0 = (k0 + _W0) & 0xFFFFFFFF
            k1 = (k1 + _W1) & 0xFFFFFFFF
        p0 = _M0 * c[0]
        p1 = _M1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
    return [x.astype(np.uint32) for x in c]


def keep_threshold(dropout_p):
    """Numbers below it are kept: (1 - p) * 256 rounded to nearest."""
    return int(np.floor((1.0 - dropout_p) * 256.0 + 0.5))


def dropout_number(w, col):
    """Column col's 8-bit number from its block's four words w (arrays broadcast with col): the
    block's column c = col % 16 is byte c % 2 + 2 (c // 8) of word (c % 8) // 2."""
    c = np.asarray(col, dtype=np.uint64) % np.uint64(16)
    w = np.stack(np.broadcast_arrays(*w, c)[:4])
    widx = np.broadcast_to(((c % np.uint64(8)) // np.uint64(2)).astype(np.int64), w.shape[1:])
    word = np.take_along_axis(w, widx[None], axis=0)[0].astype(np.uint64)
    shift = np.uint64(8) * (c % np.uint64(2) + np.uint64(2) * (c // np.uint64(8)))
    return (word >> shift) & np.uint64(0xFF)


def dropout_keep_mask(seed, offset, num_heads, batch, sq, sk, dropout_p):
    """bool [h, sq, sk]: the header's keep bit of (batch, head, row, col) for every head, row
    and col of one sequence (batch = sequence index in the varlen form)."""
    heads = np.arange(num_heads, dtype=np.uint64)[:, None, None]
    rows = np.arange(sq, dtype=np.uint64)[None, :, None]
    cols = np.arange(sk, dtype=np.uint64)[None, None, :]
    cnt = (np.uint64(offset) + np.uint64(batch) * np.uint64(num_heads) + heads)
    w = philox4x32(cols // np.uint64(16), rows, cnt & _MASK32, cnt >> np.uint64(32),
                   seed & 0xFFFFFFFF, seed >> 32)
    r = dropout_number(w, cols)  # [h, sq, sk]
    return r < np.uint64(keep_threshold(dropout_p))


# --------------------------------------------------------------------------------------------
# Attention


def visible_mask(sq, sk, causal=False, window=(-1, -1)):
    """bool [sq, sk]: key j visible to query i (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    vis = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    return vis


def scores_ref(q, k, scale, softcap=0.0, alibi=None):
    """s [b, h, sq, sk] in float64 (no masking). q [b,sq,h,d], k [b,sk,hk,d]."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk = np.repeat(k, h // hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if alibi is not None:
        slopes = np.asarray(alibi, dtype=np.float64)
        slopes = np.broadcast_to(slopes, (b, h))[:, :, None, None]
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        s = s - slopes * np.abs(i + sk - sq - j)
    return s


def attention_ref(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                  alibi=None, sinks=None, keep=None, dropout_p=0.0, block_n=None):
    """Dense attention in float64.

    q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv]; alibi [h] or [b, h]; sinks [h];
    keep bool [b, h, sq, sk] (dropout keep bits) or None.
    Returns (out [b, sq, h, dv], lse [b, h, sq], enc) where enc is the S_dmask encoding
    [b, h, sq, sk] (unpadded, sign flipped where dropped) when block_n is given, else None.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if scale is None:
        scale = d ** -0.5
    s = scores_ref(q, k, scale, softcap, alibi)
    vis = np.broadcast_to(visible_mask(sq, sk, causal, window), s.shape)
    s_m = np.where(vis, s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = s_m.max(axis=-1, initial=-np.inf)  # [b, h, sq]
        if sinks is not None:
            sink = np.asarray(sinks, dtype=np.float64)[None, :, None]
            m = np.maximum(m, sink)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        e = np.where(vis, np.exp(s_m - m_safe[..., None]), 0.0)
        denom = e.sum(axis=-1)
        if sinks is not None:
            denom = denom + np.exp(sink - m_safe)
        lse = np.where(denom > 0, m_safe + np.log(denom), np.inf)
        p = np.where(vis, np.exp(s_m - lse[..., None]), 0.0)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    vv = np.repeat(v, h // hk, axis=2)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    enc = None
    if block_n is not None:
        enc = probs_encoding(s_m, vis, block_n, keep)
    return out, lse, enc


def probs_encoding(s_m, vis, block_n, keep=None):
    """Upstream's S_dmask: key blocks of block_n columns are visited from the last to the first;
    a visible entry is exp(s - running max over the blocks visited so far); dropped entries are
    negated; invisible entries are 0."""
    sk = s_m.shape[-1]
    if sk == 0:
        return np.zeros(s_m.shape)
    nb = -(-sk // block_n)
    pad = nb * block_n - sk
    sp = np.pad(s_m, [(0, 0)] * (s_m.ndim - 1) + [(0, pad)], constant_values=-np.inf)
    bm = sp.reshape(sp.shape[:-1] + (nb, block_n)).max(axis=-1)  # [..., nb]
    run = np.maximum.accumulate(bm[..., ::-1], axis=-1)[..., ::-1]  # max over blocks >= c
    mcol = np.repeat(run, block_n, axis=-1)[..., :sk]
    with np.errstate(invalid="ignore", over="ignore"):
        enc = np.where(vis, np.exp(s_m - np.where(np.isfinite(mcol), mcol, 0.0)), 0.0)
    if keep is not None:
        enc = np.where(keep, enc, -enc)
    return enc


def seqlens_from_cu(cu):
    cu = np.asarray(cu, dtype=np.int64)
    return cu[:-1], cu[1:] - cu[:-1]


def varlen_ref(q, k, v, cu_q, cu_k, scale=None, causal=False, window=(-1, -1), softcap=0.0,
               alibi=None, sinks=None, keep_fn=None, dropout_p=0.0, block_n=None,
               max_sq=None, max_sk=None):
    """Varlen attention in float64: q [total_q, h, d], k/v [total_k, hk, d*].

    keep_fn(i, sq, sk) -> bool [h, sq, sk] gives sequence i's keep bits (or None).
    Returns out [total_q, h, dv] (0 outside sequences), lse [h, total_q] (+inf outside),
    enc [b, h, max_sq, max_sk] (zero padded) when block_n is given.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    total_q, h, d = q.shape
    dv = v.shape[2]
    sq0, lq = seqlens_from_cu(cu_q)
    sk0, lk = seqlens_from_cu(cu_k)
    b = len(lq)
    out = np.zeros((total_q, h, dv))
    lse = np.full((h, total_q), np.inf)
    enc = None
    if block_n is not None:
        enc = np.zeros((b, h, max_sq, max_sk))
    alibi_arr = None if alibi is None else np.asarray(alibi, dtype=np.float64)
    for i in range(b):
        a, n = sq0[i], lq[i]
        c, m = sk0[i], lk[i]
        al = None
        if alibi_arr is not None:
            al = alibi_arr if alibi_arr.ndim == 1 else alibi_arr[i]
        keep = None
        if keep_fn is not None:
            keep = keep_fn(i, n, m)[None]
        o, l, e = attention_ref(q[None, a:a + n], k[None, c:c + m], v[None, c:c + m], scale,
                                causal, window, softcap, al, sinks, keep, dropout_p, block_n)
        out[a:a + n] = o[0]
        lse[:, a:a + n] = l[0]
        if block_n is not None:
            enc[i, :, :n, :m] = e[0]
    return out, lse, enc


# --------------------------------------------------------------------------------------------
# Naive attention in a low-precision dtype (upstream's attention_ref with upcast=False).


def attention_naive_lowp(q, k, v, dtype, scale, causal=False, window=(-1, -1), softcap=0.0,
                         alibi=None, sinks=None, keep=None, dropout_p=0.0):
    """q, k, v: float64 NumPy arrays holding values exactly representable in ``dtype`` (a torch
    dtype). Computes every step in that dtype, as the naive PyTorch attention would."""
    import torch

    tq = torch.from_numpy(np.ascontiguousarray(q)).to(dtype)
    tk = torch.from_numpy(np.ascontiguousarray(k)).to(dtype)
    tv = torch.from_numpy(np.ascontiguousarray(v)).to(dtype)
    b, sq, h, d = tq.shape
    sk, hk = tk.shape[1], tk.shape[2]
    tk = tk.repeat_interleave(h // hk, dim=2)
    tv = tv.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bthd,bshd->bhts", tq * scale, tk)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if alibi is not None:
        sl = torch.from_numpy(np.broadcast_to(np.asarray(alibi, np.float64), (b, h)).copy())
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        bias = -sl.float()[:, :, None, None] * (i + sk - sq - j).abs().float()
        s = (s.float() + bias).to(dtype)
    vis = torch.from_numpy(visible_mask(sq, sk, causal, window))
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        sink = torch.from_numpy(np.asarray(sinks, np.float64)).to(dtype)
        col = sink[None, :, None, None].expand(b, h, sq, 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :sk]
    else:
        p = torch.softmax(s, dim=-1)
    p = p.masked_fill(~vis.any(-1)[None, None, :, None], 0.0).to(dtype)
    if keep is not None:
        p = p.masked_fill(~torch.from_numpy(np.asarray(keep)), 0.0)
        tv = tv * (1.0 / (1.0 - dropout_p))
    out = torch.einsum("bhts,bshd->bthd", p, tv)
    return out.double().numpy()
