"""What the row families' candidate generators share (issue 43): a Candidate
(a plan worth timing, its label and how its grid follows rows) described by a
JSON-able dict for the tuning table (cupyops.tune), the structural check that
it can launch, the first candidate of each launch, the rows a table key
stands for, the lookup of a stored winner (the user's table for the live
GPU, then the table shipped for the target's profile) and what a tuner
reports (Tuned)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Optional

from .. import profile, tune
from ..launch import KernelLaunch, Target

# How long the tuners time each candidate (cupyops.bench.Timer's budget).
TIMER_BUDGET_S = 0.15


@dataclass(frozen=True)
class Candidate:
    """A plan worth timing: its label, its launch and how its grid follows rows
    (a family's grid kinds; the family rebuilds it for other rows)."""
    label: str
    launch: KernelLaunch
    grid: str
    # a family's subclass names its spec's type, its launch_for(spec, rows, smem, grid, target)
    # and its grid kinds
    spec_type = None
    launch_for = None
    grids = ()

    @classmethod
    def rebuilding(cls, label: str, launch: KernelLaunch, rows: int, target: Target) -> "Candidate":
        """`launch` (a policy's plan) as a candidate, with the first grid kind
        that rebuilds it over `rows`."""
        for grid in cls.grids:
            if cls.launch_for(launch.spec, rows, launch.smem_bytes, grid, target) == launch:
                return cls(label, launch, grid)
        raise AssertionError(f"no grid kind rebuilds {label}'s plan {launch}")

    @classmethod
    def from_description(cls, description: dict, rows: int, target: Target) -> "Candidate":
        """The candidate `describe` gave, its grid made for `rows` on `target`."""
        spec, grid = cls.spec_type(**description["spec"]), description["grid"]
        return cls(description["label"], cls.launch_for(spec, rows, description["smem"], grid, target), grid)

    def describe(self) -> dict:
        """The JSON-able dict the tuning table keeps."""
        return {"label": self.label, "grid": self.grid, "smem": self.launch.smem_bytes,
                "spec": asdict(self.launch.spec)}


@dataclass(frozen=True)
class FromTable:
    """Mixed in before a plan's class (a launch, a norm plan): the plan came from a
    tuning table, and explain()'s "source" says which (stored_winner)."""
    source: str = "tuned"

    def explain(self) -> dict:
        return {**super().explain(), "source": self.source}


@dataclass(frozen=True)
class TunedLaunch(FromTable, KernelLaunch):
    """A launch from a tuning table."""


def tuned_launch(launch: KernelLaunch, source: str) -> TunedLaunch:
    """`launch` as a plan from the table `source` names (stored_winner)."""
    return TunedLaunch(launch.spec, launch.block, launch.grid, launch.smem_bytes, source)


def rows_bucket(rows: int) -> int:
    """The rows of a table key: rows rounded up to a power of two (past a few
    waves rows change the grid, not the best plan)."""
    return 1 << (rows - 1).bit_length()


def can_launch(target: Target, launch: KernelLaunch) -> bool:
    """Whether the launch can run: threads, shared memory, a block an SM."""
    threads = launch.block[0] * launch.block[1] * launch.block[2]
    return (threads <= 1024 and launch.smem_bytes <= target.facts.smem_per_block_optin and
            target.max_active_blocks(launch.spec, threads, launch.smem_bytes, True) >= 1)


def is_rule(description: dict) -> bool:
    """Whether a stored winner is policy="auto"'s plan by the rules (the
    generators list it first, labelled "auto", and keep a launch's first label)."""
    return description["label"] == "auto"


def first_of_each_launch(found: list) -> list:
    """The candidates, each launch once (its first label: the policies come first)."""
    unique = {}
    for candidate in found:
        unique.setdefault(candidate.launch, candidate)
    return list(unique.values())


def stored_winner(op: str, shape_key: str, target: Target) -> Optional[dict]:
    """The stored winner for `op` and `shape_key` on `target`: the description
    from the user's tuning table for the live GPU (its name and CUDA version),
    with "source": "tuned", else from the table shipped for the target's
    profile (a live GPU or a profile target whose name names one), with
    "source": "shipped"; None where neither has it. Where neither has the key's
    rows but the tables measured the same shape at fewer rows and never at more,
    the winner at the most rows they measured serves it, if those fill a wave
    (past one, rows change the grid, not the best plan): its source then says
    those rows, e.g. "shipped (rows 16384)". Planners ask under policy="auto" only."""
    found = _stored_at(op, shape_key, target)
    if found is None:
        shape, rows = _split_rows(shape_key)
        most = _most_rows_measured(op, shape, target)
        # a row a warp on every SM: a wave
        if most is not None and rows > most >= target.facts.sm_count * target.facts.max_threads_per_sm // 32:
            found = _stored_at(op, shape.replace("|rows=*", f"|rows={most}"), target)
            if found is not None:
                found["source"] += f" (rows {most})"
    return found


def _stored_at(op: str, shape_key: str, target: Target) -> Optional[dict]:
    """The winner stored for exactly this key: the user's table, then the shipped one."""
    if target.device_id is not None:
        found = tune.default_table().lookup(tune.DeviceKey.live(target.device_id), op, shape_key)
        if found is not None:
            return {**found, "source": "tuned"}
    name = profile.matching_profile(target.facts.name)
    found = None if name is None else tune.shipped_winner(name, op, shape_key)
    return None if found is None else {**found, "source": "shipped"}


def _split_rows(key: str) -> tuple:
    """key -> (key with its rows field as "|rows=*", the rows; None where it has none)."""
    match = re.search(r"\|rows=(\d+)(?=\||$)", key)
    return (key, None) if match is None else (f"{key[:match.start()]}|rows=*{key[match.end():]}", int(match.group(1)))


def _most_rows_measured(op: str, shape: str, target: Target) -> Optional[int]:
    """The most rows either table measured `shape` (a key with "|rows=*") at, or None."""
    keys = []
    if target.device_id is not None:
        device = tune.DeviceKey.live(target.device_id)
        keys += [key.split("|", 2)[2] for key in tune.default_table().entries()
                 if key.startswith(f"{device.name}|cuda{device.cuda_version}|")]
    name = profile.matching_profile(target.facts.name)
    if name is not None:
        keys += list(tune.shipped(name))
    return max((rows for other, rows in map(_split_rows, keys) if other == f"{op}|{shape}"), default=None)


def recording_errors(errors: dict, time_us):
    """time_us(description) for tune.tune that records why a candidate drops
    out (the exception it raised) under its label in `errors`."""
    def timed(description: dict) -> float:
        try:
            return time_us(description)
        except Exception as error:
            errors[description["label"]] = f"{type(error).__name__}: {error}"
            raise
    return timed


@dataclass(frozen=True)
class Tuned:
    """What a tuner reports for one shape."""
    result: tune.Result     # timings of the candidates' descriptions, the fastest kept
    errors: dict            # label -> why a candidate dropped out (wrong results, no launch)
    shape_key: str
