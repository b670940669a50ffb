"""CUDA-graph timing shared by the benchmarks (no vLLM import)."""

from __future__ import annotations

import statistics

import torch


def stacked_time_us(fns, iters: int) -> float:
    """Median us per call when ``fns`` are captured back to back in one CUDA graph (several
    distinct layers, as in a decode step); ``[fn]`` times a single call in its own graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times) / len(fns)
