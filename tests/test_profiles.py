"""The device tuning profiles (cupyops/profiles/*.json, cupyops/profile.py): both
load with the same keys, every key is read by a planner, and the modules of
cupyops/ops keep few tuning constants of their own (issue 43: at most 20)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from cupyops import profile
from cupyops.device import PROFILES
from cupyops.launch import Target

OPS_DIR = Path(profile.__file__).resolve().parent / "ops"
# Every module of cupyops/ops: the planners whose measured values live in the profiles and the rest.
OPS_MODULES = tuple(sorted(path.stem for path in OPS_DIR.glob("*.py") if path.stem != "__init__"))
MAX_TUNING_CONSTANTS = 20
# Module-level constants that are structure, not tuning: the ops and their
# operands, OneFlow's own rules (policy="oneflow"), hardware limits and ladders
# (warp, 1024-thread block, 48 KB static shared memory, 32-byte sector, cp.async's
# smallest copy, the portable cluster sizes) and the kernels' fixed shapes.
STRUCTURAL = {
    "OPS", "INPUTS", "SUM_INPUTS", "STAGES", "TWO_LAUNCH_STAGES", "FORWARD_OPS", "BACKWARD_OPS",
    "PARAM_GRADS", "WEIGHT_SOURCES", "PARAM_GRAD_BLOCK", "WEIGHT_PHASES_BLOCK",
    "WARP_BLOCK_THREADS", "UNCACHED_BLOCK_SIZE", "ONEFLOW_MAX_COLS_PER_THREAD", "ONEFLOW_WARP_MAX_COLS",
    "ONEFLOW_GROUP_WIDTHS", "ONEFLOW_COLS_PER_THREAD", "ONEFLOW_SMEM_RULE",
    "THREAD_GROUP_WIDTHS", "AUTO_GROUP_WIDTHS", "AUTO_BLOCK_REGS_SIZES",
    "STATIC_SMEM_BYTES", "AXIS_MAX_BLOCK_X", "AXIS_MAX_BLOCK_THREADS", "AXIS_NARROW_ROW_BYTES",
    "AXIS_ASYNC_MIN_PACK_BYTES", "AXIS_CLUSTER_SIZES",
    # ops, policies and operand kinds, the expressions of named ops, C and parameter layouts
    "OP", "POLICIES", "APPROXIMATIONS", "_BIAS_GELU", "_GEGLU", "SOFTMAX_OP", "TUNED_OPS", "FUSED_IMPLS",
    "_NO_DROPOUT", "_NULL", "PYTHON_SCALARS", "OUT_KINDS", "BIAS_KINDS", "C_TYPES", "OPERAND_ACCESS", "_BINARY_C",
    "_COMPARE_C", "_CALLS", "FAST_FORMS", "SIXTEEN_BIT_FLOATS", "_INT_FIELDS", "_EPILOGUE_FIELDS", "PARAMS_DTYPE",
    "INSTRUCTIONS", "HALO_FIELDS",
    # kernel layouts, index limits and hardware limits (the copy engine's map ranges, registers, threads)
    "INTERLEAVE", "STEP_CHUNKS", "MAX_TAPS", "STEP_BYTES", "WGMMA", "WGMMA_ARCH", "WGMMA_ALIGN_SLACK",
    "EXCHANGE_BYTES", "SM_REGISTERS", "SM_MAX_THREADS", "SWIZZLE", "CORNER_RANGE", "MAX_OFFSET", "MAX_STRIDE",
    "PIXELS_A_ROW", "ROWS_TILE_MULTIPLE",
    "MAX_PACK_BYTES", "WIDE_ROWS", "MAX_LEADING_DIMS", "WGMMA_N", "SLOT_BYTES", "STAGE_ALIGN",
    "MAX_WARP_N",
    # OneFlow's and MegEngine's own rules (the reproduced policies)
    "ONEFLOW_BLOCK", "ONEFLOW_MAX_PACK", "MEGENGINE_LADDER",
    # fixed launch shapes of auxiliary kernels (the dropout mask, split-K's sum)
    "MASK_BLOCK_SIZE", "REDUCE_THREADS",
    # candidate spaces the measured tuners time, and their bounds (registers a thread may hold, splits)
    "AUTO_CONFIGS", "_WGMMA_64B", "_WGMMA_128B", "WGMMA_CONFIGS", "_TMA_FILTER", "_TMA_IM2COL", "_TMA_ROWS", "TMA_CONFIGS",
    "_TMA_FILTER_PAIRS", "_TMA_FILTER_K_PAIRS", "PAIR",
    "REGS_VARIANTS", "PACKED_BLOCK_SIZES", "PACKED_MAX_BYTES", "ASYNC_BLOCK_SIZES", "ASYNC_TAIL_PACKS", "GRIDS",
    "BLOCK_SIZES", "REGS_BLOCK_SIZES", "MOST_HELD_BYTES", "HOLDINGS", "CLUSTER_SIZE", "WARP_MOST_BYTES", "SMEM_BLOCK_SIZES",
    "UNCACHED_BLOCK_SIZES", "MAX_HELD_BYTES", "MAX_SPLITS", "MAX_TILE_N", "MAX_CONSUMERS", "MAX_STAGES",
    "PITCH_MULTIPLES",
    # the tuners' checks and the timers' and benchmarks' own method
    "CHECKED_ROWS", "TOLERANCE", "EPS", "TIMER_BUDGET_S", "CHUNK_ROWS", "PEAK_THREADS", "MMA_SYNC_CHAINS",
    "WGMMA_BATCH", "TARGET_SECONDS", "TIMED_RUNS", "MAPS_CACHED",
}


def _documents() -> dict:
    return {name: json.loads((profile.PROFILE_DIR / f"{name}.json").read_text()) for name in profile.PROFILE_NAMES}


def test_profiles_load_with_the_same_keys():
    documents = _documents()
    keys = {name: set(document["tuning"]) for name, document in documents.items()}
    assert keys["h100"] == keys["h200"] and keys["h100"]
    for name, document in documents.items():
        assert document["_measured_on"]
        assert set(document["notes"]) == keys[name], "every value has a note"
        loaded = profile.load(name)
        assert set(loaded.keys) == keys[name]
        assert all(getattr(loaded, key) is not None for key in loaded.keys)


def test_values_come_back_as_python_literals():
    tuned = profile.load("h200")
    assert isinstance(tuned.AUTO_PEELED_SMALL_BLOCKS, tuple)
    assert tuned.AUTO_WARP_ROWS_PER_ACCESS == {2: 1, 4: 1}
    assert tuned.AUTO_BLOCK_REGS_LARGEST == {"log_softmax": 512}
    assert tuned.AUTO_ASYNC_FIRST[("layer_norm", 4)] == (8192, "whole", ((512, 8, 2),))
    assert (4, 1) in tuned.COOP_PREFETCH


@pytest.mark.parametrize("device, expected", [("h100", "h100"), ("h200", "h200"), ("a100", "h200")])
def test_profile_for_picks_by_device_name(device, expected):
    facts = PROFILES[device]
    assert profile.profile_name(facts) == expected
    assert profile.profile_for(facts) is profile.load(expected)          # loaded once
    assert profile.profile_for(Target.profile(device).facts).name == expected


def test_unknown_profile_is_refused():
    with pytest.raises(ValueError):
        profile.load("v100")


def test_every_key_is_read_by_a_planner():
    sources = "\n".join((OPS_DIR / f"{module}.py").read_text() for module in OPS_MODULES)
    keys = profile.load(profile.DEFAULT_PROFILE).keys
    unread = [key for key in keys if not re.search(rf"\btuned\.{key}\b", sources)]
    assert unread == []


def _module_constants(module: str) -> list:
    tree = ast.parse((OPS_DIR / f"{module}.py").read_text())
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names += [target.id for target in targets
                  if isinstance(target, ast.Name) and target.id.lstrip("_")[:1].isupper()
                  and target.id.upper() == target.id]
    return names


def test_planners_keep_few_tuning_constants():
    tuning = {f"{module}.{name}" for module in OPS_MODULES for name in _module_constants(module)
              if name not in STRUCTURAL}
    assert len(tuning) <= MAX_TUNING_CONSTANTS, sorted(tuning)
    assert not STRUCTURAL & set(profile.load(profile.DEFAULT_PROFILE).keys)
    keys = set(profile.load(profile.DEFAULT_PROFILE).keys)
    # a value lives in one place: a profile key is not also a constant of the module that reads it
    for module in OPS_MODULES:
        source = (OPS_DIR / f"{module}.py").read_text()
        both = [name for name in _module_constants(module) if name in keys and f"tuned.{name}" in source]
        assert both == [], module
