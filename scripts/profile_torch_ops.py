"""Host time and a cProfile of cupyops.torch forward + backward at the transformer example's
shapes, against torch's own ops. The autograd engine runs on the calling thread here, so the
profile sees the backward's Python as well as the forward's.

Usage (repository root, a CUDA GPU and torch): PYTHONPATH=. python scripts/profile_torch_ops.py
[--calls 200] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import cupyops.torch as ct


def cases(batch=8, seq=512, width=512, heads=8) -> list:
    """(label, cupyops.torch step, torch step, leaves): each step a forward whose output is returned."""
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", requires_grad=True)

    x, w = leaf(batch, seq, width), leaf(width)
    scores = leaf(batch, heads, seq, seq)
    a, b = leaf(batch, seq, 4 * width), leaf(batch, seq, 4 * width)
    causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    return [
        ("rms_norm", lambda: ct.rms_norm(x, (width,), w), lambda: F.rms_norm(x, (width,), w), (x, w)),
        ("fused_softmax causal dropout",
         lambda: ct.fused_softmax(scores, scale=0.125, causal=True, dropout=0.1, seed=1),
         lambda: F.dropout(torch.softmax((scores * 0.125).masked_fill(~causal, float("-inf")), -1), 0.1),
         (scores,)),
        ("swiglu", lambda: ct.swiglu(a, b), lambda: F.silu(a) * b, (a, b)),
    ]


def host_us(step, calls: int) -> float:
    """Host microseconds per forward + backward, the GPU left to catch up at the end only."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        step()
    host = time.perf_counter() - began
    torch.cuda.synchronize()
    return 1e6 * host / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    options = parser.parse_args()
    with torch.autograd.set_multithreading_enabled(False):
        for label, ours, theirs, leaves in cases():
            def step(function, leaves=leaves):
                y = function()
                y.backward(torch.ones_like(y))
                for t in leaves:
                    t.grad = None
            print(f"== {label}: host us per forward + backward: cupyops {host_us(lambda: step(ours), options.calls):.1f}, "
                  f"torch {host_us(lambda: step(theirs), options.calls):.1f}")
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(options.calls):
                step(ours)
            profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(options.top)


if __name__ == "__main__":
    main()
