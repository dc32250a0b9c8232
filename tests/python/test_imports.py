"""The package's modules import one another without cycles: the import graph (every import
statement, those inside functions included) is acyclic, and each module imports first in a
fresh interpreter, whatever the order."""

import ast
import os
import pytest

import flashattn
from helpers import run_python

PACKAGE_DIR = os.path.dirname(os.path.abspath(flashattn.__file__))
ROOT = os.path.dirname(PACKAGE_DIR)


def _modules():
    """Module name -> path of every .py file of the package."""
    mods = {}
    for dirpath, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = (
                    os.path.join(dirpath, f))
    return mods


def _targets(mods, module, node):
    """The package modules an import statement of ``module`` imports. A name that is no .py
    module (a compiled extension, or an attribute of the package) is a node of its own, so
    that ``from . import _fastpath`` is not read as an import of the package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "flashattn"]
    if node.level:
        base = module if mods[module].endswith("__init__.py") else module.rpartition(".")[0]
        parts = base.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1])
        target = base + ("." + node.module if node.module else "")
    else:
        target = node.module or ""
    if target.split(".")[0] != "flashattn":
        return []
    if node.module is None:  # from . import a, b: submodules
        return [target + "." + a.name for a in node.names]
    return [target]


def _graph():
    mods = _modules()
    edges = {m: set() for m in mods}
    for module, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[module].update(t for t in _targets(mods, module, node) if t != module)
    return edges


def _cycle(edges):
    """A cycle of the graph as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_has_no_cycle():
    edges = _graph()
    assert "flashattn._torch_ops" in edges and edges["flashattn._torch_ops"]
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_each_module_imports_first_in_any_order(rng):
    names = sorted(_modules())
    orders = [names, names[::-1]] + [[str(m) for m in rng.permutation(names)] for _ in range(2)]
    for order in orders:
        code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\nprint('ok')\n" % (
            order,)
        r = run_python(code)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (order, r.stderr[-2000:])


@pytest.mark.parametrize("order", ["torch, flashattn", "flashattn, torch"])
def test_first_call_of_a_process_compiles_fullgraph(order):
    """The process's first flashattn call is one torch.compile traces (fullgraph): the package
    bound itself to torch when it met it, so the trace meets neither the C binding nor a DLPack
    type lookup that misses. Either import order; torch imported after flashattn binds through
    the import hook."""
    code = (
        "import %s\n"
        "import torch\n"
        "from flashattn import flash_attn_func\n"
        "f = lambda q, k, v: flash_attn_func(q, k, v, causal=True)\n"
        "g = torch.Generator().manual_seed(7)\n"
        "q, k, v = (torch.randn(1, 9, 2, 32, generator=g) for _ in range(3))\n"
        "got = torch.compile(f, fullgraph=True)(q, k, v)\n"
        "print(float((got - f(q, k, v)).abs().max()))\n" % order)
    r = run_python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.strip()) == 0.0, r.stdout
