"""Checks of the float64 reference itself (so that the library is judged by a correct oracle):
Philox known answers, upstream's documented mask examples, and the vectorised reference
against plain per-element loops."""

import math

import numpy as np

from reference import (attention_ref, dropout_keep_mask, philox4x32, probs_encoding,
                       visible_mask)


def test_philox_known_answers():
    # Random123's kat_vectors for philox4x32-10 and -7: (rounds, counter, key) -> output.
    cases = [
        (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
         (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
        (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
        (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
         (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
        (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    ]
    for rounds, ctr, key, want in cases:
        got = philox4x32(*[np.array([c]) for c in ctr], *key, rounds=rounds)
        assert tuple(int(w[0]) for w in got) == want


def test_keep_mask_matches_definition():
    # Element by element from the header's text, for a few awkward values.
    seed, offset, nh, p = 0x1234_5678_9ABC_DEF0, 7, 3, 0.3
    m = dropout_keep_mask(seed, offset, nh, 2, 4, 19, p)
    thr = math.floor((1 - p) * 256 + 0.5)
    for head in range(nh):
        for row in range(4):
            for col in range(19):
                c = offset + 2 * nh + head
                w = philox4x32(col >> 4, row, c & 0xFFFFFFFF, c >> 32,
                               seed & 0xFFFFFFFF, seed >> 32)
                r = (int(w[(col & 7) >> 1]) >> (8 * ((col & 1) + 2 * ((col >> 3) & 1)))) & 0xFF
                assert bool(m[head, row, col]) == (r < thr)


def test_causal_mask_bottom_right():
    # Upstream's docstring example: seqlen_q=2, seqlen_k=5 gives 11110 / 11111.
    assert visible_mask(2, 5, causal=True).astype(int).tolist() == [[1, 1, 1, 1, 0],
                                                                     [1, 1, 1, 1, 1]]
    # seqlen_q=5, seqlen_k=2: 00 00 00 10 11.
    assert visible_mask(5, 2, causal=True).astype(int).tolist() == [[0, 0], [0, 0], [0, 0],
                                                                     [1, 0], [1, 1]]
    # window (1, 0) on a square: each row sees itself and one key to the left.
    assert visible_mask(3, 3, window=(1, 0)).astype(int).tolist() == [[1, 0, 0], [1, 1, 0],
                                                                       [0, 1, 1]]


def _loop_ref(q, k, v, scale, causal, window, softcap, alibi, sinks, keep, p_drop):
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    left, right = window
    if causal:
        right = 0
    out = np.zeros((b, sq, h, dv))
    lse = np.zeros((b, h, sq))
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hk)
            for i in range(sq):
                s = {}
                for j in range(sk):
                    lo = i + sk - sq - left if left >= 0 else -math.inf
                    hi_ = i + sk - sq + right if right >= 0 else math.inf
                    if not (lo <= j <= hi_):
                        continue
                    x = scale * float(np.dot(q[bi, i, hi], k[bi, j, kh]))
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if alibi is not None:
                        x -= alibi[hi] * abs(i + sk - sq - j)
                    s[j] = x
                tot = sum(math.exp(x) for x in s.values())
                if sinks is not None:
                    tot += math.exp(sinks[hi])
                if tot == 0:
                    lse[bi, hi, i] = math.inf
                    continue
                lse[bi, hi, i] = math.log(tot)
                for j, x in s.items():
                    pj = math.exp(x - lse[bi, hi, i])
                    if keep is not None:
                        pj = pj * keep[bi, hi, i, j] / (1 - p_drop)
                    out[bi, i, hi] += pj * v[bi, j, kh]
    return out, lse


def test_vectorised_reference_matches_loops(rng):
    b, sq, sk, h, hk, d, dv = 2, 5, 7, 4, 2, 3, 5
    q = rng.standard_normal((b, sq, h, d))
    k = rng.standard_normal((b, sk, hk, d))
    v = rng.standard_normal((b, sk, hk, dv))
    alibi = rng.uniform(0.1, 0.5, h)
    sinks = rng.standard_normal(h)
    keep = rng.random((b, h, sq, sk)) < 0.7
    for causal, window, softcap, al, sk_, kp in [
        (False, (-1, -1), 0.0, None, None, None),
        (True, (-1, -1), 0.0, alibi, None, None),
        (False, (2, 1), 1.5, None, sinks, None),
        (True, (1, -1), 0.0, alibi, sinks, keep),
        (False, (0, 0), 0.0, None, None, keep),
        (False, (-1, -1), 0.0, None, sinks, None),
    ]:
        p = 0.3 if kp is not None else 0.0
        o, l, _ = attention_ref(q, k, v, 0.7, causal, window, softcap, al, sk_, kp, p)
        o2, l2 = _loop_ref(q, k, v, 0.7, causal, window, softcap, al, sk_, kp, p)
        np.testing.assert_allclose(o, o2, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(l, l2, rtol=1e-12, atol=1e-12)


def test_probs_encoding_matches_loops(rng):
    sq, sk, bn = 3, 11, 4
    s = rng.standard_normal((1, 1, sq, sk)) * 3
    vis = np.broadcast_to(visible_mask(sq, sk, causal=True), s.shape)
    s_m = np.where(vis, s, -np.inf)
    keep = rng.random(s.shape) < 0.5
    enc = probs_encoding(s_m, vis, bn, keep)
    nb = -(-sk // bn)
    for i in range(sq):
        m = -math.inf
        for blk in reversed(range(nb)):
            cols = range(blk * bn, min(sk, (blk + 1) * bn))
            m = max([m] + [s[0, 0, i, j] for j in cols if vis[0, 0, i, j]])
            for j in cols:
                want = math.exp(s[0, 0, i, j] - m) if vis[0, 0, i, j] else 0.0
                if not keep[0, 0, i, j]:
                    want = -want
                assert math.isclose(enc[0, 0, i, j], want, rel_tol=1e-14, abs_tol=0)
