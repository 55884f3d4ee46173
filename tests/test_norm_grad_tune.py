"""LayerNorm / RMSNorm backward's planning model (issue 43, SPEC §11): the
candidate generator (structural validity on the H100 and H200 profiles, the
policies' plans among the candidates, descriptions that rebuild them), the
planner reading the tuning table (a winner where it has one, the rule
otherwise; never under oneflow) and `cupyops tune layer_norm_backward` /
`rms_norm_backward` (its options and output: tests/test_norm_tune.py, the
live-target fixture too). CPU tests plan for the profiles (occupancy from
NVRTC); the GPU test tunes a small shape on the live GPU."""
from __future__ import annotations

import json

import pytest
from conftest import keep_winner
from test_norm_tune import DEVICE, H100, live_table, tuned_on_the_gpu  # noqa: F401  (live_table: a fixture)

from cupyops.launch import Target
from cupyops.ops import norm, norm_grad_tune
from cupyops.ops.norm_grad_candidates import Candidate, candidates, shape_key
from cupyops.ops.norm_spec import check_block_covers

H200 = Target.profile("h200")
# (op, dtype, cols, align, weight, param_grad): the warp path and register
# blocks, peeled rows off the 16-byte grid, dx alone, rows shared by a
# cluster without a weight, float64 without either
SHAPES = [("layer_norm_backward", "f16", 1024, 16, True, True), ("rms_norm_backward", "bf16", 3001, 2, True, True),
          ("layer_norm_backward", "f32", 8192, 16, True, False), ("rms_norm_backward", "f16", 32768, 16, False, True),
          ("layer_norm_backward", "f64", 777, 8, False, False)]


def _launches(chosen) -> tuple:
    return chosen.launches + (chosen.num_parts, chosen.rows_per_chunk)


@pytest.mark.parametrize("target", [H100, H200], ids=["h100", "h200"])
@pytest.mark.parametrize("op, dtype, cols, align, weight, param_grad", SHAPES)
def test_candidates_are_valid_and_hold_both_policies(target, op, dtype, cols, align, weight, param_grad):
    flags = dict(weight=weight, param_grad=param_grad)
    found = candidates(op, dtype, 49152, cols, target, align, **flags)
    launches = [c.launch for c in found]
    assert len(set(launches)) == len(launches) > 2
    assert [c.label for c in found[:2]] == ["auto", "oneflow"]
    plans = [_launches(c.plan(49152, cols, param_grad, target)) for c in found]
    for policy in ("auto", "oneflow"):
        assert _launches(norm.plan(op, 49152, cols, dtype, policy, target, align, **flags)) in plans
    for candidate in found:
        launch = candidate.launch
        threads = launch.block[0] * launch.block[1] * launch.block[2]
        assert threads <= 1024 and launch.smem_bytes <= target.facts.smem_per_block_optin
        assert target.max_active_blocks(launch.spec, threads, launch.smem_bytes, True) >= 1
        assert (launch.spec.op, launch.spec.dtype, launch.spec.weight) == \
            (op.replace("_backward", "_grad"), dtype, weight)
        assert launch.spec.fuse_param_grad <= param_grad
        if launch.spec.impl in ("warp", "block_regs"):
            assert target.resources(launch.spec)["local_bytes"] == 0
        check_block_covers(launch.spec, cols)
        description = json.loads(json.dumps(candidate.describe()))
        assert Candidate.from_description(description, 49152, target) == candidate
        # any rows of the key's bucket: a plan that launches and writes partials exactly when wanted
        rebuilt = Candidate.from_description(description, 40000, target).plan(40000, cols, param_grad, target)
        norm._check_grad_plan(rebuilt, param_grad)


def test_param_grad_adds_fused_and_column_reduction_plans():
    fused = candidates("layer_norm_backward", "f16", 49152, 1024, H100)
    alone = candidates("layer_norm_backward", "f16", 49152, 1024, H100, param_grad=False)
    assert any(c.launch.spec.fuse_param_grad for c in fused)
    assert not any(c.launch.spec.fuse_param_grad for c in alone)
    unfused = [c for c in fused if not c.launch.spec.fuse_param_grad]
    assert unfused and all(c.plan(49152, 1024, True, H100).param_grad is not None for c in unfused)


def test_shape_key_has_the_weight_and_param_grad_flags():
    assert shape_key("f16", 49152, 1024) == "f16|cols=1024|rows=65536|align=16|phase=1|weight=1|param_grad=1"
    assert shape_key("f16", 65536, 1024) == shape_key("f16", 32769, 1024)
    assert shape_key("f32", 7, 1001, 4, False, weight=False, param_grad=False) == \
        "f32|cols=1001|rows=8|align=4|phase=0|weight=0|param_grad=0"


def _keep(table, op, dtype, rows, cols, label, **flags):
    """Stores the candidate `label` of the shape as the table's winner."""
    found = [c.describe() for c in candidates(op, dtype, rows, cols, H100, **flags)]
    return keep_winner(table, DEVICE, op, shape_key(dtype, rows, cols, **flags), found, label)


@pytest.mark.parametrize("rows", [49152, 40000])   # the same power of two: the grid follows rows
@pytest.mark.parametrize("label", ["regs b128 k1 cached regs", "regs b128 k1 cached"])   # fused, unfused
def test_planner_takes_the_tables_winner(live_table, rows, label):
    table, live = live_table
    op = "layer_norm_backward"
    winner = _keep(table, op, "f16", 49152, 1024, label)
    chosen = norm.plan(op, rows, 1024, "f16", "auto", live)
    assert chosen.explain()["source"] == "tuned"
    expected = Candidate.from_description(winner, rows, H100).plan(rows, 1024, True, H100)
    assert _launches(chosen) == _launches(expected)
    norm._check_grad_plan(chosen, True)
    for other in (dict(param_grad=False), dict(weight=False), dict(align=8), dict(cols=512)):   # other keys: the rule
        cols = other.pop("cols", 1024)
        chosen = norm.plan(op, rows, cols, "f16", "auto", live, **other)
        assert "source" not in chosen.explain()
        assert chosen == norm.plan(op, rows, cols, "f16", "auto", H100, **other)
    assert norm.plan(op, 49152, 1024, "f16", "auto", H100).main == \
        candidates(op, "f16", 49152, 1024, H100)[0].launch     # a profile: the rule


def test_oneflow_ignores_the_table(live_table):
    table, live = live_table
    winner = _keep(table, "rms_norm_backward", "f16", 49152, 4096, "uncached b512", param_grad=False)
    chosen = norm.plan("rms_norm_backward", 49152, 4096, "f16", "auto", live, param_grad=False)
    assert chosen.main == Candidate.from_description(winner, 49152, H100).launch
    assert chosen.explain()["source"] == "tuned" and chosen.finish is None
    assert norm.plan("rms_norm_backward", 49152, 4096, "f16", "oneflow", live, param_grad=False) == \
        norm.plan("rms_norm_backward", 49152, 4096, "f16", "oneflow", H100, param_grad=False)


# -- on the GPU ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer_norm_backward", "rms_norm_backward"])
def test_tuning_writes_the_winner_and_calls_run_it(monkeypatch, tmp_path, op):
    tuned_on_the_gpu(monkeypatch, tmp_path, op, shape_key("f16", 4096, 1024), Candidate)
    inputs = norm_grad_tune.sample_grad_inputs(op, "f16", 4096, 1024)
    dy, x, weight, mean, rstd = (inputs[name] for name in ("dy", "x", "weight", "mean", "rstd"))
    expected = norm_grad_tune.grad_reference(op, dy, x, mean, rstd, weight, True)
    if op == "layer_norm_backward":
        got = dict(zip(("dx", "dweight", "dbias"), norm.layer_norm_backward(dy, x, mean, rstd, weight)))
    else:
        got = dict(zip(("dx", "dweight"), norm.rms_norm_backward(dy, x, rstd, weight)))
    for name, expect in expected.items():
        output = got[name][:norm_grad_tune.CHECKED_ROWS] if name == "dx" else got[name]
        norm_grad_tune.check_close(name, output, expect, "f16")
