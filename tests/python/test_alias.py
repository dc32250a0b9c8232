"""The opt-in flash_attn alias, each case in a fresh interpreter: installed by install_alias()
or FLASHATTN_ALIAS=1 when no flash_attn is importable, never over a real one, not without
being asked, and without torch for the modules that do not need it."""

import importlib.util
import os
import subprocess
import sys

import flashattn

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(flashattn.__file__)))

# Upstream user code, unchanged.
UPSTREAM_CODE = """
import torch
from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn.flash_attn_interface import flash_attn_qkvpacked_func
from flash_attn.bert_padding import pad_input, unpad_input, index_first_axis
from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb
from flash_attn.modules.mha import MHA
from flash_attn.utils.generation import InferenceParams
import flash_attn, flashattn
assert flash_attn is flashattn and flash_attn_func is flashattn.flash_attn_func
import flashattn.modules.mha as ours
assert MHA is ours.MHA
q = torch.randn(1, 5, 2, 8)
assert flash_attn_func(q, q, q, causal=True).shape == (1, 5, 2, 8)
m = MHA(16, 2, use_flash_attn=True)
assert m(torch.randn(1, 4, 16)).shape == (1, 4, 16)
print("aliased")
"""


def _run(code, env_extra=None, pythonpath=()):
    env = dict(os.environ)
    env.pop("FLASHATTN_ALIAS", None)
    env["PYTHONPATH"] = os.pathsep.join(list(pythonpath) + [PKG_PARENT])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_install_alias_or_defer_to_upstream():
    """Where upstream is installed the alias must step aside; elsewhere it must work."""
    if importlib.util.find_spec("flash_attn") is not None:
        r = _run("import flashattn, flash_attn\n"
                 "assert flashattn.install_alias() is False and flash_attn is not flashattn\n"
                 "print('deferred')\n")
        assert r.returncode == 0 and r.stdout.strip() == "deferred", r.stderr
        return
    r = _run("import flashattn\nassert flashattn.install_alias() is True\n"
             "assert flashattn.install_alias() is True\n" + UPSTREAM_CODE)
    assert r.returncode == 0 and r.stdout.strip() == "aliased", r.stderr


def test_not_installed_unless_asked_and_lazy():
    r = _run("import flashattn, sys\nprint('flash_attn' in sys.modules)\n")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
    # FLASHATTN_ALIAS=1, read when flashattn is imported, installs it; that imports nothing
    # ahead (no torch), and a submodule is the flashattn module itself.
    code = ("import sys, flashattn\n"
            "import flash_attn, flash_attn.flash_attn_interface as fi\n"
            "assert fi is flashattn.flash_attn_interface\n"
            "assert fi.__spec__.name == 'flashattn.flash_attn_interface'\n"
            "print('torch' in sys.modules, 'flash_attn.bert_padding' in sys.modules)\n")
    if importlib.util.find_spec("flash_attn") is None:
        r = _run(code, {"FLASHATTN_ALIAS": "1"})
        assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr


def test_never_shadows_a_real_installation(tmp_path):
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    code = ("import flashattn, flash_attn\n"
            "assert flashattn.install_alias() is False\n"
            "assert flash_attn.REAL and flash_attn is not flashattn\n"
            "import sys\nassert 'flash_attn.bert_padding' not in sys.modules\n"
            "print('kept')\n")
    r = _run(code, {"FLASHATTN_ALIAS": "1"}, pythonpath=[str(tmp_path)])
    assert r.returncode == 0 and r.stdout.strip() == "kept", r.stderr
    # not yet imported, only findable: still left alone
    r = _run("import flashattn\nassert flashattn.install_alias() is False\n"
             "import flash_attn\nassert flash_attn.REAL\nprint('kept')\n",
             pythonpath=[str(tmp_path)])
    assert r.returncode == 0 and r.stdout.strip() == "kept", r.stderr


def test_alias_without_torch():
    """Without torch the interface is aliased (NumPy works through it); the torch-built
    modules fail to import as they would upstream."""
    code = ("import sys\nsys.modules['torch'] = None\n"
            "import importlib.util\n"
            "if importlib.util.find_spec('flash_attn') is not None:\n"
            "    print('aliased'); raise SystemExit\n"
            "import numpy as np, flashattn\n"
            "from flash_attn.flash_attn_interface import flash_attn_func\n"
            "q = np.ones((1, 3, 1, 8))\n"
            "assert flash_attn_func(q, q, q).shape == (1, 3, 1, 8)\n"
            "try:\n"
            "    import flash_attn.bert_padding\n"
            "except ImportError:\n"
            "    print('aliased')\n")
    r = _run(code, {"FLASHATTN_ALIAS": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "aliased", r.stderr
