"""`flashattn precompile`'s output: a progress line rewritten in place on a terminal, none in a
log; -v lines and failures as they happen; the summary either way. And processes that share a
kernel cache compile each kernel once (the disk cache's compile lock).

A configuration for compute capability 1.0 fails at once (below the oldest the kernels
support), so a two-configuration run exercises a success and a failure in a few seconds."""

import os
import pty
import re
import subprocess
import tempfile

from conftest import REPO

CLI = os.environ.get("FLASHATTN_CLI", os.path.join(REPO, "build", "flashattn"))
ARGS = ["precompile", "--arch", "sm_80,sm_10", "--hdim", "32", "--dtype", "fp16",
        "--features", "none", "--jobs", "1"]
PROGRESS = re.compile(r"\rprecompile: (\d+)/2 done, (\d+) failed, \d+ s")
SUMMARY = re.compile(r"precompile: 2 configurations, (\d) compiled, (\d) already cached, "
                     r"1 failed, [0-9.]+ s with 1 threads")


def run(args, tty):
    """(exit status, stdout, stderr) of the command; with tty, both on one pseudo-terminal."""
    assert os.path.isfile(CLI), "%s: build the project first (make build)" % CLI
    env = dict(os.environ, FLASHATTN_CACHE_DIR=tempfile.mkdtemp(), CI="")
    if not tty:
        r = subprocess.run([CLI] + args, capture_output=True, text=True, env=env, timeout=300)
        return r.returncode, r.stdout, r.stderr
    main, sub = pty.openpty()
    p = subprocess.Popen([CLI] + args, stdin=sub, stdout=sub, stderr=sub, env=env)
    os.close(sub)
    chunks = []
    while True:
        try:
            data = os.read(main, 4096)
        except OSError:  # the terminal's other end closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    return p.wait(timeout=300), b"".join(chunks).decode(), ""


def nvrtc_missing(err):
    return "NVRTC is missing" in err


def test_log_has_no_progress_lines():
    rc, out, err = run(ARGS + ["-v"], tty=False)
    if nvrtc_missing(err):  # nothing to compile: skipped with rc 0, and nothing but that
        assert rc == 0 and out == "" and "\r" not in err
        return
    assert rc == 1
    assert "\r" not in out + err and "done," not in out + err
    assert re.search(r"^compiled sm_80 fp16 hdim 32$", out, re.M), out
    assert re.search(r"^FAILED sm_10 fp16 hdim 32: .*compute capability 1\.0", err, re.M), err
    assert SUMMARY.search(out.splitlines()[-1]), out
    # Without -v: the summary alone on stdout.
    rc, out, err = run(ARGS, tty=False)
    assert rc == 1 and len(out.splitlines()) == 1 and SUMMARY.match(out), out


def test_terminal_progress_line():
    rc, text, _ = run(ARGS, tty=True)
    if nvrtc_missing(text):
        assert rc == 0 and "done," not in text
        return
    assert rc == 1
    seen = [(int(a), int(b)) for a, b in PROGRESS.findall(text)]
    # It starts at 0/2, counts both configurations and the failure, never goes back.
    assert seen[0] == (0, 0) and seen[-1] == (2, 1), seen
    assert seen == sorted(seen), seen
    # The failure is printed on a cleared line, and so is the summary, which ends the output.
    assert re.search(r"\r +\rFAILED sm_10 fp16 hdim 32: ", text), repr(text)
    last = text.split("\r\n")[-2]
    assert SUMMARY.search(last) and re.search(r"\r +\rprecompile: 2 configurations", last), \
        repr(last)
    assert "compiled sm_80" not in text  # -v lines only under -v


def test_processes_share_compiles():
    """Three processes precompiling one configuration into one empty cache at once: each of its
    kernels is compiled by one of them, the others wait on that kernel's lock and find it on
    disk. (Which process compiles which kernel is the scheduler's: one that found a kernel on
    disk may take the next kernel's lock before the one that compiled it.)"""
    assert os.path.isfile(CLI), "%s: build the project first (make build)" % CLI
    env = dict(os.environ, FLASHATTN_CACHE_DIR=tempfile.mkdtemp(), CI="", FLASHATTN_LOG="1")
    args = [CLI, "precompile", "--arch", "sm_80", "--hdim", "32", "--dtype", "fp16",
            "--features", "none", "--jobs", "1"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(3)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    if any(nvrtc_missing(err) for _, err, _ in results):
        return
    summaries = [re.search(r"1 configurations, (\d) compiled, (\d) already cached, 0 failed", out)
                 for out, _, _ in results]
    assert all(rc == 0 for _, _, rc in results) and all(summaries), results
    assert any(int(m.group(1)) == 1 for m in summaries), results
    # The kernels each process compiled, and those it found on disk (FLASHATTN_LOG's lines).
    compiled = [re.findall(r"^flashattn: compiled in [0-9.]+ ms \(\d+ bytes\) (.+)$", err, re.M)
                for _, err, _ in results]
    found = [re.findall(r"^flashattn: cache hit \(disk[^)]*\) (.+)$", err, re.M)
             for _, err, _ in results]
    every = [k for c in compiled for k in c]
    assert every and len(every) == len(set(every)), compiled  # each kernel compiled once
    for c, f in zip(compiled, found):
        assert sorted(c + f) == sorted(every), (c, f, every)  # the rest found on disk
