"""`pip install .` builds the C library with CMake and installs a working package (no torch
needed at build time). The source tree is copied first so the test leaves no build files in the
checkout."""

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _ignore(directory, names):
    """Skip VCS data, caches, the top-level build directories and built libraries."""
    top = os.path.abspath(directory) == REPO
    skip = set()
    for n in names:
        if n in (".git", "__pycache__", ".pytest_cache") or n.endswith(".egg-info"):
            skip.add(n)
        elif top and n.startswith("build"):
            skip.add(n)
        elif n.startswith("libflashattn.so"):
            skip.add(n)
    return skip


def test_pip_install_target(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_ignore)
    target = tmp_path / "site"
    env = dict(os.environ)
    env.pop("FLASHATTN_LIBRARY", None)
    env.pop("PYTHONPATH", None)
    env["FLASHATTN_BUILD_JOBS"] = "2"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                        "--no-deps", "--target", str(target), str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lib = target / "flashattn" / "libflashattn.so"
    assert lib.is_file() and not lib.is_symlink()
    for module in ("bert_padding.py", "layers/rotary.py", "modules/mha.py",
                   "utils/generation.py", "integrations/transformers.py"):
        assert (target / "flashattn" / module).is_file(), module
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import numpy as np, flashattn\n"
        "from flashattn import _lib\n"
        "q = np.random.default_rng(0).standard_normal((2, 7, 4, 24))\n"
        "out, lse, S = flashattn.flash_attn_func(q, q, q, causal=True, return_attn_probs=True)\n"
        "assert out.shape == (2, 7, 4, 24) and lse.shape == (2, 4, 7) and S.shape == (0,)\n"
        "print(flashattn.__file__)\n"
        "print(_lib.library_path())\n")
    env["PYTHONPATH"] = str(target)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    mod, libpath = r.stdout.split()
    assert mod.startswith(str(target)) and libpath == str(lib)
