"""The compat distributions in compat/: once pip-installed, `import flash_attn` is flashattn and
`import flash_attn_interface` is flashattn.fa3, with distribution metadata named as upstream's,
so frameworks that check for upstream by name (transformers) find this package."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# Runs with only the install target, python/ and tests/python (reference) on the path.
USER_CODE = """
import importlib.metadata as md
import torch
import flash_attn, flashattn, flash_attn_interface
from flash_attn import flash_attn_func
import flash_attn.bert_padding, flash_attn.layers.rotary, flash_attn.modules.mha
import flash_attn.utils.generation
from reference import attention_ref

assert flash_attn is flashattn and flash_attn_func is flashattn.flash_attn_func
assert flash_attn.bert_padding is flashattn.bert_padding
assert flash_attn.modules.mha.MHA is flashattn.modules.mha.MHA
assert flash_attn_interface is flashattn.fa3
assert flash_attn_interface.get_scheduler_metadata is flashattn.fa3.get_scheduler_metadata

assert md.version("flash_attn") == "2.8.4+flashattn", md.version("flash_attn")
assert md.version("flash-attn-3") == "3.0.0+flashattn", md.version("flash-attn-3")
dists = md.packages_distributions()
assert dists["flash_attn"] == ["flash-attn"], dists.get("flash_attn")
assert dists["flash_attn_interface"] == ["flash-attn-3"], dists.get("flash_attn_interface")

torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
q, k, v = (torch.randn(2, 37, 4, 32) for _ in range(3))
ref = attention_ref(q.double(), k.double(), v.double(), causal=True)[0]
out = flash_attn_func(q, k, v, causal=True)
assert (out.double() - ref).abs().max() < 1e-4, (out.double() - ref).abs().max()
out3 = flash_attn_interface.flash_attn_func(q, k, v, causal=True)
assert (out3.double() - ref).abs().max() < 1e-4, (out3.double() - ref).abs().max()
print("ok")
"""

# transformers' checks: the name and version pass; availability also needs CUDA, so on a
# machine without it the answer is False, and with CUDA forced it is True.
TRANSFORMERS_CODE = """
import torch
from transformers.utils import import_utils as iu
cuda = iu.is_torch_cuda_available()
assert iu.is_flash_attn_greater_or_equal("2.3.3")
assert iu.is_flash_attn_2_available() is cuda
assert iu.is_flash_attn_3_available() is cuda
iu.is_torch_cuda_available = lambda: True
for check in (iu.is_flash_attn_2_available, iu.is_flash_attn_3_available):
    check.cache_clear()
    assert check() is True, check
print("ok", cuda)
"""


# With CUDA: transformers' own flash_attention_2 path on a tiny random Llama (bf16, left padding)
# calls flashattn's functions (counted through wrappers that keep their signatures, which
# transformers inspects to pick the keywords it passes), and its logits match "sdpa" on the same
# weights: within four times the eager-vs-sdpa difference, and at least 5e-2 (bf16, as in
# test_transformers.BF16_FLOOR).
CUDA_FA2_CODE = """
import copy, functools, os
import torch, transformers
import flashattn, flash_attn

assert flash_attn is flashattn
calls = {"flash_attn_varlen_func": 0, "flash_attn_func": 0}
for name in calls:
    def counting(fn, name=name):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    setattr(flashattn, name, counting(getattr(flashattn, name)))

torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, initializer_range=0.3)
models = {}
for impl in ("eager", "sdpa", "flash_attention_2"):
    m = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                      attn_implementation=impl)
    if models:
        m.load_state_dict(models["eager"].state_dict())
    models[impl] = m
for m in models.values():
    m.to("cuda", torch.bfloat16).eval()
assert models["flash_attention_2"].config._attn_implementation == "flash_attention_2"

ids = torch.randint(1, 96, (2, 12), device="cuda")
mask = torch.ones(2, 12, dtype=torch.long, device="cuda")
mask[1, :5] = 0
valid = mask.bool()
with torch.no_grad():
    logits = {k: m(ids, attention_mask=mask).logits[valid].float() for k, m in models.items()}
    assert calls == {"flash_attn_varlen_func": 2, "flash_attn_func": 0}, calls  # one per layer
    models["flash_attention_2"](ids, attention_mask=torch.ones_like(mask))
    assert calls == {"flash_attn_varlen_func": 2, "flash_attn_func": 2}, calls

def rel(a, b):
    return ((a - b).norm() / b.norm()).item()

noise = rel(logits["eager"], logits["sdpa"])
err = rel(logits["flash_attention_2"], logits["sdpa"])
assert err <= max(4 * noise, 5e-2), (err, noise)
print("ok", err, noise)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """compat/ and compat/fa3 installed into a fresh target (copied first: no build files in
    the checkout)."""
    tmp = tmp_path_factory.mktemp("compat")
    src = tmp / "compat"
    shutil.copytree(os.path.join(REPO, "compat"), src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                        "--no-deps", "--target", str(target), str(src), str(src / "fa3")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return target


def _run(site, code, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), os.path.join(REPO, "python"), HERE])
    env.pop("FLASHATTN_ALIAS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=str(site.parent))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_compat_imports_resolve_here(site):
    assert _run(site, USER_CODE).strip() == "ok"


def test_compat_satisfies_transformers(site):
    pytest.importorskip("transformers")
    assert _run(site, TRANSFORMERS_CODE).startswith("ok")


if torch.cuda.is_available():
    def test_compat_flash_attention_2_runs_flashattn_on_cuda(site):
        pytest.importorskip("transformers")
        # The timeout leaves room for compiling the kernels (NVRTC) on a cold cache.
        assert _run(site, CUDA_FA2_CODE, timeout=600).startswith("ok")


def test_compat_needs_flashattn(site):
    """Without flashattn importable, `import flash_attn` fails and says what to install."""
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-c", "import flash_attn"], capture_output=True,
                       text=True, env=env, timeout=60, cwd=str(site.parent))
    assert r.returncode != 0 and "needs flashattn" in r.stderr, r.stderr
