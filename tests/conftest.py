"""Shared test fixtures: GPU detection, per-dtype tolerances, float64 references."""
from __future__ import annotations

import numpy
import pytest

from cupyops.dtypes import BFLOAT16
from cupyops.profile import profiles


def _gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.is_available()
    except Exception:
        return False


GPU = _gpu_available()
GPU_SKIP_REASON = "needs a CUDA GPU; none is usable on this machine"

# Relative and absolute tolerances against float64 references, per dtype.
TOLERANCES = {
    numpy.dtype(numpy.float16): dict(rtol=1e-3, atol=1e-5),
    BFLOAT16: dict(rtol=1e-2, atol=1e-4),
    numpy.dtype(numpy.float32): dict(rtol=1e-5, atol=1e-6),
    numpy.dtype(numpy.float64): dict(rtol=1e-12, atol=1e-14),
}
DTYPES = list(TOLERANCES)


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """Fresh random data on every run (the seed is printed on failure)."""
    seed = numpy.random.SeedSequence().entropy % (2**32)
    print(f"random seed {seed}")
    return numpy.random.default_rng(seed)


def assert_close(actual, expected, dtype, *, scale: float = 1.0, err_msg: str = ""):
    """actual (any array) against a float64 reference with the dtype's tolerance.

    NaN and +-inf must match exactly in position; `scale` loosens the tolerance;
    `err_msg` names the case in a failure."""
    actual = numpy.asarray(actual, dtype=numpy.float64)
    tol = TOLERANCES[numpy.dtype(dtype)]
    numpy.testing.assert_allclose(actual, expected, rtol=tol["rtol"] * scale,
                                  atol=tol["atol"] * scale, equal_nan=True, err_msg=err_msg)


def peeled_cols(target, inputs, itemsize, kind) -> int:
    """Odd cols past the register path (rows at every phase, no 16-byte pack
    for the row) whose rows `inputs` arrays of shared memory hold ("smem": 0.7
    of the opt-in limit) or do not ("uncached": 1.5 times it)."""
    share = {"smem": 0.7, "uncached": 1.5}[kind]
    return int(share * target.facts.smem_per_block_optin / (inputs * itemsize)) | 1


def patch_tuning(monkeypatch, name: str, value) -> None:
    """Sets the tuning value `name` on every shipped device profile for one test."""
    for tuned in profiles():
        monkeypatch.setattr(tuned, name, value)


def keep_winner(table, device, op: str, shape_key: str, descriptions: list, label: str) -> dict:
    """Stores the description `label` among `descriptions` as the tuning
    table's winner for (device, op, shape_key), as if timed fastest."""
    from cupyops import tune

    result = tune.tune(table, device, op, shape_key, descriptions,
                       lambda description: 1.0 if description["label"] == label else 2.0)
    assert result.best["label"] == label
    return result.best


def stand_in_live(monkeypatch, table, profile_target, device):
    """Planners' view of a live GPU without one: the tuning table `table` as the user's, the
    device key fixed to `device`, and a target with `profile_target`'s facts and a device id
    whose occupancy and resources are the profile's (NVRTC's). Returns that target."""
    from cupyops import tune
    from cupyops.launch import Target

    monkeypatch.setattr(tune, "default_table", lambda: table)
    monkeypatch.setattr(tune.DeviceKey, "live", classmethod(lambda cls, device_id: device))
    for name in ("max_active_blocks", "resources"):
        monkeypatch.setattr(Target, name, lambda self, *args, _of=getattr(Target, name): _of(profile_target, *args))
    return Target(profile_target.facts, device_id=0)
