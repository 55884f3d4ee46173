"""What cupyops.torch stands on: CuPy views of torch tensors and torch tensors of CuPy
arrays without copies, the context that runs CuPy on torch's current stream, and the
registered custom op (what torch.compile traces) of each op."""
import contextlib
from typing import Optional

import cupy
import numpy
import torch

from cupyops.dtypes import BFLOAT16

# -- torch <-> cupy --------------------------------------------------------------------------

NUMPY_DTYPES = {torch.float16: numpy.dtype(numpy.float16), torch.bfloat16: BFLOAT16,
                torch.float32: numpy.dtype(numpy.float32), torch.float64: numpy.dtype(numpy.float64),
                torch.bool: numpy.dtype(numpy.bool_), torch.int8: numpy.dtype(numpy.int8),
                torch.uint8: numpy.dtype(numpy.uint8), torch.int16: numpy.dtype(numpy.int16),
                torch.int32: numpy.dtype(numpy.int32), torch.int64: numpy.dtype(numpy.int64)}
_INT16 = numpy.dtype(numpy.int16)
_MAX_VIEWS = 1024
_views: dict = {}     # (pointer, dtype, shape, strides, GPU) -> a CuPy view of that memory
_streams: dict = {}   # (GPU, torch's raw stream pointer) -> cupy.cuda.ExternalStream
LAST_AXES = {ndim: tuple(range(-ndim, 0)) for ndim in range(1, 65)}   # the last ndim axes (CuPy: at most 64)
_AS_IS = contextlib.nullcontext()


def to_cupy(tensor: Optional[torch.Tensor]):
    """A CuPy view of a CUDA tensor's memory, built from its pointer, shape and strides: no copy
    and, unlike DLPack, no per-call stream handshake. Views are kept by layout and owned by
    nobody (the caller's tensor keeps the memory alive for the call; a view outliving its
    tensor is never read, since ops return only memory they allocated)."""
    if tensor is None:
        return None
    key = (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(), tensor.get_device())
    view = _views.get(key)
    if view is None:
        dtype = NUMPY_DTYPES.get(tensor.dtype)
        if dtype is None or not tensor.is_cuda:
            raise TypeError(f"cupyops takes CUDA tensors of {', '.join(map(str, NUMPY_DTYPES))}, "
                            f"got {tensor.dtype} on {tensor.device}")
        pointer, _, shape, strides, device = key
        extent = 1 + sum((n - 1) * step for n, step in zip(shape, strides)) if all(shape) else 0
        memory = cupy.cuda.UnownedMemory(pointer, extent * dtype.itemsize, None, device)
        view = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0),
                            tuple(step * dtype.itemsize for step in strides))
        if len(_views) >= _MAX_VIEWS:
            _views.clear()
        _views[key] = view
    return view


def to_torch(array) -> Optional[torch.Tensor]:
    """A torch tensor of a CuPy array's memory (contiguous, as the fake implementations say),
    through DLPack without a stream handshake: producer and consumer share torch's stream."""
    if array is None:
        return None
    if array.dtype == BFLOAT16:
        return torch._C._from_dlpack(array.view(_INT16).__dlpack__(stream=-1)).view(torch.bfloat16).contiguous()
    return torch._C._from_dlpack(array.__dlpack__(stream=-1)).contiguous()


def _external(index: int, pointer: int):
    """torch's stream `pointer` of GPU `index` as a CuPy stream, wrapped once per stream."""
    stream = _streams.get((index, pointer))
    if stream is None:
        stream = _streams[index, pointer] = cupy.cuda.ExternalStream(pointer, index)
    return stream


@contextlib.contextmanager
def _on_gpu(index: int, stream):
    with cupy.cuda.Device(index), stream:
        yield


def context(tensor: torch.Tensor):
    """The context in which CuPy runs on tensor's GPU and torch's current stream there
    (its raw pointer read as torch.compile's generated code reads it): nothing to enter
    where CuPy's current device and stream are those already."""
    index = tensor.get_device()
    if index < 0:
        raise TypeError(f"cupyops takes CUDA tensors, got one on {tensor.device}")
    pointer = torch._C._cuda_getCurrentRawStream(index)
    if cupy.cuda.runtime.getDevice() != index:
        return _on_gpu(index, _external(index, pointer))
    return _AS_IS if cupy.cuda.get_current_stream().ptr == pointer else _external(index, pointer)


def needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors (None entries ignored)."""
    if torch.is_grad_enabled():
        for tensor in tensors:
            if tensor is not None and tensor.requires_grad:
                return True
    return False


def nothing(x: torch.Tensor) -> torch.Tensor:
    """The empty tensor standing for an output an op does not produce."""
    return x.new_empty(0)


def output_grad(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """An output's gradient in like's dtype: zeros where autograd passes None (an unused output)."""
    return torch.zeros_like(like) if grad is None else grad.to(like.dtype)


class CustomOp:
    """cupyops::name, the registered custom op with its fake implementation: what a call
    runs while torch.compile traces. Eager calls take the family's autograd Function (or
    the bare computation) instead; both run the same kernels."""

    def __init__(self, name: str, schema: str, implementation, fake):
        self.name, self.implementation = name, implementation
        self.custom = torch.library.custom_op(f"cupyops::{name}", implementation, mutates_args=(), schema=schema)
        self.custom.register_fake(fake)

    def differentiable(self, setup_context, gradient) -> "CustomOp":
        """Differentiable under torch.compile: setup_context(ctx, inputs, output) saves what
        gradient(ctx, *output gradients) reads; it returns a gradient per input, calling
        backward custom ops."""
        self.custom.register_autograd(gradient, setup_context=setup_context)
        return self

    def __call__(self, *args):
        return self.custom(*args)


def check_float(x: torch.Tensor) -> None:
    """TypeError unless x is a floating-point tensor."""
    if not x.is_floating_point():
        raise TypeError(f"cupyops takes floating-point tensors, got {x.dtype}")


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The norms' statistics' dtype for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32
