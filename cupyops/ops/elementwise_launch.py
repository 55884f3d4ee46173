"""Launching fused elementwise plans: a call's signature, and the launcher bound to one.

A repeated call of a FusedFunction builds its signature (`signature`: the policy, the
current GPU and each operand's dtype, shape, C-contiguity or strides, address modulo 16
and GPU; a Python number's type), finds the Launcher made for it and runs it: the
operands' addresses packed after the constant arguments (packed.PackedLaunch), the
output written directly where it overlaps no operand except as x = f(x). The launcher
knows its GPU and reads the stream's address once a call, for the recycled output
(callcache.empty_on) and the launch (PackedLaunch.launch_on) alike.
"""
from __future__ import annotations

import functools
import operator
from typing import Callable, Optional

import numpy

from .. import callcache, fx
from ..callcache import cupy_module
from ..packed import POINTER, PackedLaunch, address, format_of

MAX_PACK_BYTES = 16
PYTHON_SCALARS = (bool, int, float)


def array_key(array) -> tuple:
    """What a launcher depends on of an array (signature inlines it): strides
    stand as True for a C-contiguous array, which a plan reads like any other of its shape
    (the strides of axes of size 1 it differs in are never read)."""
    memory = array.data
    return (array.dtype, array.shape, array._c_contiguous or array.strides, memory.ptr & (MAX_PACK_BYTES - 1),
            memory.device_id)


def getter(positions: tuple) -> Callable:
    """args -> the tuple of args at positions (indices, or keys of a dict), in one C call where
    there are several."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return (lambda args: (args[positions[0]],)) if positions else (lambda args: ())


class Launcher:
    """A plan (elementwise.ElementwisePlan) bound to its compiled function for one signature
    (operand layouts, out given or not): all a repeated call does, `run(args, out, stream)`,
    chosen once for the signature."""

    def __init__(self, plan, function, args: tuple, out, device: Optional[int] = None):
        cupy = cupy_module()
        self.plan = plan
        self.device = device          # the operands' GPU where it is not the current one
        self.on_device = cupy.cuda.Device
        # operands passed as given (every argument an array, in order) or picked and cast
        in_order = not plan.scalars and plan.arrays == tuple(range(len(args)))
        self.take_arrays = None if in_order else getter(plan.arrays)
        self.scalars, self.dropout_p = plan.scalars, plan.dropout_p
        # the kernel (None for an empty result): operand addresses, scalars, output addresses, size,
        # layout parameters
        self.launch = None if not plan.size else PackedLaunch(
            function, (plan.grid,), (plan.block,), 0,
            (POINTER,) * len(plan.arrays) + tuple(format_of(cast) for _, cast in plan.scalars) +
            (POINTER,) * len(plan.out_dtypes) + (numpy.int64(plan.size), *plan.params))
        # outputs made (or recycled) for this GPU, the current one while the launcher is made,
        # and the call's stream, whose address a call reads once
        self.empty_on, self.stream_ptr = callcache.empty_on, callcache.stream_ptr
        self.device_id = cupy.cuda.runtime.getDevice()
        self.outputs = tuple((plan.shape, dtype) for dtype in plan.out_dtypes)
        self.shape, self.dtype = self.outputs[0]
        # the array operands an output may overlap: (position, read at the very elements written)
        self.reads = tuple((position, operand.access == "linear")
                           for position, operand in zip(plan.arrays, plan.spec.operands))
        self.may_share_memory = callcache.may_share_memory
        outs = () if out is None else out if isinstance(out, tuple) else (out,)
        self.out_contiguous = tuple(o.flags.c_contiguous for o in outs)
        single = len(self.outputs) == 1
        launch = (self._fresh if out is None else self._into) if single else self._several
        # run(args, out, stream): the launch, under the operands' GPU where it is not the current
        self.run = launch if device is None else functools.partial(self._on_device, launch)

    def _direct(self, k: int, out, args) -> bool:
        """Whether out (the k-th output) can be written by the kernel itself: C-contiguous, and
        every operand it overlaps read at the very elements written (x = f(x))."""
        if not self.out_contiguous[k]:
            return False
        may_share_memory = self.may_share_memory
        for position, same_elements in self.reads:
            operand = args[position]
            if may_share_memory(out, operand) and not (
                    same_elements and operand.data.ptr == out.data.ptr and operand.dtype == out.dtype):
                return False
        return True

    def values(self, args: tuple, targets: tuple) -> tuple:
        """The kernel's changing arguments: operand addresses, scalars, output addresses;
        dropout probabilities among the scalars checked (ValueError)."""
        if self.take_arrays is None:
            return (*map(address, args), *map(address, targets))
        return self._values_at(args, map(address, self.take_arrays(args)), map(address, targets))

    def _values_at(self, args: tuple, operands, targets) -> tuple:
        """values() from the array operands' addresses (in the kernel's order) and the outputs'."""
        if self.dropout_p:
            self.check_dropout(args)
        return (*operands, *[cast(args[p]) for p, cast in self.scalars], *targets)

    def launch_at(self, args: tuple, targets: tuple) -> None:
        """The kernel on the current stream, on another library's arrays of this launcher's
        layouts: `args` the call's, each array's address (an int) in its place; `targets` the
        addresses of C-contiguous, 16-byte aligned outputs of `outputs`' shapes and dtypes."""
        self.launch((*args, *targets) if self.take_arrays is None else
                    self._values_at(args, self.take_arrays(args), targets))

    def check_dropout(self, args: tuple) -> None:
        """ValueError unless every dropout probability among the scalars is in [0, 1)."""
        for position in self.dropout_p:
            fx.check_dropout_p(args[position])

    def _on_device(self, launch, args: tuple, out, stream):
        with self.on_device(self.device):      # its current stream too
            return launch(args, out, stream)

    def _fresh(self, args: tuple, out, stream):
        """One output, allocated."""
        stream_ptr = self.stream_ptr() if stream is None else stream.ptr
        target = self.empty_on(self.shape, self.dtype, self.device_id, stream_ptr)
        if self.launch is None:
            self.check_dropout(args)           # where nothing is launched
        elif self.take_arrays is None:
            self.launch.launch_on((*map(address, args), target.data.ptr), stream_ptr)
        else:
            self.launch.launch_on(self.values(args, (target,)), stream_ptr)
        return target

    def _into(self, args: tuple, out, stream):
        """One output, into out (an array or a tuple of one): directly where it can be, else
        through a fresh array copied in."""
        if type(out) is tuple:
            (out,) = out
        stream_ptr = self.stream_ptr() if stream is None else stream.ptr
        target = out if self._direct(0, out, args) else self.empty_on(self.shape, self.dtype, self.device_id,
                                                                       stream_ptr)
        if self.launch is None:
            self.check_dropout(args)
        elif self.take_arrays is None:
            self.launch.launch_on((*map(address, args), target.data.ptr), stream_ptr)
        else:
            self.launch.launch_on(self.values(args, (target,)), stream_ptr)
        if target is not out:
            out[...] = target
        return out

    def _several(self, args: tuple, out, stream):
        """Several outputs, allocated or into the arrays of out."""
        stream_ptr = self.stream_ptr() if stream is None else stream.ptr
        outs = tuple(self.empty_on(shape, dtype, self.device_id, stream_ptr)
                     for shape, dtype in self.outputs) if out is None else out
        targets = tuple(o if out is None or self._direct(k, o, args) else
                        self.empty_on(*self.outputs[k], self.device_id, stream_ptr) for k, o in enumerate(outs))
        if self.launch is not None:
            self.launch.launch_on(self.values(args, targets), stream_ptr)
        else:
            self.check_dropout(args)
        for o, t in zip(outs, targets):
            if o is not t:
                o[...] = t
        return outs


def signature(args: tuple, out, policy: str) -> Optional[tuple]:
    """What a launcher depends on of the operands and outputs (array_key's fields, inlined), on
    the current GPU; None for another library's array."""
    runtime = callcache.runtime or cupy_module().cuda.runtime
    ndarray = callcache.ndarray
    key = [policy, runtime.getDevice()]
    for a in args:
        kind = type(a)
        if kind is ndarray:
            memory = a.data
            key += a.dtype, a.shape, a._c_contiguous or a.strides, memory.ptr & 15, memory.device_id
        elif kind in PYTHON_SCALARS:
            key.append(kind)
        elif isinstance(a, numpy.generic):
            key.append(a.dtype)
        else:
            return None
    if type(out) is ndarray:
        memory = out.data
        key += out.dtype, out.shape, out._c_contiguous or out.strides, memory.ptr & 15, memory.device_id
    elif out is not None:
        key.append(tuple(array_key(check_out(o)) for o in (out if isinstance(out, tuple) else (out,))))
    return tuple(key)


def check_out(out):
    if not isinstance(out, cupy_module().ndarray):
        raise TypeError(f"out must be a cupy.ndarray, got {type(out).__name__}")
    return out
