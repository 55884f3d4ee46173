"""Measured tuning values of the planners, one JSON file per device.

The planners in cupyops/ops/ (the row-wise softmax_rows, softmax_split,
softmax_axis, norm_forward, norm_backward, row_packs; elementwise;
fused_softmax; conv2d_int8) keep their structural constants in Python (warp
size, shared memory limits, OneFlow's own rules, block-size ladders) and read
the thresholds and tables chosen by measurement from the profile of the
device they plan for: ``profile_for(target.facts).NAME``.

The files live in cupyops/profiles/ (package data): ``h100.json`` and
``h200.json``, each with a ``"tuning"`` object (name -> value), a ``"notes"``
object (name -> one sentence on what the value is) and ``"_measured_on"``.
A device is matched by its name (DeviceFacts.name, live or built-in); any
other device takes DEFAULT_PROFILE. JSON lists come back as tuples, and the
keys of nested objects written "a,b" as tuples (parts of digits as ints),
keys of digits alone as ints, so the values equal the Python literals they
replaced.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Optional

from .device import DeviceFacts

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PROFILE_NAMES = ("h100", "h200")
DEFAULT_PROFILE = "h200"


class Profile:
    """One device's tuning values, as attributes (``profile.AUTO_SMEM_BLOCK_SIZE``)."""

    def __init__(self, name: str, measured_on: str, values: dict, notes: dict):
        self.name = name
        self.measured_on = measured_on
        self.notes = notes
        self.keys = tuple(values)
        for key, value in values.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"Profile({self.name!r}, {len(self.keys)} values)"


def _key(text: str):
    parts = tuple(int(part) if part.isdigit() else part for part in text.split(","))
    return parts if len(parts) > 1 else parts[0]


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return {_key(key): _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_decode(item) for item in value)
    return value


@functools.lru_cache(maxsize=None)
def load(name: str) -> Profile:
    """The profile cupyops/profiles/<name>.json, read once."""
    if name not in PROFILE_NAMES:
        raise ValueError(f"unknown tuning profile {name!r}; known: {', '.join(PROFILE_NAMES)}")
    document = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    return Profile(name, document["_measured_on"], _decode(document["tuning"]), document["notes"])


def matching_profile(device_name: str) -> Optional[str]:
    """The first of PROFILE_NAMES the device's name contains, or None."""
    device_name = device_name.lower()
    return next((name for name in PROFILE_NAMES if name in device_name), None)


def profile_name(facts: DeviceFacts) -> str:
    """The profile a device takes: the first of PROFILE_NAMES its name contains, else DEFAULT_PROFILE."""
    return matching_profile(facts.name) or DEFAULT_PROFILE


@functools.lru_cache(maxsize=None)
def profile_for(facts: DeviceFacts) -> Profile:
    """The tuning profile of the device `facts` describes."""
    return load(profile_name(facts))


def profiles() -> tuple:
    """Every shipped profile (for tests that patch a value on all of them)."""
    return tuple(load(name) for name in PROFILE_NAMES)
