"""The GPU benchmarks' timer: the best of ``reps`` CUDA-event-timed runs of fn after ``warmup``
untimed ones, in milliseconds (the stream drained before the timed runs)."""
import torch


def best_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best
