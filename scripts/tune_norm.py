"""Times LayerNorm / RMSNorm plans against each other to choose the auto planner's tables.

For each op, dtype and cols it times the auto plan, the oneflow plan and
the variants of the package's generators that `cupyops tune OP` times:
forward cupyops.ops.norm_candidates (block sizes, packs a thread, warp
widths, register vs shared-memory caches, rows cached by cp.async, peeled
rows), backward cupyops.ops.norm_grad_candidates (block sizes and the fewest
warps that hold a row at the same packs a thread, rows held or read again,
rows loaded together, fused vs separate dweight / dbias, peeled rows,
clusters), at most MAX_CANDIDATES per shape, with cupyops.bench.Timer (L2
flushed, median).

Bytes counted: forward 2 * rows * cols * itemsize (x read, y written);
backward 3 * rows * cols * itemsize (dy and x read, dx written; the weight,
the statistics and the dweight / dbias workspace are not counted). Forward
runs with weight (and bias for LayerNorm), backward with weight, dweight (and
dbias), as a training step calls them, or with --no-param-grad dx alone.

Each candidate is checked against a float64 reference (y or dx on the first
rows; dweight / dbias over all rows), so a fast wrong kernel cannot win:
its line ends in WRONG.

Usage on a GPU:  python scripts/tune_norm.py [--dtypes float16,bfloat16,float32]
                 [--ops layer_norm,...] [--cols 1024,...] [--rows 49152]
                 [--no-param-grad] > table
Without a GPU:   python scripts/tune_norm.py --dry-run [--profile h200]
(builds every candidate for the profile, compiling through NVRTC, and prints
their kernels' names, registers and spills).
"""
from __future__ import annotations

import argparse

from cupyops import dtypes
from cupyops.launch import Target
from cupyops.ops import norm, norm_candidates, norm_grad_candidates, norm_spec

DEFAULT_COLS = "1024,2048,4096,8192,12345,16384,32768"
CHECK_ROWS = 64
MAX_CANDIDATES = 48
# max |error| / max |reference| a correct kernel stays within (storage rounding)
TOLERANCE = {"f16": 4e-3, "bf16": 3e-2, "f32": 1e-4, "f64": 1e-9}


def candidates(op, dtype, rows, cols, target, param_grad=True):
    """(label, plan) for each variant worth timing at this shape: the
    policies first, then at most MAX_CANDIDATES kernels in all. param_grad
    (backward): dweight / dbias wanted."""
    # the package's generators (auto's and oneflow's plans first)
    if op in norm.FORWARD_OPS:
        found = [(c.label, norm.NormPlan(c.launch)) for c in norm_candidates.candidates(op, dtype, rows, cols, target)]
    else:
        found = [(c.label, c.plan(rows, cols, param_grad, target))
                 for c in norm_grad_candidates.candidates(op, dtype, rows, cols, target, param_grad=param_grad)]
    unique = {}
    for label, chosen in found:    # the first label of each set of launches (the policies come first)
        unique.setdefault(tuple((launch.spec.name, launch.grid) for launch in chosen.launches), (label, chosen))
    return list(unique.values())[:MAX_CANDIDATES]


def _kernel_names(chosen) -> str:
    return "+".join(launch.spec.name for launch in chosen.launches if launch.spec.impl != "param_grad_finish")


def dry_run(args) -> None:
    from cupyops import jit

    target = Target.profile(args.profile)
    for op in args.ops.split(","):
        for dtype_name in args.dtypes.split(","):
            short = dtypes.float_type(dtypes.parse_dtype(dtype_name)).short
            for cols in map(int, args.cols.split(",")):
                rows = _rows(args.rows, cols, dtypes.BY_SHORT[short].itemsize)
                for label, chosen in candidates(op, short, rows, cols, target, args.param_grad):
                    reports = [jit.compile_cubin(launch.spec, target.facts.arch) for launch in chosen.launches]
                    registers = "/".join(str(r.registers) for r in reports)
                    spills = sum(r.spill_bytes for r in reports)
                    print(f"{op:<19} {short:<4} cols={cols:<6} {label:<24} regs={registers:<9} "
                          f"spill={spills:<4} grid={chosen.main.grid[0]:<6} {_kernel_names(chosen)}", flush=True)


def _rows(rows: int, cols: int, itemsize: int) -> int:
    return min(rows, (4 << 30) // (cols * itemsize))


def _relative_error(got, expected) -> float:
    import cupy

    scale = max(float(cupy.abs(expected).max()), 1e-30)
    return float(cupy.abs(got.astype(cupy.float64) - expected).max()) / scale


class Shape:
    """Inputs of one (op, dtype, rows, cols), the float64 references, and a
    runner per plan that leaves its outputs where check() reads them."""

    def __init__(self, op, dtype, rows, cols, param_grad=True):
        import cupy

        from cupyops.rowwise import Operand

        self.op, self.rows, self.cols = op, rows, cols
        self.centered = op.startswith("layer_norm")
        self.backward = op in norm_spec.BACKWARD_OPS
        self.param_grad = param_grad
        self.device_id = cupy.cuda.runtime.getDevice()
        generator = cupy.random.default_rng(0)

        def normal(shape, loc=0.0, scale=1.0):
            return (loc + scale * generator.standard_normal(shape, dtype=cupy.float32)).astype(dtype)

        self.x = normal((rows, cols), 0.5, 2.0)
        self.weight = normal((cols,), 1.0, 0.2)
        self.bias = normal((cols,), 0.0, 0.2) if self.centered and not self.backward else None
        self.out = cupy.empty_like(self.x)
        self.x_op, self.out_op = Operand(self.x, cols), Operand(self.out, cols)
        mean, rstd = self._stats(rows if self.backward else CHECK_ROWS)
        if self.backward:
            import cupyops

            self.dy = normal((rows, cols))
            self.dy_op = Operand(self.dy, cols)
            stats = (cupyops.layer_norm(self.x, eps=1e-5, return_stats=True)[1:] if self.centered
                     else (None, cupyops.rms_norm(self.x, eps=1e-5, return_stats=True)[1]))
            self.mean, self.rstd = stats
            self.dweight = cupy.empty_like(self.weight)
            self.dbias = cupy.empty_like(self.weight) if self.centered else None
            self.expected = self._backward_reference(mean, rstd)
        else:
            xhat = (self.x[:CHECK_ROWS].astype(cupy.float64) - mean[:CHECK_ROWS, None]) * rstd[:CHECK_ROWS, None]
            y = xhat * self.weight.astype(cupy.float64)
            if self.bias is not None:
                y += self.bias.astype(cupy.float64)
            self.expected = {"y": y}

    def _stats(self, rows):
        """float64 mean (0 for RMSNorm) and rstd of the first rows, in chunks of rows."""
        import cupy

        means, rstds = [], []
        for first in range(0, rows, 4096):
            chunk = self.x[first:min(rows, first + 4096)].astype(cupy.float64)
            mean = chunk.mean(axis=1) if self.centered else cupy.zeros(len(chunk))
            rstds.append(1 / cupy.sqrt(((chunk - mean[:, None]) ** 2).mean(axis=1) + 1e-5))
            means.append(mean)
        return cupy.concatenate(means), cupy.concatenate(rstds)

    def _backward_reference(self, mean, rstd):
        import cupy

        weight = self.weight.astype(cupy.float64)
        dweight = cupy.zeros(self.cols)
        dbias = cupy.zeros(self.cols)
        dx = None
        for first in range(0, self.rows, 4096):
            x = self.x[first:first + 4096].astype(cupy.float64)
            dy = self.dy[first:first + 4096].astype(cupy.float64)
            xhat = (x - mean[first:first + 4096, None]) * rstd[first:first + 4096, None]
            dweight += (dy * xhat).sum(axis=0)
            dbias += dy.sum(axis=0)
            if dx is None:
                g = (dy * weight)[:CHECK_ROWS]
                head = xhat[:CHECK_ROWS]
                mean_g = g.mean(axis=1, keepdims=True) if self.centered else 0
                dx = rstd[:CHECK_ROWS, None] * (g - mean_g - head * (g * head).mean(axis=1, keepdims=True))
        expected = {"dx": dx}
        if self.param_grad:
            expected["dweight"] = dweight
            if self.centered:
                expected["dbias"] = dbias
        return expected

    def runner(self, chosen):
        if self.backward:
            return lambda: norm.launch_backward(
                chosen, self.device_id, self.rows, self.cols, self.dy_op, self.x_op, self.out_op, self.rstd,
                mean=self.mean, weight=self.weight, dweight=self.dweight if self.param_grad else None,
                dbias=self.dbias if self.param_grad else None)
        return lambda: norm.launch_forward(chosen, self.device_id, self.rows, self.cols, self.x_op, self.out_op,
                                           1e-5, weight=self.weight, bias=self.bias)

    def check(self, out) -> float:
        """Largest relative error of the last run's outputs (`out`: y or dx, self.out)."""
        got = {"y": out[:CHECK_ROWS], "dx": out[:CHECK_ROWS], "dweight": getattr(self, "dweight", None),
               "dbias": getattr(self, "dbias", None)}
        return max(_relative_error(got[name], expected) for name, expected in self.expected.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--ops", default=",".join(norm.OPS))
    parser.add_argument("--cols", default=DEFAULT_COLS)
    parser.add_argument("--no-param-grad", dest="param_grad", action="store_false",
                        help="backward: dx alone, no dweight / dbias")
    parser.add_argument("--dry-run", action="store_true", help="build and compile the candidates, no GPU")
    parser.add_argument("--profile", default="h200", help="device profile of --dry-run")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args)
        return

    import cupy

    from tuning import Tuning

    tuning = Tuning(budget_s=0.1)
    target = tuning.target
    for op in args.ops.split(","):
        arrays_counted = 3 if op in norm_spec.BACKWARD_OPS else 2
        for dtype_name in args.dtypes.split(","):
            dtype = dtypes.parse_dtype(dtype_name)
            short = dtypes.float_type(dtype).short
            for cols in map(int, args.cols.split(",")):
                rows = _rows(args.rows, cols, dtype.itemsize)
                shape = Shape(op, dtype, rows, cols, args.param_grad)
                num_bytes = arrays_counted * rows * cols * dtype.itemsize
                for label, chosen in candidates(op, short, rows, cols, target, args.param_grad):
                    median_us, gbs, fraction, error = tuning.measure(
                        shape.runner(chosen), shape.out, shape.check, num_bytes)
                    verdict = "" if error <= TOLERANCE[short] else "  WRONG"
                    print(f"{op:<19} {short:<4} cols={cols:<6} {label:<24} {_kernel_names(chosen)} "
                          f"{median_us:>9.1f} us {gbs:>6.0f} GB/s {fraction:>6.1%}  "
                          f"err={error:.1e}{verdict}", flush=True)
                del shape
                cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
