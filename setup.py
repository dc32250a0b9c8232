"""Build flashattn: compile libflashattn with CMake and install it inside the Python package.

    pip install .                    # needs cmake (>= 3.18) and a C11 compiler; no torch, no CUDA

Environment knobs:
    FLASHATTN_CMAKE_ARGS       extra arguments for the CMake configure step (shell-split)
    FLASHATTN_BUILD_JOBS       parallel build jobs (default: the number of CPUs)
    FLASHATTN_PREBUILT_LIBRARY copy this libflashattn.so instead of building one
    CMAKE                      the cmake executable (default: cmake on PATH)

The library does not link against Python. Where Python's headers are found the build adds the
package's C fast path (python/flashattn/_fastpath.c), a limited-API extension, and the wheel is
tagged cp38-abi3-<platform> (one wheel for CPython >= 3.8); without it, py3-none-<platform>.
"""

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = {"darwin": "libflashattn.dylib"}.get(sys.platform, "libflashattn.so")
FASTPATH_NAME = "_fastpath.abi3.so"
FASTPATH_BUILT = []  # set once build_library has packaged the C fast path

# What the CMake build needs; shipped in the sdist.
C_TREE = ["CMakeLists.txt", "Makefile", "include", "src", "ref", "tools", "kernels", "cmake",
          "tests/c", "LICENSE", "README.md"]


def read_version():
    with open(os.path.join(ROOT, "include", "flashattn.h")) as f:
        text = f.read()
    parts = [re.search(r"#define FA_VERSION_%s (\d+)" % p, text).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


class BinaryDistribution(Distribution):
    """The package carries a native library: platform wheel, platlib install."""

    def has_ext_modules(self):
        return True


def build_library(out_dir, log=print):
    """Configure and build the shared library in a temporary directory, copy it to out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    dest = os.path.join(out_dir, LIB_NAME)
    if os.path.lexists(dest):  # e.g. the `make build` symlink of a source checkout
        os.remove(dest)
    prebuilt = os.environ.get("FLASHATTN_PREBUILT_LIBRARY")
    if prebuilt:
        log("flashattn: using prebuilt %s" % prebuilt)
        shutil.copyfile(os.path.realpath(prebuilt), dest)
        return dest
    cmake = os.environ.get("CMAKE") or shutil.which("cmake")
    if not cmake:
        raise RuntimeError("flashattn: building needs CMake >= 3.18 on PATH (or $CMAKE)")
    jobs = os.environ.get("FLASHATTN_BUILD_JOBS") or str(os.cpu_count() or 2)
    with tempfile.TemporaryDirectory(prefix="flashattn-build-") as tmp:
        configure = [cmake, "-S", ROOT, "-B", tmp, "-DCMAKE_BUILD_TYPE=Release",
                     "-DFA_BUILD_TESTS=OFF", "-DFA_WERROR=OFF",
                     "-DPython3_EXECUTABLE=" + sys.executable]
        configure += shlex.split(os.environ.get("FLASHATTN_CMAKE_ARGS", ""))
        log("flashattn: " + " ".join(configure))
        subprocess.check_call(configure)
        subprocess.check_call([cmake, "--build", tmp, "--target", "flashattn", "-j", jobs])
        built = os.path.join(tmp, LIB_NAME)
        if not os.path.exists(built):
            found = glob.glob(os.path.join(tmp, "**", LIB_NAME), recursive=True)
            if not found:
                raise RuntimeError("flashattn: the build produced no %s" % LIB_NAME)
            built = found[0]
        shutil.copyfile(os.path.realpath(built), dest)  # the real file, not the symlink chain
        os.chmod(dest, 0o755)
        build_fastpath(cmake, tmp, jobs, out_dir, log)
    return dest


def build_fastpath(cmake, tmp, jobs, out_dir, log):
    """The C fast path, where CMake found Python's headers; the package works without it."""
    dest = os.path.join(out_dir, FASTPATH_NAME)
    if os.path.lexists(dest):
        os.remove(dest)
    if subprocess.call([cmake, "--build", tmp, "--target", "flashattn_fastpath", "-j", jobs]):
        log("flashattn: the C fast path was not built (no Python headers?); the Python path "
            "serves every call")
        return
    shutil.copyfile(os.path.join(tmp, FASTPATH_NAME), dest)
    os.chmod(dest, 0o755)
    FASTPATH_BUILT.append(dest)


class BuildPy(build_py):
    """build_py plus the C library, built with CMake into the package directory."""

    def run(self):
        super().run()
        if not self.dry_run:
            build_library(os.path.join(self.build_lib, "flashattn"), log=self.announce_info)

    def announce_info(self, msg):
        self.announce(msg, level=2)


class SDist(sdist):
    """The sdist also carries the C sources the CMake build needs."""

    def make_release_tree(self, base_dir, files):
        files = list(files)
        have = set(os.path.normpath(f) for f in files)
        for entry in C_TREE:
            path = os.path.join(ROOT, entry)
            if os.path.isfile(path):
                found = [entry]
            elif os.path.isdir(path):
                found = []
                for dirpath, dirnames, filenames in os.walk(path):
                    dirnames[:] = [d for d in dirnames if not d.startswith((".", "build"))]
                    found += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in filenames]
            else:
                continue
            for f in sorted(found):
                if os.path.normpath(f) not in have:
                    files.append(f)
                    have.add(os.path.normpath(f))
        super().make_release_tree(base_dir, files)


cmdclass = {"build_py": BuildPy, "sdist": SDist}

try:  # py3-none-<platform>, or cp38-abi3-<platform> with the limited-API fast path
    try:
        from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:  # setuptools < 70.1
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

    class BdistWheel(_bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, plat = super().get_tag()
            return ("cp38", "abi3", plat) if FASTPATH_BUILT else ("py3", "none", plat)

    cmdclass["bdist_wheel"] = BdistWheel
except ImportError:
    pass

setup(
    version=read_version(),
    packages=["flashattn", "flashattn.integrations", "flashattn.layers", "flashattn.modules",
              "flashattn.utils"],
    package_dir={"": "python"},
    distclass=BinaryDistribution,
    cmdclass=cmdclass,
    # Keep setuptools' staging out of build/, which is the CMake build of `make build`.
    options={"build": {"build_base": "build-setuptools"}},
    zip_safe=False,
)
