"""Measured tuning, shared by every op family (SPEC §11).

An op hands the tuner its candidate plans for one shape (JSON-able dicts from
the op's generator) and a callable timing one of them on the live GPU; the
tuner times each, keeps the fastest in a JSON table beside CuPy's kernel cache
and answers later lookups from it. Keys: device name, CUDA version, op, shape.
The tuner knows nothing of any op: candidates and shape keys are opaque to it.
"""
from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

TABLE_NAME = "cupyops_tuning.json"
# Measured tuning on an op's first use where a plan is not in the table yet;
# "0" turns it off (plans then come from the op's default rule).
AUTOTUNE_ENV = "CUPYOPS_AUTOTUNE"


def cache_dir() -> Path:
    """CuPy's kernel cache folder (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    return Path(os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")))


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1") != "0"


@dataclass(frozen=True)
class DeviceKey:
    """What a measurement holds for: the device's name and the CUDA runtime version."""
    name: str
    cuda_version: int

    @classmethod
    def live(cls, device_id: int) -> "DeviceKey":
        import cupy

        from .device import live_facts

        return cls(live_facts(device_id).name, cupy.cuda.runtime.runtimeGetVersion())


@dataclass(frozen=True)
class Result:
    best: dict                 # the fastest candidate
    best_us: float
    timings: list              # (candidate, microseconds or None where it failed), in order


class TuningTable:
    """Winners by (device, CUDA version, op, shape key), in one JSON file."""

    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path is not None else cache_dir() / TABLE_NAME
        self._lock = threading.Lock()
        self._entries: Optional[dict] = None

    @staticmethod
    def key(device: DeviceKey, op: str, shape_key: str) -> str:
        return f"{device.name}|cuda{device.cuda_version}|{op}|{shape_key}"

    def _load(self) -> dict:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (FileNotFoundError, ValueError):
                self._entries = {}
        return self._entries

    def lookup(self, device: DeviceKey, op: str, shape_key: str) -> Optional[dict]:
        """The tuned candidate for this shape on this device, or None."""
        with self._lock:
            entry = self._load().get(self.key(device, op, shape_key))
        return None if entry is None else entry["best"]

    def store(self, device: DeviceKey, op: str, shape_key: str, result: Result) -> None:
        """Keeps `result`, merged into the file as it is now (another process may have written it)."""
        with self._lock:
            self._entries = None
            entries = self._load()
            entries[self.key(device, op, shape_key)] = {
                "best": result.best, "us": result.best_us, "candidates": len(result.timings)}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(entries, indent=1, sort_keys=True))
            scratch.replace(self.path)


def measure(candidates: list, time_us: Callable[[dict], float]) -> Result:
    """Times every candidate with `time_us` (a candidate that raises is skipped);
    the fastest wins, the first listed among equals."""
    if not candidates:
        raise ValueError("nothing to tune: no candidates")
    timings = []
    for candidate in candidates:
        try:
            us = float(time_us(candidate))
        except Exception:   # a candidate that cannot launch here drops out
            us = None
        timings.append((candidate, us))
    measured = [(us, index) for index, (_, us) in enumerate(timings) if us is not None and math.isfinite(us)]
    if not measured:
        raise RuntimeError(f"every one of {len(candidates)} candidates failed to run")
    best_us, index = min(measured)
    return Result(timings[index][0], best_us, timings)


def tune(table: TuningTable, device: DeviceKey, op: str, shape_key: str, candidates: list,
         time_us: Callable[[dict], float]) -> Result:
    """Measures the candidates and keeps the winner in `table`."""
    result = measure(candidates, time_us)
    table.store(device, op, shape_key, result)
    return result


_default_table: Optional[TuningTable] = None


def default_table() -> TuningTable:
    """The table beside CuPy's kernel cache (its folder read once per process)."""
    global _default_table
    if _default_table is None:
        _default_table = TuningTable()
    return _default_table
