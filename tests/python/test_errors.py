"""Bad inputs raise, with a message that names the argument (as the caller named it)."""

import re
import types

import numpy as np
import pytest
import torch

import flashattn
from flashattn import (FlashAttnError, flash_attn_func, flash_attn_kvpacked_func,
                       flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from flashattn import _arrays
from helpers import make, make_f32, make_int32, randn

KINDS = ["torch", "numpy"]


def raises(match, exc=FlashAttnError):
    return pytest.raises(exc, match=match)


def qkv(rng, kind, b=2, sq=8, sk=8, h=4, hk=4, d=16, dt="float32"):
    return (make(randn(rng, b, sq, h, d), dt, kind), make(randn(rng, b, sk, hk, d), dt, kind),
            make(randn(rng, b, sk, hk, d), dt, kind))


def test_error_type_is_runtime_error():
    assert issubclass(FlashAttnError, RuntimeError)
    assert flashattn.FlashAttnError is FlashAttnError


@pytest.mark.parametrize("kind", KINDS)
def test_dtypes(kind, rng):
    q, k, v = qkv(rng, kind)
    k16 = make(randn(rng, 2, 8, 4, 16), "float16", kind)
    with raises(r"^k: dtype fp16 does not match q's fp32"):
        flash_attn_func(q, k16, v)
    with raises(r"^v: dtype"):
        flash_attn_func(q, k, make(randn(rng, 2, 8, 4, 16), "float64", kind))
    qi = make_int32(np.ones((2, 8, 4, 16)), kind)
    with raises(r"^q: dtype must be"):
        flash_attn_func(qi, qi, qi)
    q64i = (torch.ones(2, 8, 4, 16, dtype=torch.int64) if kind == "torch"
            else np.ones((2, 8, 4, 16), dtype=np.int64))
    with raises(r"^q: dtype .*int64.* is not supported"):
        flash_attn_func(q64i, k, v)
    qc = (torch.ones(2, 8, 4, 16, dtype=torch.complex64) if kind == "torch"
          else np.ones((2, 8, 4, 16), dtype=np.complex64))
    with raises(r"^q: dtype .*complex64.* is not supported"):
        flash_attn_func(qc, k, v)


@pytest.mark.parametrize("kind", KINDS)
def test_shapes(kind, rng):
    q, k, v = qkv(rng, kind)
    with raises(r"^k: dimension 0 \(batch"):
        flash_attn_func(q, k[:1], v)
    with raises(r"^v: dimension 1 \(seqlen_k"):
        flash_attn_func(q, k, v[:, :5])
    with raises(r"^k: dimension 3 \(head_dim"):
        flash_attn_func(q, k[..., :8], v)
    with raises(r"^q: expected 4 dimensions"):
        flash_attn_func(q[0], k, v)
    with raises(r"^v: expected 4 dimensions"):
        flash_attn_func(q, k, v[0])
    qb, kb, vb = qkv(rng, kind, d=580)
    with raises(r"^q: head_dim must be in \[1, 576\]"):
        flash_attn_func(qb, kb, vb)
    q0, k0, v0 = qkv(rng, kind, b=0)
    with raises(r"^q: batch size must be positive"):
        flash_attn_func(q0, k0, v0)


@pytest.mark.parametrize("kind", KINDS)
def test_heads_not_divisible(kind, rng):
    q, k, v = qkv(rng, kind, h=6, hk=4)
    with raises(r"^k: number of kv heads \(4\) must divide .*\(6\)"):
        flash_attn_func(q, k, v)
    kv = make(randn(rng, 2, 8, 2, 4, 16), "float32", kind)
    with raises(r"^kv\[:, :, 0\] \(k\): number of kv heads"):
        flash_attn_kvpacked_func(q, kv)


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_p(kind, rng):
    q, k, v = qkv(rng, kind)
    for p in (1.0, 1.5, -0.1, float("nan")):
        with raises(r"^dropout_p: must be in \[0, 1\)"):
            flash_attn_func(q, k, v, dropout_p=p)
    with raises(r"^dropout_p: .*softcap"):
        flash_attn_func(q, k, v, dropout_p=0.1, softcap=5.0)
    with raises(r"^dropout_p: expected a float", TypeError):
        flash_attn_func(q, k, v, dropout_p="a lot")


@pytest.mark.parametrize("kind", KINDS)
def test_cu_seqlens(kind, rng):
    h, d = 2, 8
    q = make(randn(rng, 10, h, d), "float32", kind)

    def run(cu_q, cu_k, mq=10, mk=10):
        return flash_attn_varlen_func(q, q, q, cu_q, cu_k, mq, mk)

    good = make_int32([0, 4, 10], kind)
    with raises(r"^cu_seqlens_q: offsets must be non-decreasing"):
        run(make_int32([0, 6, 4], kind), good)
    with raises(r"^cu_seqlens_k: last offset 12 is past"):
        run(good, make_int32([0, 4, 12], kind))
    with raises(r"^cu_seqlens_k: dimension 0 \(batch \+ 1\) must be 3"):
        run(good, make_int32([0, 10], kind))
    with raises(r"^cu_seqlens_q: first offset is negative"):
        run(make_int32([-1, 4, 10], kind), good)
    with raises(r"^cu_seqlens_q: sequence 1 has length 6 > max_seqlen_q=5"):
        run(good, good, mq=5)
    with raises(r"^cu_seqlens_q: batch size must be positive"):
        run(make_int32([0], kind), make_int32([0], kind))
    i64 = (torch.tensor([0, 4, 10]) if kind == "torch" else np.array([0, 4, 10], np.int64))
    with raises(r"^cu_seqlens_q: dtype .*int64.* is not supported \(expected int32\)"):
        run(i64, good)
    f32 = make_f32([0, 4, 10], kind)
    with raises(r"^cu_seqlens_k: dtype must be int32"):
        run(good, f32)
    with raises(r"^cu_seqlens_q: expected 1 dimensions"):
        run(make_int32([[0, 4, 10]], kind), good)
    with raises(r"^max_seqlen_q: expected an int", TypeError):
        run(good, good, mq=6.5)
    with raises(r"^max_seqlen_k: must be non-negative"):
        run(good, good, mk=-1)
    # The packed form names its own arguments.
    qkvp = make(randn(rng, 10, 3, h, d), "float32", kind)
    with raises(r"^cu_seqlens: sequence 1 has length 6 > max_seqlen=5"):
        flash_attn_varlen_qkvpacked_func(qkvp, good, 5)
    with raises(r"^q: expected 3 dimensions"):
        flash_attn_varlen_func(q[None], q, q, good, good, 10, 10)
    kv = make(randn(rng, 10, 2, 3, d), "float32", kind)
    with raises(r"^kv\[:, 0\] \(k\): number of kv heads \(3\)"):
        flash_attn_varlen_kvpacked_func(q, kv, good, good, 10, 10)


@pytest.mark.parametrize("kind", KINDS)
def test_alibi_and_sinks(kind, rng):
    q, k, v = qkv(rng, kind, h=4)
    with raises(r"^alibi_slopes: dimension 0 \(heads\) must be 4"):
        flash_attn_func(q, k, v, alibi_slopes=make_f32(np.ones(5), kind))
    with raises(r"^alibi_slopes: dimension 0 \(batch\) must be 2"):
        flash_attn_func(q, k, v, alibi_slopes=make_f32(np.ones((3, 4)), kind))
    with raises(r"^alibi_slopes: must have shape \[h\] or \[b, h\]"):
        flash_attn_func(q, k, v, alibi_slopes=make_f32(np.ones((2, 4, 1)), kind))
    a64 = torch.ones(4, dtype=torch.float64) if kind == "torch" else np.ones(4)
    with raises(r"^alibi_slopes: dtype must be fp32"):
        flash_attn_func(q, k, v, alibi_slopes=a64)
    with raises(r"^learnable_sink: dimension 0 \(heads\) must be 4"):
        flash_attn_func(q, k, v, learnable_sink=make_f32(np.ones(3), kind))
    with raises(r"^learnable_sink: dtype must be fp32"):
        flash_attn_func(q, k, v, learnable_sink=make_int32(np.ones(4), kind))


@pytest.mark.parametrize("kind", KINDS)
def test_packed_shapes(kind, rng):
    bad = make(randn(rng, 2, 8, 2, 4, 16), "float32", kind)
    with raises(r"^qkv: expected shape \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn_qkvpacked_func(bad)
    with raises(r"^qkv: expected shape \(total, 3, nheads, headdim\)"):
        flash_attn_varlen_qkvpacked_func(bad[0], make_int32([0, 8], kind), 8)
    q = make(randn(rng, 2, 8, 4, 16), "float32", kind)
    with raises(r"^kv: expected shape"):
        flash_attn_kvpacked_func(q, make(randn(rng, 2, 8, 3, 4, 16), "float32", kind))


@pytest.mark.parametrize("kind", KINDS)
def test_options(kind, rng):
    q, k, v = qkv(rng, kind)
    with raises(r"^window_size: expected a pair", TypeError):
        flash_attn_func(q, k, v, window_size=3)
    with raises(r"^window_size\[0\] \(left\): expected an int", TypeError):
        flash_attn_func(q, k, v, window_size=(1.5, 0))
    with raises(r"^softcap: must be a finite number"):
        flash_attn_func(q, k, v, softcap=float("inf"))
    with raises(r"^softmax_scale: must be finite"):
        flash_attn_func(q, k, v, softmax_scale=float("inf"))
    cu = make_int32([0, 16], kind)
    qv = make(randn(rng, 16, 4, 16), "float32", kind)
    # block_table: paged k and v, 4-dimensional (the library's call, and the torch gather that
    # a call wanting gradients takes).
    with raises(r"^k: expected 4 dimensions \[num_blocks, page_size, hk, d\]"):
        flash_attn_varlen_func(qv, qv, qv, cu, cu, 16, 16, block_table=make_int32([[0]], kind))
    if kind == "torch":
        with raises(r"^k: with block_table, expected 4 dimensions"):
            flash_attn_varlen_func(qv.clone().requires_grad_(), qv, qv, cu, cu, 16, 16,
                                   block_table=make_int32([[0]], kind))


def test_mixed_kinds_and_non_arrays(rng):
    qt, kt, vt = qkv(rng, "torch")
    qn, kn, vn = qkv(rng, "numpy")
    with raises(r"k is a numpy.ndarray but q is a torch.Tensor", TypeError):
        flash_attn_func(qt, kn, vt)
    with raises(r"alibi_slopes is a torch.Tensor but q is a numpy.ndarray", TypeError):
        flash_attn_func(qn, kn, vn, alibi_slopes=torch.ones(4))
    with raises(r"cu_seqlens_q is a numpy.ndarray", TypeError):
        flash_attn_varlen_func(qt[0], kt[0], vt[0], np.array([0, 8], np.int32),
                               torch.tensor([0, 8], dtype=torch.int32), 8, 8)
    with raises(r"^q: expected a torch.Tensor or a numpy.ndarray, got list", TypeError):
        flash_attn_func(qn.tolist(), kn, vn)
    with raises(r"^qkv: expected a torch.Tensor or a numpy.ndarray, got None", TypeError):
        flash_attn_qkvpacked_func(None)
    with raises(r"^k: expected a torch.Tensor or a numpy.ndarray, got None", TypeError):
        flash_attn_func(qn, None, vn)
    with raises(r"^cu_seqlens_k: expected a torch.Tensor or a numpy.ndarray, got None",
                TypeError):
        flash_attn_varlen_func(qn[0], kn[0], vn[0], np.array([0, 8], np.int32), None, 8, 8)


def test_devices():
    # Where CUDA is not allowed (the C library's KV-cache call), a CUDA tensor is refused with a
    # clear message.
    # No GPU is needed to check it: the device test only reads x.device.type.
    fake = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    with raises(r"^q: CUDA tensors are not supported yet by this function"):
        _arrays.check_device(fake, "q")
    m = torch.empty(1, 4, 2, 8, device="meta")
    with raises(r"^q: tensors on device 'meta' are not supported"):
        flash_attn_func(m, m, m)
    if torch.cuda.is_available():  # on a GPU host the forward runs there; fp32 is refused
        c = torch.randn(1, 4, 2, 8, device="cuda")
        with raises(r"^q: the CUDA backend computes fp16 and bf16"):
            flash_attn_func(c, c, c)


def test_messages_come_from_c_library(rng):
    """C-checked rules arrive with the library's message and status."""
    q, k, v = qkv(rng, "torch", h=6, hk=4)
    with pytest.raises(FlashAttnError) as ei:
        flash_attn_func(q, k, v)
    assert ei.value.status == 1  # FA_STATUS_INVALID_ARGUMENT
    assert re.search(r"kv heads", str(ei.value))
