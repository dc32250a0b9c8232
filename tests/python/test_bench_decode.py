"""bench/decode_gpu.py on CPU tensors with tiny shapes (--device cpu --smoke), in a subprocess:
every case prints one table line with numbers where they belong, and a flashattn that answers
wrong (or reads cache rows past cache_seqlens) is flagged instead of timed as if right.

One thread each for torch and flashattn: on a small shared machine their thread pools take
the cores from each other and a tiny call can take milliseconds."""

import itertools
import json
import os
import subprocess
import sys

import flashattn

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "decode_gpu.py")

# The --smoke axes, as the script documents them.
BATCHES, CONTEXTS, ROWS = (1, 2), (64, 300), (1, 16)
CASES = ("kvcache contig", "kvcache paged16", "kvcache paged256", "func")
HEADS, KV_HEADS, D = 8, 2, 64


def run(argv, code=None):
    """The script (or `code` importing it as decode_gpu) with argv: the CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", FLASHATTN_NUM_THREADS="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(flashattn.__file__))))
    head = [sys.executable, SCRIPT] if code is None else [
        sys.executable, "-c", "import sys; sys.path.insert(0, %r); import decode_gpu\n%s"
        % (os.path.dirname(SCRIPT), code)]
    return subprocess.run(head + list(argv), capture_output=True, text=True, env=env,
                          timeout=120)


def table(stdout):
    """[{column: cell}] of the markdown table in stdout."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "")) == {"-"}
    return [dict(zip(cols, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def test_smoke_table(tmp_path):
    path = tmp_path / "rows.json"
    r = run(["--device", "cpu", "--smoke", "--host", "--json", str(path)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("decode: CPU"), r.stdout
    rows = table(r.stdout)
    want = {(case, b, ctx, n) for b, ctx, case, n in
            itertools.product(BATCHES, CONTEXTS, CASES, ROWS)}
    got = [(x["case"], int(x["batch"]), int(x["context"]), int(x["rows"])) for x in rows]
    assert sorted(got) == sorted(want)
    for x, key in zip(rows, got):
        _, b, ctx, _ = key
        assert (x["d"], x["h/hk"], x["note"]) == (str(D), "%d/%d" % (HEADS, KV_HEADS), ""), x
        # No cuDNN or FLASH backend on the CPU: "-"; the math backend is the reference.
        assert [x[c] for c in ("cudnn us", "flash us", "cudnn TB/s", "flash TB/s")] == ["-"] * 4
        assert x["sdpa kv (cudnn,flash,math)"] == "-,-,g"
        for name in ("fa", "math"):
            us, tbs = float(x[name + " us"]), float(x[name + " TB/s"])
            kv_bytes = 2 * b * ctx * KV_HEADS * D * 2  # bf16 keys and values
            assert 0 < us < 1e6 and float(x[name + " host us"] if name == "fa" else
                                          x["sdpa host us"]) > 0, x
            # Both figures are printed rounded: us to 0.1, TB/s to 0.001.
            lo, hi = kv_bytes / (us + 0.05) / 1e6, kv_bytes / max(us - 0.05, 1e-9) / 1e6
            assert lo - 0.0005 <= tbs <= hi + 0.0005, x
        assert abs(float(x["fa/best"]) - float(x["math us"]) / float(x["fa us"])) < 0.02 + \
            0.01 * float(x["fa/best"]), x
        assert 0 <= float(x["max err"]) <= 2e-2, x
    kept = json.loads(path.read_text())
    assert len(kept["rows"]) == len(rows)
    assert all(set(k["us"]) == {"flashattn", "math"} and not k["wrong"] for k in kept["rows"])


def test_wrong_answers_flagged():
    # A flashattn off by 0.1, and a KV-cache step that reads the whole capacity (the rows past
    # cache_seqlens): each row says WRONG and the exit status is 2.
    code = """
real_func, real_kvcache = decode_gpu.flash_attn_func, decode_gpu.flash_attn_with_kvcache
decode_gpu.flash_attn_func = lambda *a, **k: real_func(*a, **k) + 0.1
def whole_cache(*a, **k):
    k.pop("cache_seqlens")
    return real_kvcache(*a, **k)
decode_gpu.flash_attn_with_kvcache = whole_cache
sys.exit(decode_gpu.main(sys.argv[1:]))
"""
    r = run(["--device", "cpu", "--smoke", "--batch", "2", "--context", "300", "--reps", "3"],
            code)
    assert r.returncode == 2, r.stdout + r.stderr
    rows = table(r.stdout)
    assert len(rows) == len(CASES) * len(ROWS)
    for x in rows:
        assert x["fa/best"] == "WRONG" and x["max err"].endswith("!! WRONG"), x
    assert "!! %d row(s)" % len(rows) in r.stderr


def test_fp8_cache_rows():
    # --kv-fp8: a float8_e4m3fn twin of each KV-cache case, its TB/s over one byte an element;
    # the same rows with the value descale dropped (outputs off by the scale) say WRONG.
    args = ["--device", "cpu", "--smoke", "--batch", "2", "--context", "300", "--reps", "3",
            "--kv-fp8", "--only", "kvcache"]
    r = run(args)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table(r.stdout)
    fp8 = [x for x in rows if x["case"].startswith("kvcache fp8 ")]
    assert sorted(x["case"] for x in fp8) == sorted(
        "kvcache fp8 " + c.split(" ", 1)[1] for c in CASES if c.startswith("kvcache")
        for _ in ROWS)
    for x in fp8:
        us, tbs = float(x["fa us"]), float(x["fa TB/s"])
        kv_bytes = 2 * 2 * 300 * KV_HEADS * D  # one byte an element
        assert kv_bytes / (us + 0.05) / 1e6 - 0.0005 <= tbs <= \
            kv_bytes / max(us - 0.05, 1e-9) / 1e6 + 0.0005, x
        assert x["fa/best"] != "WRONG" and float(x["max err"]) > 0, x
    code = """
real_kvcache = decode_gpu.flash_attn_with_kvcache
def no_v_descale(*a, **k):
    k.pop("v_descale", None)
    return real_kvcache(*a, **k)
decode_gpu.flash_attn_with_kvcache = no_v_descale
sys.exit(decode_gpu.main(sys.argv[1:]))
"""
    r = run(args, code)
    assert r.returncode == 2, r.stdout + r.stderr
    for x in table(r.stdout):
        assert (x["fa/best"] == "WRONG") == x["case"].startswith("kvcache fp8 "), x


def test_fa_env_call_cache():
    # --fa-env: the variables set only inside env_set, and calls made there cached apart (a
    # cached call keeps the workspace size of its first plan, which the variables may change);
    # the default's cache back afterwards. Then a table with the fa* column.
    code = """
from flashattn import _cached
_cached._LOCAL.calls = outer = {"default": 1}
with decode_gpu.env_set({"FLASHATTN_TEST_VAR": "7"}):
    assert os.environ["FLASHATTN_TEST_VAR"] == "7"
    inner = _cached._LOCAL.calls
    assert inner is not outer and "default" not in inner
    inner["env"] = 2
assert "FLASHATTN_TEST_VAR" not in os.environ and _cached._LOCAL.calls is outer
with decode_gpu.env_set({"FLASHATTN_TEST_VAR": "7"}):
    assert _cached._LOCAL.calls is inner
print("env_set ok")
"""
    r = run([], "import os\n" + code)
    assert r.returncode == 0 and "env_set ok" in r.stdout, r.stdout + r.stderr
    r = run(["--device", "cpu", "--smoke", "--batch", "2", "--context", "300", "--reps", "3",
             "--only", "kvcache", "--fa-env", "FLASHATTN_DECODE_WG=0"])
    assert r.returncode == 0, r.stdout + r.stderr
    for x in table(r.stdout):
        assert float(x["fa* us"]) > 0 and x["note"] == "", x
