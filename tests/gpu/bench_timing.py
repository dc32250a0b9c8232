"""The GPU benchmarks' timer: the best of ``reps`` CUDA-event-timed runs of fn after ``warmup``
untimed ones, in milliseconds (the stream drained before the timed runs). A run is ``calls``
calls back to back, timed together and divided: with one, a call's host work before its first
kernel counts (the GPU waits for it); with several, the host runs ahead of the GPU as in a
training loop, and the figure is the GPU's throughput."""
import torch


def best_ms(fn, reps, warmup, calls=1):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best
