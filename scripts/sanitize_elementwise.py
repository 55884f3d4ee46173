"""Runs every elementwise kernel path once on small arrays, for compute-sanitizer
(memcheck, racecheck): each operand access (the output's layout in packs and element by
element, per-column blocks, per-row values, one element, strides), the tail, several outputs,
dropout, both policies, in place and overlapping outputs. Prints "all paths ran" at the end."""
from __future__ import annotations

import cupy

import cupyops


def main():
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((33, 1031), dtype=cupy.float32)
    h = x.astype(cupy.float16)
    bias, row = rng.standard_normal(1031, dtype=cupy.float32), rng.standard_normal((33, 1), dtype=cupy.float32)
    even = rng.standard_normal((32, 1024), dtype=cupy.float32).astype(cupy.float16)
    for policy in ("auto", "oneflow"):
        cupyops.elementwise("x + bias * r + s", x=x, bias=bias, r=row, s=cupy.float32(2), policy=policy)
        cupyops.elementwise("gelu(a + b), a > b", a=even, b=even[0], policy=policy)          # packs, tail 0
        cupyops.elementwise("a * b - c", a=h, b=x.T.copy().T, c=h[:, ::-1], policy=policy)   # strided
        cupyops.elementwise("a + 1", a=h.ravel()[1:], policy=policy)                          # misaligned, tail
        cupyops.elementwise("residual + dropout(x + b, 0.2, 5, 3)", x=h, b=h[0], residual=h, policy=policy)
        cupyops.bias_dropout_add(even, even[0], even, 0.1, 11, policy=policy)
        y = x.copy()
        cupyops.elementwise("y * 2", y=y, out=y, policy=policy)                               # in place
        cupyops.elementwise("y + 1", y=y.ravel()[:-1], out=y.ravel()[1:], policy=policy)      # overlapping
        cupyops.elementwise("exp(z)", z=cupy.asarray(1.5, cupy.float64), policy=policy)      # one element
    cupy.cuda.Device().synchronize()
    print("all paths ran")


if __name__ == "__main__":
    main()
