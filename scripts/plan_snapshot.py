"""Records the plans the softmax and norm planners choose over a dense grid of
shapes on the H100 and H200 profiles, as JSON, to compare one version of the
planners against another (a refactor must leave the file byte-identical).

Each plan is recorded whole (every field of its dataclasses, its explain()
and its kernels' names) for softmax, log_softmax and their backward (the row
plan, and under auto the split-row plan; the axis kernel's plan over a
non-last axis), layer_norm and rms_norm with and without weight, bias and
residual and their backward with and without the weight and its gradients,
and both stages of fused_softmax for a few fusions: float16, bfloat16,
float32 and float64 (not for fused_softmax), both policies, rows of 1, 7,
49152 and 2**20, every column count to 16, then steps to 4096, every power
of two and its neighbours to 2**20 and the shapes the tuning notes name;
rows at 49152 also with their operands off the 16-byte grid, at one phase
and at several. Every kernel met is listed once with its fields and a hash
of its rendered source (the headers' fingerprint left out): the templates
must not change either.

Occupancy comes from NVRTC compiles (no GPU needed). --compile-cache keeps
their reports in a file keyed by each kernel's fields, so a second run
compiles nothing new; use it only while kernels/ and templates/ stay as they
were. --source runs the planners of another checkout (e.g. a `git worktree`
of an older commit): the script finds them where they lived before
cupyops/ops/softmax_rows.py and the norm planner modules were split out.

Usage (repository root):
    python scripts/plan_snapshot.py /tmp/plans.json --compile-cache /tmp/compiles.json
    python scripts/plan_snapshot.py /tmp/after.json --compare /tmp/plans.json
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import multiprocessing
import re
import sys
import time
from pathlib import Path

DEVICES = ("h100", "h200")
DTYPES = ("f16", "bf16", "f32", "f64")
POLICIES = ("oneflow", "auto")
ROWS = (1, 7, 49152, 1 << 20)
OFF_GRID_ROWS = 49152
SOFTMAX_OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")
NAMED_COLS = (1000, 1100, 1280, 1536, 2567, 3000, 3595, 4097, 6144, 10000, 12288, 12345, 14389, 16385,
              18246, 20000, 20001, 24576, 24577, 28001, 28672, 30001, 32767, 40000, 40001, 45056, 49151,
              55758, 57344, 60000, 98304, 110997, 116863, 300001, (1 << 20) + 7)
# The norms' flags: forward (weight, bias, residual), rms_norm's without bias;
# backward (weight, dweight / dbias wanted).
NORM_FORWARD_FLAGS = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
NORM_BACKWARD_FLAGS = ((False, True), (True, False), (True, True))
# Fusions of fused_softmax: (bias, mask, causal, dropout); bias "" or "x" (the input's dtype).
FUSIONS = (("", False, False, False), ("x", True, False, True), ("", False, True, False))
FUSED_DTYPES = ("f16", "bf16", "f32")
# softmax over a non-last axis: (outer, cols, inner) of each.
AXIS_OUTER = (1, 8, 64, 4096)
AXIS_COLS = (1, 2, 7, 32, 100, 128, 1000, 1024, 2048, 4096, 16384, 65536)
AXIS_INNER = (1, 31, 32, 33, 64, 100, 256, 257, 512, 4096)
ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}

# Where each planner lives: its place now first, then before the split.
PLANNERS = {
    "softmax_rows": ("cupyops.ops.softmax_rows", "cupyops.ops.softmax"),
    "softmax_split": ("cupyops.ops.softmax_split",),
    "softmax_axis": ("cupyops.ops.softmax_axis",),
    "norm": ("cupyops.ops.norm",),
    "fused_softmax": ("cupyops.ops.fused_softmax",),
}


def grid_cols() -> list:
    cols = set(range(1, 17)) | set(range(17, 4097, 97)) | set(NAMED_COLS)
    for bits in range(1, 21):
        cols |= {(1 << bits) - 1, 1 << bits, (1 << bits) + 1}
    return sorted(cols)


def planner(role: str):
    for name in PLANNERS[role]:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "plan"):
            return module
    raise ImportError(f"no planner for {role} in {PLANNERS[role]}")


def layouts(rows: int, cols: int, itemsize: int) -> list:
    """(key suffix, align, same_phase) of the operand layouts planned for:
    contiguous arrays from the allocator, and at OFF_GRID_ROWS rows off the
    16-byte grid at one phase and at several."""
    natural = min(16, (cols * itemsize) & -(cols * itemsize))
    found = [("", natural, True)]
    if rows == OFF_GRID_ROWS:
        if natural != itemsize:
            found.append((f"|align={itemsize}", itemsize, True))
        found.append((f"|align={itemsize}|phases", itemsize, False))
    return found


# -- recording ----------------------------------------------------------------

class Recorder:
    """Plans described as JSON values; every kernel spec met listed once by
    its name and a hash of its fields."""

    def __init__(self):
        self.plans: dict = {}
        self.specs: dict = {}
        self.spec_objects: dict = {}

    def describe(self, value):
        from cupyops import jit

        if isinstance(value, jit.KernelSpec):
            record = {"class": type(value).__name__, "name": value.name, "template": value.template,
                      "threads_per_block": value.threads_per_block,
                      **{f.name: self.describe(getattr(value, f.name)) for f in dataclasses.fields(value)}}
            # the name and a hash of the fields: two specs may share a name
            # (e.g. a float32 row cached packed or not: the same cache type)
            key = f"{value.name}@{hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]}"
            self.specs.setdefault(key, record)
            self.spec_objects.setdefault(key, value)
            return key
        if dataclasses.is_dataclass(value):
            return {"class": type(value).__name__,
                    **{f.name: self.describe(getattr(value, f.name)) for f in dataclasses.fields(value)}}
        if isinstance(value, (tuple, list)):
            return [self.describe(item) for item in value]
        return value

    def record(self, key: str, make) -> None:
        try:
            chosen = make()
        except Exception as error:   # a refusal is part of the planner's behaviour
            from cupyops import jit

            # compile errors name the headers' paths and ptxas's compile time
            message = f"{type(error).__name__}: {error}".replace(f"{jit.resource_dir('kernels').parent}/", "")
            self.plans[key] = {"error": re.sub(r"Compile time = [0-9.]+ ms", "Compile time = ... ms", message)}
            return
        self.plans[key] = None if chosen is None else {"plan": self.describe(chosen), "explain": chosen.explain()}


def softmax_task(dtype: str, targets: dict, cols_grid: list) -> Recorder:
    rows_planner, split = planner("softmax_rows"), planner("softmax_split")
    found = Recorder()
    for device, target in targets.items():
        for op in SOFTMAX_OPS:
            for rows in ROWS:
                for cols in cols_grid:
                    for suffix, align, phase in layouts(rows, cols, ITEMSIZE[dtype]):
                        head = f"{op}|{dtype}|{device}|{rows}x{cols}{suffix}"
                        for policy in POLICIES:
                            found.record(f"{head}|{policy}", lambda: rows_planner.plan(
                                op, rows, cols, dtype, policy, target, align, phase))
                        found.record(f"{head}|split", lambda: split.plan(op, rows, cols, dtype, target, align, phase))
    return found


def axis_task(dtype: str, targets: dict) -> Recorder:
    axis = planner("softmax_axis")
    found = Recorder()
    for device, target in targets.items():
        for op in SOFTMAX_OPS:
            for outer in AXIS_OUTER:
                for cols in AXIS_COLS:
                    for inner in AXIS_INNER:
                        for align in sorted({16, ITEMSIZE[dtype]}):
                            found.record(f"{op}_axis|{dtype}|{device}|{outer}x{cols}x{inner}|align={align}",
                                         lambda: axis.plan(op, outer, cols, inner, dtype, target, align))
    return found


def norm_flags(op: str) -> list:
    """(key, keyword flags) of the norm planner for op: forward (weight, bias,
    residual), backward (weight, dweight / dbias wanted)."""
    if op.endswith("_backward"):
        return [(f"w{int(w)}g{int(g)}", dict(weight=w, param_grad=g)) for w, g in NORM_BACKWARD_FLAGS]
    combos = NORM_FORWARD_FLAGS if op == "layer_norm" else {(w, False, r) for w, _, r in NORM_FORWARD_FLAGS}
    return [(f"w{int(w)}b{int(b)}r{int(r)}", dict(weight=w, bias=b, residual=r)) for w, b, r in sorted(combos)]


def norm_task(op: str, dtype: str, targets: dict, cols_grid: list) -> Recorder:
    norm = planner("norm")
    found = Recorder()
    for device, target in targets.items():
        for flag_key, flags in norm_flags(op):
            for rows in ROWS:
                for cols in cols_grid:
                    for suffix, align, phase in layouts(rows, cols, ITEMSIZE[dtype]):
                        for policy in POLICIES:
                            found.record(f"{op}|{dtype}|{device}|{flag_key}|{rows}x{cols}{suffix}|{policy}",
                                         lambda: norm.plan(op, rows, cols, dtype, policy, target, align,
                                                           same_phase=phase, **flags))
    return found


def fused_task(dtype: str, targets: dict, cols_grid: list) -> Recorder:
    fused = planner("fused_softmax")
    found = Recorder()
    for device, target in targets.items():
        for bias, mask, causal, dropout in FUSIONS:
            fusion = fused.Fusion(bias_dtype=dtype if bias else "", mask=mask, causal=causal, dropout=dropout)
            fusion_key = f"b{int(bool(bias))}m{int(mask)}c{int(causal)}d{int(dropout)}"
            for stage in fused.STAGES:
                for rows in ROWS:
                    for cols in cols_grid:
                        for suffix, align, phase in layouts(rows, cols, ITEMSIZE[dtype]):
                            for policy in POLICIES:
                                found.record(f"fused_{stage}|{dtype}|{device}|{fusion_key}|{rows}x{cols}{suffix}"
                                             f"|{policy}", lambda: fused.plan(stage, rows, cols, dtype, policy,
                                                                              target, fusion, align, phase))
    return found


# -- compile reports kept between runs ----------------------------------------

def use_compile_cache(entries: dict) -> dict:
    """Routes jit.compile_cubin through `entries` ({arch|spec repr: report
    fields}); returns the dict new reports are added to."""
    from cupyops import jit

    compile_cubin = jit.compile_cubin
    added: dict = {}

    def cached(spec, arch):
        key = f"{arch}|{spec!r}"
        fields = entries.get(key)
        if fields is None:
            report = compile_cubin(spec, arch)
            fields = entries[key] = added[key] = [report.registers, report.smem_bytes, report.spill_bytes,
                                                  report.stack_bytes, report.cubin_bytes]
        registers, smem, spill, stack, cubin = fields
        return jit.CompileReport(spec.name, arch, registers, smem, spill, stack, cubin, 0.0)

    jit.compile_cubin = cached
    return added


def source_hash(spec) -> str:
    """sha256 of spec's rendered source with the headers' fingerprint fixed."""
    from cupyops import jit

    fingerprint = jit.headers_fingerprint
    jit.headers_fingerprint = lambda: "0" * 16
    try:
        return hashlib.sha256(jit.render(spec).encode()).hexdigest()
    finally:
        jit.headers_fingerprint = fingerprint


def run_task(task: tuple) -> tuple:
    """One worker's share: (plans, kernels with their source hashes, new compile reports)."""
    kind, args, cache = task
    from cupyops.launch import Target

    added = use_compile_cache(cache)
    targets = {device: Target.profile(device) for device in DEVICES}
    if kind == "softmax":
        found = softmax_task(*args, targets, grid_cols())
    elif kind == "axis":
        found = axis_task(*args, targets)
    elif kind == "norm":
        found = norm_task(*args, targets, grid_cols())
    else:
        found = fused_task(*args, targets, grid_cols())
    specs = {key: {**record, "source_sha256": source_hash(found.spec_objects[key])}
             for key, record in found.specs.items()}
    return found.plans, specs, added


def tasks() -> list:
    """(kind, arguments) of every worker's share, the slowest first."""
    found = [("norm", (op, dtype)) for op in ("layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward")
             for dtype in DTYPES]
    found += [("fused", (dtype,)) for dtype in FUSED_DTYPES]
    found += [("softmax", (dtype,)) for dtype in DTYPES] + [("axis", (dtype,)) for dtype in DTYPES]
    return found


def snapshot(jobs: int, cache: dict, compile_cache) -> tuple:
    """({"plans": ..., "kernels": ...}, compile reports added); the reports
    are written to the file compile_cache (None: not kept) as they come."""
    for role in PLANNERS:   # imported before the workers fork: they plan with these modules
        planner(role)
    plans, kernels, added = {}, {}, {}
    work = [(kind, args, cache) for kind, args in tasks()]
    with multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        for task_plans, task_specs, task_added in pool.imap_unordered(run_task, work):
            plans.update(task_plans)
            added.update(task_added)
            kernels.update(task_specs)
            if compile_cache is not None and task_added:   # kept as it grows: an interrupted run loses little
                compile_cache.write_text(json.dumps({**cache, **added}, sort_keys=True))
    return {"plans": plans, "kernels": kernels}, added


def compare(found: dict, before: dict) -> int:
    """Prints what differs from `before`; the number of differences."""
    differences = 0
    for section in ("plans", "kernels"):
        old, new = before[section], found[section]
        for key in sorted(old.keys() | new.keys()):
            if old.get(key, "absent") != new.get(key, "absent"):
                differences += 1
                if differences <= 20:
                    print(f"{section} {key}:\n  before {old.get(key, 'absent')}\n  after  {new.get(key, 'absent')}")
        print(f"{section}: {len(new)} compared against {len(old)}")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON file written")
    parser.add_argument("--compare", type=Path, help="an earlier snapshot: exit 1 where this one differs")
    parser.add_argument("--compile-cache", type=Path, help="compile reports kept between runs")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout whose planners to record (default: this script's)")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    options = parser.parse_args()
    sys.path.insert(0, str(options.source.resolve()))
    cache = {}
    if options.compile_cache is not None and options.compile_cache.exists():
        cache = json.loads(options.compile_cache.read_text())
    began = time.perf_counter()
    found, added = snapshot(options.jobs, cache, options.compile_cache)
    options.out.write_text(json.dumps(found, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"{len(found['plans'])} plans, {len(found['kernels'])} kernels, {len(added)} compiled, "
          f"{time.perf_counter() - began:.0f} s -> {options.out}")
    if options.compare is not None:
        differences = compare(found, json.loads(options.compare.read_text()))
        print(f"{differences} differences")
        return 1 if differences else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
