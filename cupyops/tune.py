"""Measured tuning, shared by every op family (SPEC §11).

An op hands the tuner its candidate plans for one shape (JSON-able dicts from
the op's generator) and a callable timing one of them on the live GPU; the
tuner times each, keeps the fastest in a JSON table beside CuPy's kernel cache
and answers later lookups from it. Keys: device name, CUDA version, op, shape.
The tuner knows nothing of any op: candidates and shape keys are opaque to it.

Tables measured on the lent GPUs ship inside the package, one per device
profile (cupyops/profiles/tuned_<profile>.json, keyed by op and shape):
`ship` copies a user's table's winners measured on GPUs of a profile into it
and `shipped_winner` reads it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .profile import PROFILE_DIR, PROFILE_NAMES, matching_profile

TABLE_NAME = "cupyops_tuning.json"
# Measured tuning on an op's first use where a plan is not in the table yet;
# "0" turns it off (plans then come from the op's default rule).
AUTOTUNE_ENV = "CUPYOPS_AUTOTUNE"
# The note heading each shipped table.
SHIPPED_ABOUT = ("Plans tuned on GPUs of this profile that differ from the default rule's, read by policy='auto' "
                 "after the user's own table (cupyops.tune.shipped_winner). Keys: op|shape key; each entry: the "
                 "winning candidate's description ('best'), its microseconds and the GPU | CUDA version it was "
                 "measured on. Written by `cupyops tune ship --profile NAME`; do not edit by hand.")


# Screening (measure's screen_us): the candidates timed again in full, those within this
# factor of the fastest screened, and at least this many.
SCREEN_WITHIN = 1.10
SCREEN_KEEP = 4
# Near-equals: the finalists within this factor of the fastest, at most TIE_MOST of them
# (the fastest), are timed twice more (in reverse order, then in order) and keep the median
# of their three times, so that one noisy timing does not decide between plans a few
# percent apart.
TIE_WITHIN = 1.03
TIE_MOST = 4
TIE_TIMINGS = 3


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

    def entries(self) -> dict:
        """Every entry, by key (a copy)."""
        with self._lock:
            return dict(self._load())

    def _load(self) -> dict:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (FileNotFoundError, ValueError):
                self._entries = {}
        return self._entries

    def lookup(self, device: DeviceKey, op: str, shape_key: str, space: Optional[str] = None) -> Optional[dict]:
        """The tuned candidate for this shape on this device, or None; with `space` (space_of
        the candidates the op offers now), None too where the winner was tuned among others."""
        with self._lock:
            entry = self._load().get(self.key(device, op, shape_key))
        if entry is None or (space is not None and entry.get("space") != space):
            return None
        return entry["best"]

    def store(self, device: DeviceKey, op: str, shape_key: str, result: Result) -> None:
        """Keeps `result`, merged into the file as it is now (another process may have written it)."""
        with self._lock:
            self._entries = None
            entries = self._load()
            entries[self.key(device, op, shape_key)] = {
                "best": result.best, "us": result.best_us, "candidates": len(result.timings),
                "space": space_of([candidate for candidate, _ in result.timings])}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(entries, indent=1, sort_keys=True))
            scratch.replace(self.path)


def space_of(candidates: list) -> str:
    """A digest of a list of candidates (JSON-able dicts, in order), kept beside each winner:
    a winner an older cupyops tuned among other candidates is told apart (lookup's `space`)."""
    return hashlib.sha256(json.dumps(candidates, sort_keys=True).encode()).hexdigest()[:16]


def _timed(candidate: dict, time_us: Callable[[dict], float]) -> Optional[float]:
    """time_us(candidate), or None where it raised (a candidate that cannot launch here) or
    gave no finite time."""
    try:
        us = float(time_us(candidate))
    except Exception:
        return None
    return us if math.isfinite(us) else None


def measure(candidates: list, time_us: Callable[[dict], float],
            screen_us: Optional[Callable[[dict], float]] = None) -> Result:
    """Times every candidate with `time_us` (a candidate that raises is skipped); the
    fastest wins, the first listed among equals. With `screen_us` (a quicker, noisier
    timing), every candidate is screened first and only those within SCREEN_WITHIN of the
    fastest screened, and at least SCREEN_KEEP, are timed with `time_us`; the others keep
    their screened times. Those timed within TIE_WITHIN of the fastest (the TIE_MOST
    fastest of them) are timed again (TIE_TIMINGS in all) and keep their median."""
    if not candidates:
        raise ValueError("nothing to tune: no candidates")
    timings = [(candidate, _timed(candidate, screen_us or time_us)) for candidate in candidates]
    finalists = range(len(candidates))
    if screen_us is not None:
        ranked = sorted((us, index) for index, (_, us) in enumerate(timings) if us is not None)
        finalists = [index for rank, (us, index) in enumerate(ranked)
                     if rank < SCREEN_KEEP or us <= ranked[0][0] * SCREEN_WITHIN]
        for index in finalists:
            timings[index] = (candidates[index], _timed(candidates[index], time_us))
    measured = [(timings[index][1], index) for index in finalists if timings[index][1] is not None]
    if not measured:
        raise RuntimeError(f"every one of {len(candidates)} candidates failed to run")
    fastest = min(measured)[0]
    near = sorted(index for us, index in sorted(measured)[:TIE_MOST] if us <= fastest * TIE_WITHIN)
    if len(near) > 1:
        times = {index: [timings[index][1]] for index in near}
        for round_ in range(TIE_TIMINGS - 1):
            for index in (near[::-1] if round_ % 2 == 0 else near):
                us = _timed(candidates[index], time_us)
                if us is not None:
                    times[index].append(us)
        for index in near:
            timings[index] = (candidates[index], statistics.median(times[index]))
        measured = [(timings[index][1], index) for index in finalists if timings[index][1] is not None]
    best_us, index = min(measured)
    return Result(timings[index][0], best_us, timings)


def tune(table: TuningTable, device: DeviceKey, op: str, shape_key: str, candidates: list,
         time_us: Callable[[dict], float], screen_us: Optional[Callable[[dict], float]] = None) -> Result:
    """Measures the candidates (screened first where `screen_us` is given) and keeps the
    winner in `table`."""
    result = measure(candidates, time_us, screen_us)
    table.store(device, op, shape_key, result)
    return result


_default_table: Optional[TuningTable] = None


def default_table() -> TuningTable:
    """The table beside CuPy's kernel cache (its folder read once per process)."""
    global _default_table
    if _default_table is None:
        _default_table = TuningTable()
    return _default_table


# -- the tables shipped inside the package, one per device profile ------------

def shipped_path(profile: str) -> Path:
    """The shipped table of a device profile: cupyops/profiles/tuned_<profile>.json."""
    if profile not in PROFILE_NAMES:
        raise ValueError(f"unknown tuning profile {profile!r}; known: {', '.join(PROFILE_NAMES)}")
    return PROFILE_DIR / f"tuned_{profile}.json"


def read_shipped(path: Path, profile: str) -> dict:
    """The entries (op|shape key -> {"best", "us", "measured_on"}) of a shipped
    table file, checked: it names `profile` and every entry holds a winner."""
    document = json.loads(Path(path).read_text())
    if document.get("_profile") != profile or not isinstance(document.get("plans"), dict):
        raise ValueError(f"{path}: not a shipped table of profile {profile!r}")
    for key, entry in document["plans"].items():
        if key.count("|") < 1 or not isinstance(entry.get("best"), dict):
            raise ValueError(f"{path}: entry {key!r} is not 'op|shape key' -> {{'best': ...}}")
    return document["plans"]


@functools.lru_cache(maxsize=None)
def shipped(profile: str) -> dict:
    """The shipped table of `profile`, read once ({} where the package has none)."""
    path = shipped_path(profile)
    return read_shipped(path, profile) if path.exists() else {}


def shipped_winner(profile: str, op: str, shape_key: str) -> Optional[dict]:
    """The shipped table's winner for `op` and `shape_key` on `profile`, or None."""
    entry = shipped(profile).get(f"{op}|{shape_key}")
    return None if entry is None else entry["best"]


def ship(table: TuningTable, profile: str, keep: Callable[[str, dict], bool], path: Optional[Path] = None) -> dict:
    """Writes into the shipped table of `profile` (at `path`, default
    shipped_path) the winners of `table` measured on GPUs whose name names the
    profile, for which keep(op, best) holds; a shape measured there whose
    winner is not kept leaves the table, others already there stay. Where
    several GPUs or CUDA versions measured a shape, the fastest ships. The file
    is written with sorted keys, so a diff shows the plans that changed.
    Returns the entries written."""
    path = Path(path) if path is not None else shipped_path(profile)
    plans = read_shipped(path, profile) if path.exists() else {}
    fastest = {}    # op|shape key -> (op, the entry shipped)
    for key, entry in sorted(table.entries().items()):
        device_name, cuda, op, shape_key = key.split("|", 3)
        found = fastest.get(f"{op}|{shape_key}")
        if matching_profile(device_name) == profile and (found is None or entry["us"] < found[1]["us"]):
            fastest[f"{op}|{shape_key}"] = (op, {"best": entry["best"], "us": entry["us"],
                                                 "measured_on": f"{device_name}|{cuda}"})
    for key, (op, entry) in fastest.items():
        plans.pop(key, None)
        if keep(op, entry["best"]):
            plans[key] = entry
    document = {"_profile": profile, "_about": SHIPPED_ABOUT, "plans": plans}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    shipped.cache_clear()
    return dict(sorted(plans.items()))
