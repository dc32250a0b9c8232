"""flashattn.flex_attention under torch.compile(fullgraph=True): the flex_fwd / flex_bwd custom
ops (opcheck), outputs and gradients equal to the eager call's, a second mod and a captured
tensor changed in place after compiling, and a mod that cannot be traced refused at compile
time (CPU tensors; tests/gpu/test_python_cuda.py runs the same on CUDA)."""

import pytest
import torch

import flashattn
from flashattn import _torch_flex, _torch_ops  # noqa: F401  (registers the ops)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

S, H, HKV, D, DV = 70, 4, 2, 16, 12


def randn(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape)).float()


# Module-level mods and their captures, as a compiled model would use them.
BIAS = torch.zeros(2 * S)
DOCS = torch.zeros(S, dtype=torch.int64)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[kv_idx - q_idx + S]


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def doc_causal(b, h, q_idx, kv_idx):
    # kv_idx < q_idx: query 0 sees no key (lse -inf, out 0)
    return (DOCS[q_idx] == DOCS[kv_idx]) & (kv_idx < q_idx)


@pytest.fixture
def inputs(rng):
    BIAS.copy_(randn(rng, 2 * S))
    DOCS.copy_(torch.tensor(sorted(rng.integers(0, 3, S))))
    q = randn(rng, 2, H, S, D)
    k, v = randn(rng, 2, HKV, S, D), randn(rng, 2, HKV, S, DV)
    return q, k, v, flashattn.create_block_mask(doc_causal, 2, 1, S, S, BLOCK_SIZE=32)


def call(q, k, v, score_mod, block_mask):
    return flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=True, return_lse=True)


def test_opcheck(inputs):
    q, k, v, bm = inputs
    mask = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    for score_mod, slots, captured in ((rel_bias, [], []), (biased, [0, 1], [HEAD_SCALE, TABLE])):
        plan = _torch_flex.plan_of(score_mod, doc_causal)
        args = (q, k, v) + mask + (list(bm.BLOCK_SIZE), list(bm.seq_lengths), plan, 0.3, slots,
                                   captured)
        torch.library.opcheck(torch.ops.flashattn.flex_fwd.default, args)
        # (the backward runs without grad mode: its inputs detached, as there)
        out, lse = (x.detach() for x in torch.ops.flashattn.flex_fwd(*args))
        dout = torch.randn_like(out)
        torch.library.opcheck(torch.ops.flashattn.flex_bwd.default, (dout, q, k, v, out, lse) +
                              args[3:-1] + ([x.detach() for x in captured],))
        assert _torch_flex.plan_of(score_mod, doc_causal) == plan  # one number per pair


def test_forward_and_backward_equal_eager(inputs):
    q, k, v, bm = inputs
    compiled = torch.compile(call, fullgraph=True)
    for score_mod, block_mask in ((rel_bias, bm), (softcap, None), (None, bm)):
        qe, ke, ve = (x.clone().requires_grad_() for x in (q, k, v))
        qc, kc, vc = (x.clone().requires_grad_() for x in (q, k, v))
        out_e, lse_e = call(qe, ke, ve, score_mod, block_mask)
        out_c, lse_c = compiled(qc, kc, vc, score_mod, block_mask)
        torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
        torch.testing.assert_close(lse_c, lse_e, rtol=0, atol=0)
        if block_mask is not None:
            assert torch.isneginf(lse_c[:, :, 0]).all() and (out_c[:, :, 0] == 0).all()
        dout = torch.randn_like(out_e)
        (out_e * dout).sum().backward()
        (out_c * dout).sum().backward()
        for a, b in ((qc, qe), (kc, ke), (vc, ve)):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_second_mod_and_changed_capture(inputs):
    """A compiled function given another score_mod computes with it (Dynamo's guards), and
    reads a captured tensor's current values."""
    q, k, v, bm = inputs
    f = torch.compile(lambda q, k, v, sm: call(q, k, v, sm, bm)[0], fullgraph=True)
    with torch.no_grad():
        first = f(q, k, v, rel_bias)
        torch.testing.assert_close(first, call(q, k, v, rel_bias, bm)[0], rtol=0, atol=0)
        torch.testing.assert_close(f(q, k, v, softcap), call(q, k, v, softcap, bm)[0],
                                   rtol=0, atol=0)
        BIAS.mul_(-2.0)
        again = f(q, k, v, rel_bias)
        torch.testing.assert_close(again, call(q, k, v, rel_bias, bm)[0], rtol=0, atol=0)
        assert not torch.equal(again, first)


def test_flex_attention_compiled_directly(inputs):
    """torch.compile(flex_attention), as FlexAttention's users write it."""
    q, k, v, bm = inputs
    flex = torch.compile(flashattn.flex_attention, fullgraph=True)
    with torch.no_grad():
        out = flex(q, k, v, score_mod=rel_bias, block_mask=bm, enable_gqa=True)
        torch.testing.assert_close(out, call(q, k, v, rel_bias, bm)[0], rtol=0, atol=0)


def test_untraceable_mod_refused_at_compile(inputs):
    q, k, v, _ = inputs

    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:  # Python control flow on a traced value
            return score
        return -score

    f = torch.compile(lambda q, k, v: call(q, k, v, branchy, None), fullgraph=True)
    with pytest.raises(Exception, match="cannot be traced.*test_flex_compile.py"):
        with torch.no_grad():
            f(q, k, v)


class _Model(torch.nn.Module):
    """A score_mod made in forward, over a buffer: no constant of the graph."""

    def __init__(self, bias):
        super().__init__()
        self.register_buffer("bias", bias)

    def forward(self, q, k, v):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + self.bias[kv_idx - q_idx + S]

        return flashattn.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)


def test_mod_made_inside_the_region(inputs):
    """Without fullgraph the call breaks the graph and gives the eager result; with fullgraph
    Dynamo stops with an error naming score_mod."""
    q, k, v, _ = inputs
    model = _Model(BIAS.clone())
    with torch.no_grad():
        want = model(q, k, v)
        for _ in range(2):
            torch.testing.assert_close(torch.compile(model)(q, k, v), want, rtol=0, atol=0)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="score_mod is a function made inside"):
            torch.compile(model, fullgraph=True)(q, k, v)


TABLE = torch.zeros(H, 2 * S, requires_grad=True)
HEAD_SCALE = torch.ones(H, dtype=torch.float64, requires_grad=True)


def biased(score, b, h, q_idx, kv_idx):
    return score * HEAD_SCALE[h] + TABLE[h, kv_idx - q_idx + S]


class _Biased(torch.nn.Module):
    """A learnt relative-position table read by a score_mod made in forward."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, q, k, v, block_mask):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + self.table[h, kv_idx - q_idx + S]

        return flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                        enable_gqa=True)


def test_captured_gradients_compiled(rng, inputs):
    """Captured tensors that require grad enter the compiled graph as inputs of the ops, so
    they get their gradients: a global table and a global fp64 head scale (fullgraph), a
    module's parameter read through a score_mod made in forward (the call's own frame); equal
    to the eager call's bitwise, q's too."""
    q, k, v, bm = inputs
    with torch.no_grad():
        TABLE.copy_(randn(rng, H, 2 * S))
        HEAD_SCALE.copy_(1 + 0.2 * randn(rng, H).double())
    compiled = torch.compile(call, fullgraph=True)
    model = _Biased(randn(rng, H, 2 * S))
    runs = ((lambda *x: compiled(*x, biased, bm)[0], lambda *x: call(*x, biased, bm)[0],
             (TABLE, HEAD_SCALE)),
            (lambda *x: torch.compile(model)(*x, bm), lambda *x: model(*x, bm), (model.table,)))
    for fast, eager, leaves in runs:
        got = []
        for f in (fast, eager):
            qx = q.clone().requires_grad_()
            out = f(qx, k, v)
            for x in leaves:
                x.grad = None
            (out * out.detach().sin()).sum().backward()
            got.append([qx.grad] + [x.grad for x in leaves])
        for a, b in zip(*got):
            assert a is not None and a.dtype == b.dtype and a.abs().max() > 0
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert HEAD_SCALE.grad.dtype == torch.float64


def test_capture_out_of_reach_refused_at_compile(inputs):
    """A tensor requiring grad that score_mod reaches other than by a name of its own (here an
    element of a list) would miss its gradient under compile: refused, naming the way."""
    q, k, v, _ = inputs
    tables = [torch.zeros(2 * S, requires_grad=True)]

    def listed(score, b, h, q_idx, kv_idx):
        return score + tables[0][kv_idx - q_idx + S]

    f = torch.compile(lambda q, k, v: call(q, k, v, listed, None), fullgraph=True)
    with pytest.raises(Exception, match="requires grad, but under torch.compile.*global or "
                                        "closure variable"):
        f(q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(f(q, k, v)[0], call(q, k, v, listed, None)[0], rtol=0,
                                   atol=0)
