"""GPU tests of cupyops.dask: every op over Dask arrays of CuPy chunks (cut where the op
must rechunk, and into blocks that dropout must rechunk into slabs) gives the single-array
op's result over the whole array: bit for bit where each element is computed alone, within
the dtype's tolerance where rows are reduced (dropout's masks included). On one GPU with
Dask's threads; with the blocks on GPU 1 while GPU 0 is current (and the single-array ops
on GPU 1 arrays while GPU 0 is current); on a cluster of two workers, one a GPU. Norm
gradients also against float64 NumPy, and bit-identical run to run. Two-GPU tests skip,
saying so, with fewer GPUs."""
from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy
import pytest

from conftest import GPU, TOLERANCES

pytestmark = pytest.mark.gpu
da = pytest.importorskip("dask.array")

import cupyops  # noqa: E402
import cupyops.dask as cd  # noqa: E402
from cupyops import dask_cluster, dask_chunks, fx, tune  # noqa: E402
from cupyops.dtypes import BFLOAT16  # noqa: E402

F16, F32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)


def _gpu_count() -> int:
    return dask_cluster.gpu_count() if GPU else 0


two_gpus = pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs; fewer are usable on this machine")


@dataclass
class Case:
    """inputs(rng): {name: (NumPy array, Dask chunks)}; run(ops, arrays): the op called through
    `ops` (cupyops on CuPy arrays, or cupyops.dask on Dask arrays), same arguments both ways."""
    inputs: Callable
    run: Callable
    dtype: numpy.dtype = F32
    exact: bool = False          # each element computed alone: bit for bit
    # absolute tolerance: spread * the dtype's rtol * the largest value (norm gradients: a rounding
    # of each block's partial)
    spread: float = 4.0


def _normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _norm_inputs(rng, dtype):
    x = _normal(rng, (24, 3, 40), dtype)
    return {"x": (x, (7, 2, 17)), "w": (_normal(rng, 40, dtype), 40), "b": (_normal(rng, 40, dtype), 20),
            "r": (_normal(rng, x.shape, dtype), (5, 3, 40)), "dy": (_normal(rng, x.shape, dtype), (9, 1, 40))}


def _layer_norm_backward(ops, a):
    _, mean, rstd = ops.layer_norm(a["x"], a["w"], a["b"], return_stats=True)
    return ops.layer_norm_backward(a["dy"], a["x"], mean, rstd, a["w"])


def _rms_norm_backward(ops, a):
    _, rstd = ops.rms_norm(a["x"], a["w"], return_stats=True)
    return ops.rms_norm_backward(a["dy"], a["x"], rstd, a["w"])


def _attention_inputs(rng, dtype, chunks=(1, 1, 10, 40)):
    """chunks: x's, by default slabs cut along the rows (causal's diagonal moves per block)."""
    x = _normal(rng, (2, 4, 24, 40), dtype) * 3
    mask = rng.random((2, 1, 1, 40)) < 0.8
    return {"x": (x, chunks), "bias": (_normal(rng, (24, 40), F32), (12, 40)), "mask": (mask, 1),
            "dy": (_normal(rng, x.shape, dtype), (1, 2, 24, 40))}


ATTENTION = dict(scale=0.3, causal=True, diagonal=16, dropout=0.2, seed=7, offset=1000)


def _fused(ops, a):
    return ops.fused_softmax(a["x"], bias=a["bias"], mask=a["mask"], return_lse=True, **ATTENTION)


def _fused_backward(ops, a):
    _, lse = _fused(ops, a)
    return ops.fused_softmax_backward(a["dy"], a["x"], lse, bias=a["bias"], mask=a["mask"], **ATTENTION)


def _pair(rng, dtype, bias_shape=(1, 48)):
    return {"a": (_normal(rng, (30, 48), dtype), (8, 20)), "b": (_normal(rng, bias_shape, dtype), (1, 48)),
            "r": (_normal(rng, (30, 48), dtype), (15, 48))}


def _dropped(a, b, seed, offset):
    return fx.dropout(fx.gelu_tanh(a) * b, 0.3, seed, offset), a - b


def _conv_inputs(rng, dtype):
    x = rng.integers(-128, 128, (6, 2, 9, 9, 32), dtype=numpy.int8)
    return {"x": (x, (4, 2, 5, 9, 32)), "w": (rng.integers(-128, 128, (64, 2, 3, 3, 32), dtype=numpy.int8), -1),
            "bias": (_normal(rng, 64, F32), 64), "z": (rng.integers(-128, 128, (6, 2, 5, 5, 32), dtype=numpy.int8), 3)}


CASES = {
    "softmax": Case(lambda rng, d: {"x": (_normal(rng, (33, 70), d), (10, 30))},
                    lambda ops, a: ops.softmax(a["x"], axis=-1), F16),
    "log_softmax over axis 0": Case(lambda rng, d: {"x": (_normal(rng, (50, 6, 9), d), (20, 3, 9))},
                                    lambda ops, a: ops.log_softmax(a["x"], axis=0)),
    "softmax_backward": Case(lambda rng, d: {"dy": (_normal(rng, (20, 64), d), (6, 64)),
                                             "y": (_normal(rng, (20, 64), d), (10, 32))},
                             lambda ops, a: ops.softmax_backward(a["dy"], a["y"]), BFLOAT16),
    "log_softmax_backward": Case(lambda rng, d: {"dy": (_normal(rng, (20, 64), d), (6, 64)),
                                                 "y": (_normal(rng, (20, 64), d), 5)},
                                 lambda ops, a: ops.log_softmax_backward(a["dy"], a["y"])),
    "layer_norm": Case(_norm_inputs, lambda ops, a: ops.layer_norm(a["x"], a["w"], a["b"], residual=a["r"],
                                                                   return_stats=True), F16),
    "rms_norm": Case(_norm_inputs, lambda ops, a: ops.rms_norm(a["x"], axis=(1, 2), residual=a["r"],
                                                               return_stats=True)),
    "layer_norm_backward": Case(_norm_inputs, _layer_norm_backward, spread=32),
    "rms_norm_backward": Case(_norm_inputs, _rms_norm_backward, F16, spread=32),
    "fused_softmax": Case(_attention_inputs, _fused, F16),
    "fused_softmax over blocks that are not slabs": Case(lambda rng, d: _attention_inputs(rng, d, (2, 3, 24, 40)),
                                                         _fused),
    "fused_softmax_backward": Case(_attention_inputs, _fused_backward),
    "bias_gelu": Case(_pair, lambda ops, a: ops.bias_gelu(a["a"], a["b"], "tanh"), F16, True),
    "bias_silu": Case(_pair, lambda ops, a: ops.bias_silu(a["a"], a["b"]), F32, True),
    "swiglu": Case(lambda rng, d: _pair(rng, d, (30, 48)), lambda ops, a: ops.swiglu(a["a"], a["b"]), BFLOAT16,
                   True),
    "geglu": Case(lambda rng, d: _pair(rng, d, (30, 48)), lambda ops, a: ops.geglu(a["a"], a["b"]), F32, True),
    "bias_dropout_add": Case(_pair, lambda ops, a: ops.bias_dropout_add(a["a"], a["b"], a["r"], 0.25, 3, offset=9),
                             F16, True),
    "elementwise": Case(_pair, lambda ops, a: ops.elementwise("sigmoid(a + b), a * r", a=a["a"], b=a["b"], r=a["r"]),
                        F32, True),
    "fuse with dropout": Case(_pair, lambda ops, a: ops.fuse(_dropped)(a["a"], a["b"], 5, 321), F16, True),
    "conv2d_int8": Case(_conv_inputs, lambda ops, a: ops.conv2d_int8(
        a["x"], a["w"], a["bias"], a["z"], padding=1, stride=2, alpha=1 / 256, gamma=0.5, relu=True), F32, True),
}


# -- running a case -----------------------------------------------------------------------------

def _on_device(block, device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.asarray(block)


def _dask_inputs(inputs: dict, device_id: int = 0, one_chunk: bool = False, devices=None) -> dict:
    """Dask arrays of the inputs' chunks (or each one chunk), made on GPU `device_id` (or, for the
    inputs named in `devices`, on the GPU it gives)."""
    return {name: da.from_array(values, chunks=-1 if one_chunk else chunks).map_blocks(
        _on_device, (devices or {}).get(name, device_id), meta=dask_chunks.cupy_meta(values.dtype, values.ndim))
        for name, (values, chunks) in inputs.items()}


def _cupy_inputs(inputs: dict, device_id: int = 0) -> dict:
    return {name: _on_device(values, device_id) for name, (values, _) in inputs.items()}


def _results(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _run_dask(case: Case, inputs: dict, device_id: int = 0, client=None, where=None, one_chunk=False,
              devices=None) -> tuple:
    """The case through cupyops.dask, computed (threads, or `client`), on the host; and the set of
    where(block) over the result blocks (default: the GPU holding it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # rechunk warnings: the chunks are cut on purpose
        arrays = _dask_inputs(inputs, device_id, one_chunk, devices)
        results = [r for r in _results(case.run(cd, arrays)) if r is not None]
    devices = [r.map_blocks(where or _device_of, dtype=numpy.int64, chunks=(1,) * r.ndim,
                            meta=numpy.empty((0,) * r.ndim, numpy.int64)) for r in results]
    host = [dask_cluster.to_host(r) for r in results]
    computed = client.compute(host + devices, sync=True) if client is not None else \
        da.compute(*host, *devices, scheduler="threads")
    return list(computed[:len(host)]), {int(d) for array in computed[len(host):] for d in numpy.ravel(array)}


def _device_of(block):
    return numpy.full((1,) * block.ndim, block.device.id)


def _run_single(case: Case, inputs: dict, device_id: int = 0) -> list:
    import cupy

    return [cupy.asnumpy(r) for r in _results(case.run(cupyops, _cupy_inputs(inputs, device_id))) if r is not None]


def _assert_same(actual: list, expected: list, case: Case):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        if case.exact or a.dtype.kind in "biu":
            numpy.testing.assert_array_equal(a, e)
            continue
        rtol = TOLERANCES[a.dtype]["rtol"]
        largest = float(numpy.abs(e.astype(numpy.float64)).max(initial=0))
        numpy.testing.assert_allclose(a.astype(numpy.float64), e.astype(numpy.float64), rtol=4 * rtol,
                                      atol=case.spread * rtol * largest)


@pytest.fixture(autouse=True)
def _default_conv_plans(monkeypatch):
    monkeypatch.setenv(tune.AUTOTUNE_ENV, "0")


# -- one GPU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_the_single_array_op(rng, name):
    case = CASES[name]
    inputs = case.inputs(rng, case.dtype)
    actual, devices = _run_dask(case, inputs)
    assert devices == {0}
    _assert_same(actual, _run_single(case, inputs), case)


def test_norm_gradients_are_bit_identical_run_to_run(rng):
    case = CASES["layer_norm_backward"]
    inputs = case.inputs(rng, F16)
    first, _ = _run_dask(case, inputs)
    again, _ = _run_dask(case, inputs)
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()


def test_norm_gradients_against_float64(rng):
    x, dy, w = (rng.standard_normal(s) for s in ((64, 96), (64, 96), 96))
    xhat = (x - x.mean(-1, keepdims=True)) / numpy.sqrt(x.var(-1, keepdims=True) + 1e-5)
    arrays = _dask_inputs({"x": (x.astype(F32), (10, 96)), "dy": (dy.astype(F32), (10, 96)),
                           "w": (w.astype(F32), 96)})
    _, mean, rstd = cd.layer_norm(arrays["x"], arrays["w"], return_stats=True)
    _, dweight, dbias = cd.layer_norm_backward(arrays["dy"], arrays["x"], mean, rstd, arrays["w"])
    dweight, dbias = da.compute(dask_cluster.to_host(dweight), dask_cluster.to_host(dbias), scheduler="threads")
    numpy.testing.assert_allclose(dweight, (dy * xhat).sum(0), rtol=1e-4, atol=1e-4)
    numpy.testing.assert_allclose(dbias, dy.sum(0), rtol=1e-4, atol=1e-4)


# -- two GPUs -----------------------------------------------------------------------------------

# Dask's own tasks (a rechunk's concatenation) allocate on the worker thread's current GPU:
# in one process, the inputs below are chunked so that no data moves between blocks.
GPU_1_BLOCKS = {
    "layer_norm_backward": {"x": (8, 3, 40), "dy": (8, 3, 40), "w": 40, "b": 40, "r": (8, 3, 40)},
    "fused_softmax": {"x": (1, 1, 12, 40), "dy": (1, 1, 12, 40), "bias": (12, 40), "mask": (1, 1, 1, 40)},
    "bias_dropout_add": {"a": (10, 48), "b": (1, 48), "r": (10, 48)},
}


@two_gpus
@pytest.mark.parametrize("name", sorted(CASES))
def test_one_block_on_gpu_1_while_gpu_0_is_current(rng, name):
    import cupy

    case = CASES[name]
    inputs = case.inputs(rng, case.dtype)
    with cupy.cuda.Device(0):
        actual, devices = _run_dask(case, inputs, device_id=1, one_chunk=True)
    assert devices == {1}
    _assert_same(actual, _run_single(case, inputs), case)


@two_gpus
@pytest.mark.parametrize("name", sorted(GPU_1_BLOCKS))
def test_blocks_on_gpu_1_while_gpu_0_is_current(rng, name):
    import cupy

    case = CASES[name]
    inputs = {key: (values, GPU_1_BLOCKS[name][key]) for key, (values, _) in case.inputs(rng, case.dtype).items()}
    with cupy.cuda.Device(0):
        actual, devices = _run_dask(case, inputs, device_id=1)
    assert devices == {1}
    _assert_same(actual, _run_single(case, inputs), case)


@two_gpus
@pytest.mark.parametrize("name", ["conv2d_int8", "layer_norm", "bias_gelu"])
def test_operands_on_gpu_0_follow_x_on_gpu_1(rng, name):
    """x on GPU 1, every other operand (weight, bias, residual, filter, z) on GPU 0, GPU 0 current:
    each block's op runs on GPU 1 with the others copied there."""
    import cupy

    case = CASES[name]
    inputs = case.inputs(rng, case.dtype)
    first = "a" if "a" in inputs else "x"
    with cupy.cuda.Device(0):
        actual, devices = _run_dask(case, inputs, device_id=0, one_chunk=True, devices={first: 1})
    assert devices == {1}
    _assert_same(actual, _run_single(case, inputs), case)


SINGLE_ON_GPU_1 = sorted(CASES)


@two_gpus
@pytest.mark.parametrize("name", SINGLE_ON_GPU_1)
def test_single_array_op_on_gpu_1_while_gpu_0_is_current(rng, name):
    import cupy

    case = CASES[name]
    inputs = case.inputs(rng, case.dtype)
    with cupy.cuda.Device(1):
        expected = _run_single(case, inputs, device_id=1)
    with cupy.cuda.Device(0):
        arrays = _cupy_inputs(inputs, device_id=1)
        results = [r for r in _results(case.run(cupyops, arrays)) if r is not None]
        assert {r.device.id for r in results} == {1}
        actual = [cupy.asnumpy(r) for r in results]
    for a, e in zip(actual, expected):
        numpy.testing.assert_array_equal(a, e)     # the same GPU model: the same plans, bit for bit


@pytest.fixture(scope="module")
def two_workers():
    distributed = pytest.importorskip("distributed")
    cloudpickle = pytest.importorskip("cloudpickle")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the workers cannot import this file
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tune.AUTOTUNE_ENV, "0")     # the workers inherit it
        cluster, started = dask_cluster.local_cluster(2)
    print(f"cluster: {started}")
    with cluster, distributed.Client(cluster) as client:
        yield client


@two_gpus
@pytest.mark.parametrize("name", sorted(CASES))
def test_two_workers_equal_one_gpu(rng, name, two_workers):
    case = CASES[name]
    inputs = case.inputs(rng, case.dtype)
    actual, devices = _run_dask(case, inputs, client=two_workers)
    assert devices == {0}     # each worker sees its own GPU alone, as device 0
    _assert_same(actual, _run_single(case, inputs), case)


def _process_of(block):
    import os

    return numpy.full((1,) * block.ndim, os.getpid())


@two_gpus
def test_two_workers_share_the_blocks(rng, two_workers):
    case = Case(lambda rng, d: {"x": (_normal(rng, (4096, 256), d), (128, 256))},
                lambda ops, a: ops.layer_norm(a["x"]), F16)
    inputs = case.inputs(rng, case.dtype)
    actual, processes = _run_dask(case, inputs, client=two_workers, where=_process_of)
    assert len(processes) == 2 and len(two_workers.scheduler_info()["workers"]) == 2
    _assert_same(actual, _run_single(case, inputs), case)


def test_random_normal_is_made_on_the_gpu():
    x = dask_cluster.random_normal((1000, 300), (256, 300), F16, seed=3)
    host = dask_cluster.to_host(x).compute(scheduler="threads")
    assert host.dtype == F16 and host.shape == (1000, 300)
    assert abs(float(host.astype(numpy.float64).std()) - 1.0) < 0.02
    again = dask_cluster.to_host(dask_cluster.random_normal((1000, 300), (256, 300), F16, seed=3))
    numpy.testing.assert_array_equal(again.compute(scheduler="threads"), host)
    assert math.isclose(float(host[:256].astype(numpy.float64).mean()), 0.0, abs_tol=0.02)
