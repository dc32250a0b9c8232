#!/usr/bin/env python3
"""Local-memory use (spills) of the kernels in a flashattn kernel cache.

Fill a cache first (no GPU needed):
    FLASHATTN_CACHE_DIR=/tmp/fa-cache build/flashattn precompile --arch sm_80,sm_90a
then
    tools/check_spills.py /tmp/fa-cache            # one row per kernel: registers, LDL, STL, ...
    tools/check_spills.py /tmp/fa-cache --check    # exit status 1 when any kernel touches local
                                                   # memory or serialises all its wgmmas
    tools/check_spills.py NEW --compare OLD        # the rows whose counts differ between two caches
    tools/check_spills.py DIR --check --source fa_fwd_sm90.cu,fa_bwd_sm90.cu   # those families only

A cache entry is header | key | cubin (src/cuda/fa_jit_disk.c); the key names the source, the
target and the defines, which label the row. Counts come from cuobjdump's SASS (LDL and STL
instructions; "serial": HGMMAs waited for before the next one is issued, which is every one of
them where ptxas serialises a kernel's wgmmas, a remark NVRTC does not always return in the log)
and resource usage (registers, stack frame); cuobjdump is taken from $CUOBJDUMP,
then PATH, then $CUDA_HOME/bin, then the nvidia-cuda-cuobjdump wheel.
"""
import argparse
import concurrent.futures
import glob
import hashlib
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile

MAGIC = b"FACUBIN2"
HEADER = struct.Struct("<8sQQQ")  # magic, key_size, cubin_size, tag (fa_jit_header)


def pip_cuobjdumps():
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (nvidia/<package>/bin), if installed."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(c for p in nvidia.__path__ for c in glob.glob(os.path.join(p, "*", "bin", "cuobjdump")))


def find_cuobjdump():
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
             os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    for cand in cands + pip_cuobjdumps():
        if cand and os.access(cand, os.X_OK):
            return cand
    sys.exit("check_spills: no cuobjdump (set CUOBJDUMP to its path)")


def read_entry(path):
    """(key, cubin bytes) of a cache entry, or None for a file that is not one."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size:
        return None
    magic, key_size, cubin_size, _ = HEADER.unpack_from(data)
    if magic != MAGIC or HEADER.size + key_size + cubin_size != len(data):
        return None
    key = data[HEADER.size:HEADER.size + key_size].decode("ascii", "replace")
    return key, data[HEADER.size + key_size:]


def label(key):
    """'source target defines' from a key, without the version words and the source hash, so
    that the same configuration matches across source changes."""
    words = key.split()
    keep = [w for w in words[1:] if not w.startswith(("nvrtc-", "src-"))]
    defines = [re.sub(r"=1$", "", w[2:]) for w in keep if w.startswith("-D") and not w.endswith("=0")]
    return " ".join([w for w in keep if not w.startswith("-D")] + defines)


def sass_stats(sass, stats):
    """Adds to stats ({function: kernel_stats' list}) the counts read from cuobjdump's SASS of
    the functions: LDL, STL, instructions, digest, HGMMAs, HGMMAs waited for alone."""
    fn = None
    digests = {}
    last = None  # the last HGMMA or WARPGROUP (ARRIVE, DEPBAR) instruction
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            fn = m.group(1)
            stats.setdefault(fn, [0, 0, 0, 0, 0, "", 0, 0])
            digests[fn] = hashlib.sha1()
            last = None
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and fn:
            op = m.group(1).split(".")[0]
            s = stats[fn]
            s[2] += op == "LDL"
            s[3] += op == "STL"
            s[4] += 1
            s[6] += op == "HGMMA"
            if op in ("HGMMA", "WARPGROUP"):
                wait0 = "DEPBAR" in m.group(1) and "gsb0, 0x0" in line
                s[7] += last == "HGMMA" and wait0
                last = op
            # the instruction without its address and encoding: the code, wherever it sits
            digests[fn].update(line.split(";")[0].split("*/", 1)[-1].encode())
    for fn, d in digests.items():
        stats[fn][5] = d.hexdigest()[:12]


def kernel_stats(cuobjdump, cubin):
    """{function: [registers, stack bytes, LDL, STL, instructions, SASS digest, HGMMAs,
    serialised HGMMAs]} of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(cubin)
        tmp.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", tmp.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", tmp.name],
                              capture_output=True, text=True, check=True).stdout
    stats = {}
    fn = None
    for line in usage.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            fn = m.group(1)
            stats[fn] = [0, 0, 0, 0, 0, "", 0, 0]
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+)", line)
        if m and fn:
            stats[fn][0] = int(m.group(1))
            stats[fn][1] = int(m.group(2))
    sass_stats(sass, stats)
    return stats


def collect(cache, cuobjdump, sources=None):
    """{(label, function): stats} over the entries of a cache directory (those of `sources`
    alone when given), cuobjdump run for several entries at once."""
    entries = []
    for name in sorted(os.listdir(cache)):
        path = os.path.join(cache, name)
        if not os.path.isfile(path):
            continue
        entry = read_entry(path)
        if entry is not None and (not sources or label(entry[0]).split()[0] in sources):
            entries.append(entry)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        stats = pool.map(lambda e: kernel_stats(cuobjdump, e[1]), entries)
        return {(label(key), fn): s
                for (key, _), found in zip(entries, stats) for fn, s in found.items()}


def serial(s):
    """Whether a kernel's wgmmas all run one at a time (a kernel of at least four)."""
    return s[6] >= 4 and s[7] == s[6]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache", help="kernel cache directory (FLASHATTN_CACHE_DIR)")
    ap.add_argument("--compare", metavar="OLD",
                    help="a second cache: print the rows that differ ('same counts' when only "
                    "the code does)")
    ap.add_argument("--spills", action="store_true", help="only the kernels with LDL/STL")
    ap.add_argument("--check", action="store_true", help="exit 1 when any kernel spills")
    ap.add_argument("--source", metavar="LIST",
                    help="only the kernels of these sources, comma-separated (fa_bwd_sm90.cu,...)")
    a = ap.parse_args()
    cuobjdump = find_cuobjdump()
    sources = set(a.source.split(",")) if a.source else None
    new = collect(a.cache, cuobjdump, sources)
    if not new:
        sys.exit(f"check_spills: no cache entries in {a.cache}" + (f" from {a.source}" if sources else ""))
    head = "regs stack   LDL   STL  instrs serial  kernel"
    if a.compare:
        old = collect(a.compare, cuobjdump, sources)
        print(f"{'before':>30} | {'after':>30}")
        print(f"{head.split('  kernel')[0]:>30} | {head}")
        for k in sorted(set(old) | set(new)):
            o, n = old.get(k), new.get(k)
            if o == n:
                continue
            fmt = lambda s: "-" if s is None else "%4d %5d %5d %5d %7d %6d" % (*s[:5], s[7])
            same = o and n and o[:5] == n[:5] and o[7] == n[7]
            note = "  (same counts, other code)" if same else ""
            print(f"{fmt(o):>30} | {fmt(n):>30}  {k[0]} {k[1]}{note}")
    else:
        print(head)
        for k in sorted(new):
            s = new[k]
            if a.spills and not (s[2] or s[3] or serial(s)):
                continue
            print("%4d %5d %5d %5d %7d %6d  %s %s" % (*s[:5], s[7], k[0], k[1]))
    spilling = [k for k, s in new.items() if s[2] or s[3]]
    serialised = [k for k, s in new.items() if serial(s)]
    print(f"{len(spilling)} of {len(new)} kernels use local memory", file=sys.stderr)
    print(f"{len(serialised)} of {len(new)} kernels serialise their wgmmas", file=sys.stderr)
    return 1 if a.check and (spilling or serialised) else 0


if __name__ == "__main__":
    sys.exit(main())
