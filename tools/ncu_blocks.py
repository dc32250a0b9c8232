#!/usr/bin/env python3
"""The hot basic blocks of a kernel from ncu's per-instruction counts.

On the GPU machine, one kernel's SourceCounters and its SASS as CSV:
    ncu -k regex:'^fa_bwd$' -s 1 -c 1 --section SourceCounters -o /tmp/rep python3 prog.py
    ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > src.csv
then here:
    tools/ncu_blocks.py src.csv [other.csv ...] [--top 25]

Consecutive instructions executed the same number of times are taken as one block (a run of
straight-line code); each row: the block's instruction range, its executions (warp-level), the
instructions it issued in all, its share of the warp-stall samples, and its first instruction.
Two kernels side by side: compare the blocks with the same execution count (per tile, per key).
"""
import argparse
import csv


def load(path):
    """[(sass text, stall samples, executions)] in address order."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    col = rows[head].index
    stall, execs = col("Warp Stall Sampling (All Samples)"), col("Instructions Executed")
    out = []
    for r in rows[head + 1:]:
        if len(r) > max(stall, execs):
            out.append((r[1].strip(), int(r[stall] or 0), int(r[execs] or 0)))
    return out


def blocks(instrs):
    """[first, last, executions, issued, samples] runs of equal execution count."""
    out = []
    for i, (_, samples, n) in enumerate(instrs):
        if out and out[-1][2] == n:
            out[-1][1] = i
            out[-1][3] += n
            out[-1][4] += samples
        else:
            out.append([i, i, n, n, samples])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    opts = ap.parse_args()
    for path in opts.csv:
        instrs = load(path)
        total = sum(x[1] for x in instrs) or 1
        print("%s: %.1f M instructions issued, %d stall samples"
              % (path, sum(x[2] for x in instrs) / 1e6, total))
        for b in sorted(blocks(instrs), key=lambda b: -b[4])[:opts.top]:
            print("  %5d-%5d  exec %9d  issued %11d  samples %6d (%4.1f%%)  %s"
                  % (b[0], b[1], b[2], b[3], b[4], 100.0 * b[4] / total, instrs[b[0]][0][:56]))


if __name__ == "__main__":
    main()
