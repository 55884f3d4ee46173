"""packed.PackedLaunch: the argument buffer it lays out and hands the driver (CPU, with the
driver call stood in for), and launches of a kernel that stores every argument it gets
(GPU), the memoised ops called from a thread that never touched CUDA among them."""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy
import pytest

from cupyops import packed


class _Function:
    ptr = 0xF00D


@pytest.fixture
def driver(monkeypatch):
    """The driver call and the current stream stood in for: each launch is recorded as
    (function, dims, smem, stream, the bytes of each argument as the driver would copy them)."""
    launches = []

    class Stream:
        ptr = 77

    def launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        launches.append((function, (gx, gy, gz, bx, by, bz), smem, stream, params))
    monkeypatch.setattr(packed, "launch_kernel", launch_kernel)
    monkeypatch.setattr(packed, "current_stream", lambda: Stream)
    monkeypatch.setattr(packed, "_driver_error", RuntimeError)
    return launches


def _argument_bytes(params: int, sizes: list) -> list:
    """The bytes at each address of the driver's argument array at `params`."""
    addresses = numpy.frombuffer(ctypes.string_at(params, 8 * len(sizes)), numpy.uint64)
    return [ctypes.string_at(int(a), n) for a, n in zip(addresses, sizes)]


def test_constants_are_laid_out_once_and_changing_values_packed_per_launch(driver):
    record = numpy.arange(16, dtype=numpy.uint64)          # 128 bytes passed by value
    args = (packed.POINTER, numpy.int64(-5), "80s", numpy.float32(1.5), None, "I", record,
            packed.POINTER, 3, 2.25, numpy.uint32(9))
    launch = packed.PackedLaunch(_Function(), (7,), (128, 2), 4096, args)
    keys = bytes(range(80))
    sizes = [8, 8, 80, 4, 8, 4, 128, 8, 8, 8, 4]
    for values in ((0x1000, keys, 3, 0x2000), (0x3000, bytes(80), 2 ** 32 - 1, 0)):
        launch(values)
        function, dims, smem, stream, params = driver[-1]
        assert (function, dims, smem, stream) == (0xF00D, (7, 1, 1, 128, 2, 1), 4096, 77)
        expected = [struct.pack("=Q", values[0]), numpy.int64(-5).tobytes(), values[1],
                    numpy.float32(1.5).tobytes(), bytes(8), struct.pack("=I", values[2]), record.tobytes(),
                    struct.pack("=Q", values[3]), numpy.int64(3).tobytes(), numpy.float64(2.25).tobytes(),
                    numpy.uint32(9).tobytes()]
        assert _argument_bytes(params, sizes) == expected
        assert launch.arguments(values) == (values[0], args[1], values[1], *args[3:5], values[2], record,
                                            values[3], *args[8:])
    addresses = numpy.frombuffer(ctypes.string_at(params, 8 * len(args)), numpy.uint64)
    assert int(addresses[2]) % 64 == 0 and int(addresses[6]) % 64 == 0   # records on 64 bytes
    assert all(int(a) % 8 == 0 for a in addresses)


def test_a_launch_on_a_given_stream_and_one_of_constants_only(driver):
    class Stream:
        ptr = 1234
    launch = packed.PackedLaunch(_Function(), (1, 2, 3), (32,), 0, (numpy.int64(4), numpy.bool_(True)))
    launch((), Stream)
    function, dims, smem, stream, params = driver[-1]
    assert (dims, stream) == ((1, 2, 3, 32, 1, 1), 1234)
    assert _argument_bytes(params, [8, 1]) == [numpy.int64(4).tobytes(), b"\x01"]
    launch.launch_on((), 4321)          # a caller holding the stream's address already
    assert driver[-1][3] == 4321 and len(driver) == 2


def test_formats_and_refusals():
    assert [packed.format_of(t) for t in (numpy.float32, numpy.float64, numpy.int64, numpy.uint64, numpy.int32,
                                          numpy.uint32, numpy.bool_)] == ["f", "d", "q", "Q", "i", "I", "?"]
    with pytest.raises(TypeError, match="complex128"):
        packed.format_of(numpy.complex128)
    with pytest.raises(TypeError, match="list"):
        packed.constant_bytes([1, 2])
    assert packed.constant_bytes(True) == b"\x01" and packed.constant_bytes(7) == numpy.int64(7).tobytes()


def test_another_driver_error_is_raised(driver, monkeypatch):
    class DriverError(Exception):
        status = 700

    def failing(*args):
        raise DriverError()
    monkeypatch.setattr(packed, "launch_kernel", failing)
    monkeypatch.setattr(packed, "_driver_error", DriverError)
    with pytest.raises(DriverError):
        packed.PackedLaunch(_Function(), (1,), (1,), 0, (packed.POINTER,))((0,))


# -- on the GPU ------------------------------------------------------------------------------

_STORE_ARGUMENTS = r"""
struct Keys { unsigned int words[20]; };
struct Record { unsigned long long words[16]; };
extern "C" __global__ void store_arguments(unsigned long long* out, long long a, Keys keys, float b,
                                           unsigned int c, Record record, double d, bool e) {
  out[0] = a; out[1] = keys.words[0] | (unsigned long long)keys.words[19] << 32;
  out[2] = __float_as_uint(b); out[3] = c; out[4] = record.words[0] + record.words[15];
  out[5] = __double_as_longlong(d); out[6] = e;
}
"""


@pytest.mark.gpu
def test_the_kernel_gets_every_argument():
    import cupy

    function = cupy.RawKernel(_STORE_ARGUMENTS, "store_arguments").kernel
    record = numpy.arange(16, dtype=numpy.uint64) * 3
    launch = packed.PackedLaunch(function, (1,), (1,), 0, (packed.POINTER, "q", "80s", numpy.float32(0.75), "I",
                                                           record, numpy.float64(-2.5), "?"))
    for a, c, e in ((-7, 5, True), (2 ** 40, 2 ** 32 - 1, False)):
        out = cupy.full(8, 99, dtype=cupy.uint64)
        keys = numpy.arange(20, dtype=numpy.uint32) + numpy.uint32(a % 1000)
        launch((out.data.ptr, a, keys.tobytes(), c, e))
        got = out.get()
        assert got[0] == numpy.int64(a).view(numpy.uint64)
        assert got[1] == int(keys[0]) | int(keys[19]) << 32
        assert got[2] == numpy.float32(0.75).view(numpy.uint32) and got[3] == c and got[4] == 45
        assert got[5] == numpy.float64(-2.5).view(numpy.uint64) and got[6] == e and got[7] == 99


@pytest.mark.gpu
def test_memoised_calls_from_a_new_thread(rng):
    """A thread that has made no CUDA call replays memoised ops (no context of its own yet)."""
    import cupy

    import cupyops

    x = cupy.asarray(rng.standard_normal((64, 128), dtype=numpy.float32))
    weight = cupy.asarray(rng.standard_normal(128, dtype=numpy.float32))
    calls = {"softmax": lambda: cupyops.softmax(x), "rms_norm": lambda: cupyops.rms_norm(x, weight),
             "fused_softmax": lambda: cupyops.fused_softmax(x, causal=True, dropout=0.25, seed=3),
             "bias_gelu": lambda: cupyops.bias_gelu(x, weight)}
    expected = {name: call().get() for name, call in calls.items()}
    for call in calls.values():
        call()      # memoised now
    cupy.cuda.Device().synchronize()
    got, errors = {}, []

    def run():
        try:
            for name, call in calls.items():
                got[name] = call().get()
        except Exception as error:     # reported below
            errors.append(error)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors
    for name in calls:
        numpy.testing.assert_array_equal(got[name], expected[name], err_msg=name)
