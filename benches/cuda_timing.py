"""CUDA-event timing shared by the torch reference scripts (`prefill_sdpa.py`, `decode_layer.py`)."""
import torch


def timed(fn, reps=10, warm=3, flush=None):
    """Median time of `fn` in µs over `reps` runs after `warm` warm-ups, CUDA events around
    each run; `flush` (a tensor) is overwritten before each timed run so that nothing comes
    from L2."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if flush is not None:
            flush.fill_(1.0)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    out.sort()
    return out[len(out) // 2]
