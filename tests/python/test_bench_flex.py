"""bench/flex.py with tiny shapes (--smoke), in a subprocess: one table line per case with a
number in each timed column, and flashattn's output checked against torch's FlexAttention
before it is timed (a disagreement ends the script with an error)."""

import os
import subprocess
import sys

import flashattn

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "flex.py")
CASES = ("causal", "window 256", "prefix-LM", "document x8", "softcap 30", "alibi",
         "relative bias")


def run(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", FLASHATTN_NUM_THREADS="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(flashattn.__file__))))
    return subprocess.run([sys.executable, SCRIPT, "--smoke"] + list(argv), capture_output=True,
                          text=True, env=env, timeout=300)


def rows(stdout):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("| ") and "---" not in ln]
    return {c[0]: c[1:] for c in ([x.strip() for x in ln.strip("|").split("|")]
                                  for ln in lines[1:])}


def test_forward_table():
    r = run()
    assert r.returncode == 0, r.stderr[-3000:]
    table = rows(r.stdout)
    assert tuple(table) == CASES
    for name, cells in table.items():
        assert float(cells[0]) > 0, name  # flashattn's time
        if "torch" in sys.modules and cells[-1] != "-":
            assert float(cells[-1]) <= 1e-3, name  # the agreement with torch


def test_backward_table():
    r = run("--backward")
    assert r.returncode == 0, r.stderr[-3000:]
    table = rows(r.stdout)
    assert tuple(table) == CASES + ("relative bias, learnt",)
    for name, cells in table.items():
        assert float(cells[0]) > 0 and float(cells[1]) > 0, name
