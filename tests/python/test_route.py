"""One route from the public functions to the library: an argument followed from
flash_attn_func (softcap) passes through each module once, never back into a module it left,
on every path (first call of a signature, gradients, NumPy, the KV cache's append); and the C
fast path's argument layout is the Python signature's."""

import inspect
import os
import sys

import pytest
import torch

from flashattn import _route, flash_attn_func, flash_attn_with_kvcache, flex
from helpers import run_python


def _files_receiving(name, fn):
    """The modules (file names) of the Python functions that receive an argument called
    ``name`` during fn(), in call order, consecutive repeats merged."""
    seen = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if name in params and "flashattn" in code.co_filename:
            f = os.path.basename(code.co_filename)
            if not seen or seen[-1] != f:
                seen.append(f)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def _assert_one_pass(files):
    assert len(files) == len(set(files)), " -> ".join(files)


def test_softcap_visits_each_module_once(rng):
    def t(*shape):
        return torch.tensor(rng.standard_normal(shape), dtype=torch.float32)

    q, k, v = t(2, 5, 4, 16), t(2, 7, 2, 16), t(2, 7, 2, 16)
    flash_attn_func(q, k, v)  # loads the torch ops
    files = _files_receiving("softcap", lambda: flash_attn_func(q, k, v, softcap=3.5))
    _assert_one_pass(files)
    # the first call of a signature is prepared down to the library's arguments
    assert files[0] == "flash_attn_interface.py" and files[-1] == "_core.py", files
    for name in ("_route.py", "_torch_ops.py", "_cached.py"):
        assert name in files, files
    # with gradients: the forward, then (a route of its own) the backward
    qg = q.clone().requires_grad_()
    out = []
    files = _files_receiving(
        "softcap", lambda: out.append(flash_attn_func(qg, k, v, softcap=2.5, causal=True)))
    _assert_one_pass(files)
    assert files[-1] == "_core.py", files
    files = _files_receiving("softcap", lambda: out[0].sum().backward())
    _assert_one_pass(files)
    assert files[-1] == "_core.py" and qg.grad is not None, files
    # NumPy arrays, dropout, the other forms
    a = [x.numpy() for x in (q, k, v)]
    for call in (lambda: flash_attn_func(*a, softcap=1.5),
                 lambda: flash_attn_func(q, k, v, softcap=1.5, return_attn_probs=True),
                 lambda: flash_attn_func(q, k, v, alibi_slopes=torch.ones(4), softcap=1.5),
                 lambda: flash_attn_with_kvcache(q, k, v, k=k[:, :1], v=v[:, :1],
                                                 cache_seqlens=3, softcap=1.5)):
        files = _files_receiving("softcap", call)
        _assert_one_pass(files)
        assert files[-1] in ("_core.py", "_kvcache.py"), files


def test_fast_path_layout_is_the_signature():
    """_fastpath reads flash_attn_func's, flash_attn_with_kvcache's and flex_attention's
    arguments by the names bind() gives it."""
    params = list(inspect.signature(flash_attn_func).parameters)
    assert tuple(params) == _route.DENSE_ARGS
    params = list(inspect.signature(flash_attn_with_kvcache).parameters)
    assert tuple(params) == _route.KV_ARGS
    params = list(inspect.signature(flex.flex_attention).parameters)
    assert tuple(params) == flex.FLEX_ARGS == tuple(inspect.signature(flex.flex_any).parameters)


@pytest.mark.parametrize("cut", ["dense", "kv", "flex"])
def test_fast_path_refuses_a_layout_without_a_name(cut):
    """bind() looks every argument up by name: a table that lacks one is refused (a fresh
    interpreter, since a process binds once, and without the import hook through which the
    package binds itself when torch is imported after it)."""
    dense, kv, flex = "_route.DENSE_ARGS", "_route.KV_ARGS", "flex.FLEX_ARGS"
    if cut == "dense":
        dense += "[:-1]"
    elif cut == "kv":
        kv += "[1:]"
    else:
        flex += "[1:]"
    code = ("import sys, flashattn\n"
            "sys.meta_path.remove(flashattn._RegisterAfterTorch)\n"
            "import torch\n"
            "from flashattn import _cached, _route, flex\n"
            "try:\n"
            "    _cached.bind_fastpath(torch, None, None, %s, None, %s,\n"
            "                          dict(flex.fastpath_table(), flex_args=%s))\n"
            "except ValueError as e:\n"
            "    print(e)\n" % (dense, kv, flex))
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    missing = {"dense": "learnable_sink", "kv": "q", "flex": "query"}[cut]
    assert r.stdout.strip() == ("flashattn._fastpath.bind: the layout has no '%s'" % missing), (
        r.stdout)
