"""The GPU benchmarks' timer: the best of ``reps`` CUDA-event-timed runs of fn after ``warmup``
untimed ones, in milliseconds (the stream drained before the timed runs). A run is ``calls``
calls back to back, timed together and divided: with one, a call's host work before its first
kernel counts (the GPU waits for it); with several, the host runs ahead of the GPU as in a
training loop, and the figure is the GPU's throughput. ``best_ms_rotated`` times several
candidates in turn, one run each per round, so that all of them see the same GPU state (its
state drifts over a long benchmark by as much as the differences being measured)."""
import contextlib

import torch


def best_ms(fn, reps, warmup, calls=1):
    return best_ms_rotated({None: fn}, reps, warmup, calls)[None]


def best_ms_rotated(fns, reps, warmup, calls=1):
    """{name: best ms} of fns, {name: fn or (fn, context)}: each round times every candidate
    once, the first of the round moving on by one each round. A context (a callable returning
    a context manager, e.g. SDPA's backend choice) is entered around a run, outside the timed
    part."""
    entries = {n: f if isinstance(f, tuple) else (f, contextlib.nullcontext)
               for n, f in fns.items()}
    for fn, ctx in entries.values():
        with ctx():
            for _ in range(warmup):
                fn()
    torch.cuda.synchronize()
    names = list(entries)
    best = dict.fromkeys(names, float("inf"))
    for rep in range(reps):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            fn, ctx = entries[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with ctx():
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
            torch.cuda.synchronize()
            best[name] = min(best[name], start.elapsed_time(end) / calls)
    return best
