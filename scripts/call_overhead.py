"""Host cost of a repeated small call of every public op against bare
cupy launches of the same kernels with the same arguments, and of every
cupyops.torch function against torch's own op.

Each op runs on a 64 x 128 float32 array (--rows, --cols, --dtype), with
`out=` where it takes one and allocating. Its launches are recorded once (the
compiled kernels wrapped while the call and launch memos are rebuilt), then
timed plain: µs per call over repeated calls, against µs per round of the
recorded launches made directly through their cupy.RawKernel objects (same
grid, block, shared memory and arguments, arrays passed as arrays, outputs
included), the two timed in alternating rounds. The backward norms launch two
kernels (dx with fused dweight / dbias partial sums, and the kernel summing
the partials): their bare round is those two launches. A call that allocates
(its outputs, a workspace) is also timed against a second bare round that
makes the same allocations through cupy before the launches, as a caller of
the bare kernels returning new arrays would. Exits 1 when an op costs more
than its limit times its bare launches (the first round): MAX_RATIO, or
ELEMENTWISE_MAX_RATIO for the fused elementwise calls.

The torch section (skipped without torch or a GPU torch sees) times each
cupyops.torch function on the same small shape and on the shapes of
examples/transformer_block.py (--batch, --seq, --width, --heads): under
torch.no_grad, with inputs that need gradients (the forward builds the
graph) and forward + backward, against torch's own op in the same mode (their
rounds in turn) and the bare launches of the cupyops op it calls.
Informational: no limit.

Usage (repository root): PYTHONPATH=. python scripts/call_overhead.py [--section torch]
"""
from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy

import cupyops
from cupyops import callcache, jit, packed
from cupyops.callcache import CallCache
from cupyops.device import live_facts
from cupyops.dtypes import parse_dtype
from cupyops.launch import LaunchCache
from cupyops.ops import (activations, conv2d_int8, elementwise, fused_softmax, norm, norm_launch, softmax, softmax_axis,
                         softmax_split)
from cupyops.ops.elementwise import FusedFunction

MAX_RATIO = 2.0
ELEMENTWISE_MAX_RATIO = 1.5
SIGMOID_SUM = cupyops.fuse(lambda a, b: cupyops.fx.sigmoid(a + b))


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Best of `rounds` rounds of `calls` calls, synchronised at the end of each."""
    return per_call_us_alternating([fn], calls, rounds)[0]


def per_call_us_alternating(functions: list, calls: int, rounds: int = 5) -> list:
    """Each function's best of `rounds` rounds of `calls` calls (synchronised at the end of each),
    the functions' rounds taken in turn: a ratio of two is measured over the same stretch of
    the host's clock and load, not one function's rounds before the other's, and many short
    rounds let each function's best come from a quiet stretch of a shared host."""
    for fn in functions:
        for _ in range(100):
            fn()
    cupy.cuda.Device().synchronize()
    best = [float("inf")] * len(functions)
    for _ in range(rounds):
        for k, fn in enumerate(functions):
            began = time.perf_counter()
            for _ in range(calls):
                fn()
            cupy.cuda.Device().synchronize()
            best[k] = min(best[k], (time.perf_counter() - began) / calls * 1e6)
    return best


def _memo_slots() -> list:
    """(owner, attribute, empty memo) of every call and launch memo."""
    return ([(module, "_calls", CallCache) for module in (softmax, norm, conv2d_int8)] +
            [(module, "_launches", LaunchCache) for module in (softmax, softmax_axis, softmax_split, fused_softmax)] +
            [(norm_launch, "_ready_launches", dict), (elementwise, "_expressions", dict)] +
            [(function, "_launchers", LaunchCache) for function in (*vars(activations).values(), SIGMOID_SUM)
             if isinstance(function, FusedFunction)])


def _memos() -> tuple:
    """The memos _fresh_memos replaces."""
    return tuple(getattr(owner, name) for owner, name, _ in _memo_slots())


def _fresh_memos() -> None:
    """Empties the call and launch memos: the next call of each op compiles its launches anew."""
    for owner, name, empty in _memo_slots():
        setattr(owner, name, empty())


class _RecordingKernel:
    """A compiled kernel (cupy.RawKernel) whose launches through .kernel are logged; its
    other attributes are the kernel's."""

    def __init__(self, raw, log: list):
        self.__dict__.update(raw=raw, log=log)

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def __setattr__(self, name, value):
        setattr(self.raw, name, value)

    @property
    def kernel(self):
        return _RecordingFunction(self.raw, self.log)


class _RecordingFunction:
    """A kernel's cupy.cuda.Function that logs each launch as (kernel, grid, block, args,
    shared memory) before making it; its other attributes are the function's."""

    def __init__(self, raw, log: list):
        self.raw, self.function, self.log = raw, raw.kernel, log

    def __getattr__(self, name):
        return getattr(self.function, name)

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.log.append((self.raw, grid, block, args, shared_mem))
        self.function(grid, block, args, shared_mem, stream)


def _closure_arrays(call) -> dict:
    """The cupy arrays a case's call closes over or takes as defaults (also in tuples), by address."""
    found = {}
    cells = [c.cell_contents for c in call.__closure__ or ()] + list(call.__defaults__ or ())
    for value in cells:
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, cupy.ndarray):
                found.setdefault(item.data.ptr, item)
    return found


def _bare_arguments(launch, values: tuple, arrays: dict, kept: list) -> tuple:
    """A packed launch's arguments as a bare cupy launch takes them: an address of an array the
    call made or was given as that array (CuPy passes arrays as records), other addresses and
    scalars as NumPy scalars, records (tensor maps, round keys, parameter blocks) by address."""
    from cupy.cuda.function import CPointer

    def by_address(data):
        record = numpy.frombuffer(bytes(data), numpy.uint8).copy()
        kept.append(record)
        return CPointer(record.ctypes.data)

    found = []
    for fmt, value in zip(launch.args, launch.arguments(values)):
        if not isinstance(fmt, str):    # a constant
            found.append(by_address(value.tobytes()) if isinstance(value, numpy.ndarray) else value)
        elif fmt == packed.POINTER:
            found.append(arrays.get(value, numpy.uint64(value)))
        else:
            found.append(by_address(value) if isinstance(value, bytes) else packed.NUMPY_TYPES[fmt](value))
    return tuple(found)


def recorded_launches(call, allocations: list = None) -> tuple:
    """The launches of call() taken from the call memo (its second run),
    [(cupy.RawKernel or Function, grid, block, args, smem)], and what they need kept
    alive: the memos of that run, the arrays it made and the records passed by address.
    `allocations`, where given, gets what the second run allocated: (shape, dtype) of
    each array, (nbytes,) of each bare block. A fused function outside _memo_slots keeps
    the launcher its first call made here, allocating through a frame that no longer records."""
    log, made, kept, allocated = [], {}, [], []
    callcache.cupy_module()     # binds callcache.empty, .empty_on and .alloc
    compile_kernel, empty, empty_on, alloc = jit.kernel, callcache.empty, callcache.empty_on, callcache.alloc
    packed_launch_on = packed.PackedLaunch.launch_on
    jit.kernel = lambda spec, device_id: _RecordingKernel(compile_kernel(spec, device_id), log)

    recording = [True]      # emptied when done: a launcher made meanwhile keeps these allocators

    def recorded(array, shape, dtype):
        if recording:
            made.setdefault(array.data.ptr, array)
            allocated.append((shape, dtype))
        return array

    def recording_empty(shape, dtype):
        return recorded(empty(shape, dtype), shape, dtype)

    def recording_empty_on(shape, dtype, device_id, stream_ptr):
        return recorded(empty_on(shape, dtype, device_id, stream_ptr), shape, dtype)

    def recording_alloc(nbytes):
        if recording:
            allocated.append((nbytes,))
        return alloc(nbytes)

    def recording_packed(launch, values, stream_ptr):
        function = getattr(launch.function, "function", launch.function)   # a _RecordingFunction's
        arrays = {**_closure_arrays(call), **made}
        log.append((function, launch.grid, launch.block, _bare_arguments(launch, values, arrays, kept), launch.smem))
        packed_launch_on(launch, values, stream_ptr)

    _fresh_memos()
    # before the first call: launchers keep the allocators they find
    callcache.empty, callcache.empty_on, callcache.alloc = recording_empty, recording_empty_on, recording_alloc
    try:
        call()
        del log[:], allocated[:]
        packed.PackedLaunch.launch_on = recording_packed   # (its __call__ launches through launch_on)
        call()
    finally:
        jit.kernel, callcache.empty, callcache.empty_on, callcache.alloc = compile_kernel, empty, empty_on, alloc
        packed.PackedLaunch.launch_on = packed_launch_on
        recording.clear()
        kept += [_memos(), made]
        _fresh_memos()
    if allocations is not None:
        allocations += allocated
    return log, tuple(kept)


def bare_round(launches: list, kept: tuple, allocations: tuple = ()):
    """The launches made directly: through each cupy.RawKernel, or for an arch-specific
    cubin (jit.CubinKernel, which CuPy does not load) through its cupy Function;
    `kept`: what their arguments point into, held while the round lives. `allocations`
    (recorded_launches'): arrays (cupy.ndarray) and bare blocks (cupy.cuda.alloc) made
    first and dropped after the launches, as a caller of the bare kernels returning new
    arrays makes them (the launches still write the recorded arrays)."""
    calls = [(raw if callable(raw) else raw.kernel, *launch) for raw, *launch in launches]
    cupy_alloc = cupy.cuda.alloc

    def run(kept=kept):
        for function, grid, block, args, smem in calls:
            function(grid, block, args, shared_mem=smem)

    def run_allocating(kept=kept):
        made = [cupy.ndarray(*allocation) if len(allocation) == 2 else cupy_alloc(*allocation)
                for allocation in allocations]
        for function, grid, block, args, smem in calls:
            function(grid, block, args, shared_mem=smem)
        return made
    return run_allocating if allocations else run


def cases(rows: int, cols: int, dtype) -> list:
    """(label, call, limit) of every public op, with out= and allocating."""
    rng = cupy.random.default_rng(0)

    def array(*shape):
        return rng.standard_normal(shape, dtype=numpy.float32).astype(dtype)

    x, dy, out = array(rows, cols), array(rows, cols), cupy.empty((rows, cols), dtype)
    weight, bias = array(cols), array(cols)
    y = cupyops.softmax(x, axis=-1)
    log_y = cupyops.log_softmax(x, axis=-1)
    _, mean, rstd = cupyops.layer_norm(x, weight, bias, return_stats=True)
    _, rms_rstd = cupyops.rms_norm(x, weight, return_stats=True)
    found = []
    for name in ("softmax", "log_softmax"):
        function = getattr(cupyops, name)
        found += [(f"{name}(x, out=)", lambda f=function: f(x, axis=-1, out=out)),
                  (f"{name}(x)", lambda f=function: f(x, axis=-1))]
    for name, forward in (("softmax_backward", y), ("log_softmax_backward", log_y)):
        function = getattr(cupyops, name)
        found += [(f"{name}(dy, y, out=)", lambda f=function, fy=forward: f(dy, fy, out=out)),
                  (f"{name}(dy, y)", lambda f=function, fy=forward: f(dy, fy))]
    found += [("layer_norm(x, w, b, out=)", lambda: cupyops.layer_norm(x, weight, bias, out=out)),
              ("layer_norm(x, w, b)", lambda: cupyops.layer_norm(x, weight, bias)),
              ("rms_norm(x, w, out=)", lambda: cupyops.rms_norm(x, weight, out=out)),
              ("rms_norm(x, w)", lambda: cupyops.rms_norm(x, weight)),
              ("layer_norm_backward(dy, x, mean, rstd, w)",
               lambda: cupyops.layer_norm_backward(dy, x, mean, rstd, weight)),
              ("rms_norm_backward(dy, x, rstd, w)", lambda: cupyops.rms_norm_backward(dy, x, rms_rstd, weight))]
    # the attention softmax on (1, 1, rows, cols) scores, the fused elementwise ops on (rows, cols),
    # the int8 convolution on a 3x3 filter over 32 channels of 8 x 8 pixels
    scores, grad = x.reshape(1, 1, rows, cols), dy.reshape(1, 1, rows, cols)
    _, lse = cupyops.fused_softmax(scores, causal=True, return_lse=True)
    found += [("fused_softmax(x, causal, out=)",
               lambda: cupyops.fused_softmax(scores, causal=True, out=out.reshape(1, 1, rows, cols))),
              ("fused_softmax(x, causal)", lambda: cupyops.fused_softmax(scores, causal=True)),
              ("fused_softmax_backward(dy, x, lse, causal)",
               lambda: cupyops.fused_softmax_backward(grad, scores, lse, causal=True))]
    found = [(label, call, MAX_RATIO) for label, call in found]
    residual = array(rows, cols)
    found += [(label, call, ELEMENTWISE_MAX_RATIO) for label, call in (
        ("fuse(sigmoid(a + b))(x, dy, out=)", lambda: SIGMOID_SUM(x, dy, out=out)),
        ("fuse(sigmoid(a + b))(x, dy)", lambda: SIGMOID_SUM(x, dy)),
        ("elementwise('sigmoid(a + b)', out=)", lambda: cupyops.elementwise("sigmoid(a + b)", a=x, b=dy, out=out)),
        ("bias_gelu(x, b, out=)", lambda: cupyops.bias_gelu(x, bias, out=out)),
        ("bias_gelu(x, b)", lambda: cupyops.bias_gelu(x, bias)),
        ("bias_silu(x, b)", lambda: cupyops.bias_silu(x, bias)),
        ("swiglu(x, dy)", lambda: cupyops.swiglu(x, dy)),
        ("geglu(x, dy)", lambda: cupyops.geglu(x, dy)),
        ("bias_dropout_add(x, b, r, 0.1, 7)", lambda: cupyops.bias_dropout_add(x, bias, residual, 0.1, 7)))]
    images = rng.integers(-128, 128, (1, 1, 8, 8, 32), dtype=numpy.int8)
    filters = rng.integers(-128, 128, (32, 1, 3, 3, 32), dtype=numpy.int8)
    conv_out = cupy.empty((1, 1, 8, 8, 32), numpy.int8)
    found += [("conv2d_int8(x, w, out=)", lambda: cupyops.conv2d_int8(images, filters, padding=1, out=conv_out),
               MAX_RATIO),
              ("conv2d_int8(x, w)", lambda: cupyops.conv2d_int8(images, filters, padding=1), MAX_RATIO)]
    return found


def cupy_section(options) -> int:
    """The table of the public ops against their bare launches; 1 when one exceeds MAX_RATIO."""
    dtype = parse_dtype(options.dtype)
    device_name = live_facts(cupy.cuda.Device().id).name
    print(f"{device_name}, {options.rows} x {options.cols} {options.dtype}, host time per call")
    shape = (options.rows, options.cols)
    allocation, = per_call_us_alternating([lambda: cupy.ndarray(shape, dtype)], options.calls, options.rounds)
    print(f"allocating and freeing one {shape[0]} x {shape[1]} array (cupy.ndarray, the pool's hit path): "
          f"{allocation:.2f} us, a part of every call that returns a new array")
    print("bare: the recorded launches alone; bare+alloc: the same with the call's allocations (arrays and "
          "workspaces) made by cupy first, as a caller of the bare kernels returning new arrays makes them; "
          "the limits apply to the ratio to bare")
    print(f"{'op':44s} {'kernels':>7s} {'allocs':>6s} {'us/call':>8s} {'bare us':>8s} {'ratio':>6s} "
          f"{'bare+alloc':>10s} {'ratio':>6s}")
    worst, over = 0.0, 0
    for label, call, limit in cases(options.rows, options.cols, dtype):
        allocations = []
        launches, kept = recorded_launches(call, allocations)
        rounds = [bare_round(launches, kept), call] + ([bare_round(launches, kept, tuple(allocations))]
                                                       if allocations else [])
        bare, took, *allocating = per_call_us_alternating(rounds, options.calls, options.rounds)
        ratio = took / bare
        worst = max(worst, ratio)
        over += ratio > limit
        flag = "" if ratio <= limit else f"  > {limit}x"
        with_allocations = f"{allocating[0]:10.2f} {took / allocating[0]:6.2f}" if allocating else f"{'':10s} {'':6s}"
        print(f"{label:44s} {len(launches):7d} {len(allocations):6d} {took:8.2f} {bare:8.2f} {ratio:6.2f} "
              f"{with_allocations}{flag}")
    print(f"worst ratio {worst:.2f}; {over} over their limit ({MAX_RATIO}, elementwise {ELEMENTWISE_MAX_RATIO})")
    return 0 if not over else 1


def torch_cases(torch, options) -> list:
    """(label, calls, cupyops.torch function, torch's function, inputs) of every cupyops.torch
    function on rows x cols and on the example block's shapes: activations (batch * seq,
    width), attention scores (batch, heads, seq, seq), MLP hidden (batch * seq, 4 * width)."""
    import cupyops.torch as ct

    F = torch.nn.functional
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(*shape):
        return torch.randn(shape, dtype=getattr(torch, options.dtype), device="cuda", generator=generator)

    small = (options.rows, options.cols)
    tokens = options.batch * options.seq
    shapes = [(f"{options.rows}x{options.cols}", options.torch_calls, small, small, small),
              (f"b{options.batch} s{options.seq} w{options.width}", options.example_calls, (tokens, options.width),
               (options.batch, options.heads, options.seq, options.seq), (tokens, 4 * options.width))]
    found = []
    for tag, calls, rows, scores, hidden in shapes:
        h, r, s, a, g = tensor(*rows), tensor(*rows), tensor(*scores), tensor(*hidden), tensor(*hidden)
        w, b, bias = tensor(rows[-1]), tensor(rows[-1]), tensor(hidden[-1])
        causal = torch.ones(scores[-2:], dtype=torch.bool, device="cuda").tril()
        found += [
            (f"softmax {tag}", calls, lambda s: ct.softmax(s, -1), lambda s: torch.softmax(s, -1), [s]),
            (f"log_softmax {tag}", calls, lambda s: ct.log_softmax(s, -1), lambda s: torch.log_softmax(s, -1), [s]),
            (f"layer_norm {tag}", calls, lambda h, w, b: ct.layer_norm(h, h.shape[-1:], w, b),
             lambda h, w, b: F.layer_norm(h, h.shape[-1:], w, b), [h, w, b]),
            (f"rms_norm {tag}", calls, lambda h, w: ct.rms_norm(h, h.shape[-1:], w),
             lambda h, w: F.rms_norm(h, h.shape[-1:], w), [h, w]),
            (f"fused_softmax causal {tag}", calls, lambda s: ct.fused_softmax(s, scale=0.125, causal=True),
             lambda s, causal=causal: torch.softmax((s * 0.125).masked_fill(~causal, float("-inf")), -1), [s]),
            (f"bias_gelu {tag}", calls, ct.bias_gelu, lambda x, bias: F.gelu(x + bias), [a, bias]),
            (f"bias_silu {tag}", calls, ct.bias_silu, lambda x, bias: F.silu(x + bias), [a, bias]),
            (f"swiglu {tag}", calls, ct.swiglu, lambda a, g: F.silu(a) * g, [a, g]),
            (f"geglu {tag}", calls, ct.geglu, lambda a, g: F.gelu(a) * g, [a, g]),
            (f"bias_dropout_add {tag}", calls, lambda h, b, r: ct.bias_dropout_add(h, b, r, 0.1, 7),
             lambda h, b, r: r + F.dropout(h + b, 0.1), [h, b, r]),
        ]
    return found


def torch_section(options) -> None:
    """Each cupyops.torch function against torch's op under no_grad, with inputs needing
    gradients and forward + backward, and against the bare launches its forward makes."""
    try:
        import torch
    except ImportError:
        print("torch section skipped: torch is not installed")
        return
    if not torch.cuda.is_available():
        print("torch section skipped: torch sees no CUDA GPU")
        return
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {options.dtype}: host time per call "
          "(cupyops.torch, torch's op, the bare launches of the cupyops forward)")
    print(f"{'function':36s} {'mode':8s} {'cupyops':>8s} {'torch':>8s} {'bare fwd':>8s} {'ratio':>6s}")
    for label, calls, ours, theirs, inputs in torch_cases(torch, options):
        with torch.no_grad():
            launches, kept = recorded_launches(lambda: ours(*inputs))
        bare = per_call_us(bare_round(launches, kept), calls)
        leaves = [t.detach().requires_grad_() for t in inputs]
        dy = torch.randn_like(theirs(*inputs))

        def no_grad(function):
            def run():
                with torch.no_grad():
                    function(*inputs)
            return run

        modes = {"no_grad": no_grad, "grad": lambda function: lambda: function(*leaves),
                 "fwd+bwd": lambda function: lambda: torch.autograd.grad(function(*leaves), leaves, dy)}
        for mode, timed in modes.items():
            took, reference = per_call_us_alternating([timed(ours), timed(theirs)], calls)
            print(f"{label:36s} {mode:8s} {took:8.2f} {reference:8.2f} {bare:8.2f} {took / reference:6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=("all", "cupy", "torch"), default="all")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=4000, help="calls a round (cupy section)")
    parser.add_argument("--rounds", type=int, default=25, help="rounds of each op and its bare launches, in turn")
    parser.add_argument("--torch-calls", type=int, default=2000, help="calls per round, torch section, rows x cols")
    parser.add_argument("--example-calls", type=int, default=50, help="calls per round, example shapes")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    options = parser.parse_args()
    status = cupy_section(options) if options.section in ("all", "cupy") else 0
    if options.section in ("all", "torch"):
        torch_section(options)
    return status


if __name__ == "__main__":
    sys.exit(main())
