"""LayerNorm / RMSNorm forward's planning model (issue 43, SPEC §11): the
candidate generator (structural validity, the policies' plans among the
candidates, descriptions that rebuild them), the planner reading the tuning
table (a winner where it has one, the rule otherwise; never under oneflow)
and `cupyops tune layer_norm` / `rms_norm` (and the options and output of
their backward's, tests/test_norm_grad_tune.py). CPU tests plan for the H100
profile (occupancy from NVRTC); the GPU test tunes a small shape on the live
GPU."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import keep_winner, stand_in_live

from cupyops import tune
from cupyops.cli.main import main
from cupyops.launch import Target
from cupyops.ops import norm, norm_grad_tune, norm_tune
from cupyops.ops.norm_candidates import Candidate, candidates, shape_key
from cupyops.ops.row_candidates import Tuned

H100 = Target.profile("h100")
DEVICE = tune.DeviceKey("NVIDIA H100 80GB HBM3", 12080)
# (op, dtype, cols, align, residual): warp-path rows, peeled rows off the
# 16-byte grid, rows for the shared-memory and cp.async paths, a residual
SHAPES = [("layer_norm", "f16", 1024, 16, False), ("rms_norm", "bf16", 12345, 2, False),
          ("layer_norm", "f32", 8192, 16, False), ("rms_norm", "f16", 4096, 16, True)]


@pytest.mark.parametrize("op, dtype, cols, align, residual", SHAPES)
def test_candidates_are_valid_and_hold_both_policies(op, dtype, cols, align, residual):
    found = candidates(op, dtype, 49152, cols, H100, align, residual=residual)
    launches = [c.launch for c in found]
    assert len(set(launches)) == len(launches) > 2
    assert found[0].label == "auto"
    for policy in ("auto", "oneflow"):
        assert norm.plan(op, 49152, cols, dtype, policy, H100, align, residual=residual).main in launches
    for candidate in found:
        launch = candidate.launch
        threads = launch.block[0] * launch.block[1] * launch.block[2]
        assert threads <= 1024 and launch.smem_bytes <= H100.facts.smem_per_block_optin
        assert H100.max_active_blocks(launch.spec, threads, launch.smem_bytes, True) >= 1
        assert (launch.spec.op, launch.spec.dtype, launch.spec.residual) == (op, dtype, residual)
        description = json.loads(json.dumps(candidate.describe()))
        assert Candidate.from_description(description, 49152, H100) == candidate


def test_shape_key_has_the_kernels_flags():
    assert shape_key("f16", 49152, 1024) == \
        "f16|cols=1024|rows=65536|align=16|phase=1|weight=1|bias=1|residual=0"
    assert shape_key("f16", 65536, 1024) == shape_key("f16", 32769, 1024)
    assert shape_key("f32", 7, 1001, 4, False, weight=False, bias=False, residual=True) == \
        "f32|cols=1001|rows=8|align=4|phase=0|weight=0|bias=0|residual=1"


@pytest.fixture
def live_table(monkeypatch, tmp_path):
    """A tuning table in tmp_path, the device key fixed, and a stand-in live
    target (the H100 profile's facts with a device id, occupancy and
    resources from NVRTC as the profile's)."""
    table = tune.TuningTable(tmp_path / "tuning.json")
    return table, stand_in_live(monkeypatch, table, H100, DEVICE)


def _keep(table, op, dtype, rows, cols, label):
    """Stores the candidate `label` of the shape (weight, bias for LayerNorm) as the table's winner."""
    found = [c.describe() for c in candidates(op, dtype, rows, cols, H100)]
    return keep_winner(table, DEVICE, op, shape_key(dtype, rows, cols, bias=op == "layer_norm"), found, label)


@pytest.mark.parametrize("rows", [49152, 40000])   # the same power of two: the grid follows rows
def test_planner_takes_the_tables_winner(live_table, rows):
    table, live = live_table
    winner = _keep(table, "layer_norm", "f16", 49152, 1024, "regs b128 k1 packed")
    chosen = norm.plan("layer_norm", rows, 1024, "f16", "auto", live)
    assert chosen.explain()["source"] == "tuned"
    assert chosen.main == Candidate.from_description(winner, rows, H100).launch
    for other in (dict(residual=True), dict(bias=False), dict(align=8), dict(cols=512)):   # other keys: the rule
        cols = other.pop("cols", 1024)
        chosen = norm.plan("layer_norm", rows, cols, "f16", "auto", live, **other)
        assert "source" not in chosen.explain()
        assert chosen.main == norm.plan("layer_norm", rows, cols, "f16", "auto", H100, **other).main
    assert norm.plan("layer_norm", 49152, 1024, "f16", "auto", H100).main == \
        candidates("layer_norm", "f16", 49152, 1024, H100)[0].launch     # a profile: the rule


def test_oneflow_ignores_the_table(live_table):
    table, live = live_table
    winner = _keep(table, "rms_norm", "f16", 49152, 4096, "smem b256")
    assert norm.plan("rms_norm", 49152, 4096, "f16", "auto", live, bias=False).main == \
        Candidate.from_description(winner, 49152, H100).launch
    assert norm.plan("rms_norm", 49152, 4096, "f16", "oneflow", live) == \
        norm.plan("rms_norm", 49152, 4096, "f16", "oneflow", H100)


def run(*args):
    return CliRunner().invoke(main, list(args))


# the tune commands' flag of each op: forward a residual, backward dx alone
FLAGS = {"layer_norm": "--residual", "rms_norm": "--residual", "layer_norm_backward": "--no-param-grad",
         "rms_norm_backward": "--no-param-grad"}


@pytest.mark.parametrize("op", FLAGS)
def test_tune_norm_cli_help_and_refusals(op):
    result = run("tune", op, "--help")
    assert result.exit_code == 0 and FLAGS[op] in result.output and "--cols" in result.output
    for args, message in ((("--cols", "0"), "cols must be positive"), (("--rows", "0"), "rows must be positive"),
                          (("--dtype", "int8"), "int8")):
        result = run("tune", op, *args)
        assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("op, tuner, key, flag_value", [
    ("rms_norm", norm_tune, "f16|cols=1024|rows=65536|align=16|phase=1|weight=1|bias=0|residual=1", True),
    ("rms_norm_backward", norm_grad_tune, "f16|cols=1024|rows=65536|align=16|phase=1|weight=1|param_grad=0", False)])
def test_tune_norm_cli_prints_every_candidate_and_marks_the_winner(monkeypatch, op, tuner, key, flag_value):
    from cupyops.cli import tune_norm as command

    timings = [({"label": "auto"}, 12.0), ({"label": "warp c32 g32"}, None), ({"label": "regs b128 k1"}, 10.0)]
    tuned = Tuned(tune.Result(timings[2][0], 10.0, timings), {"warp c32 g32": "ValueError: wrong"}, key)
    seen = []
    monkeypatch.setattr(command, "live_device", lambda message: 0)
    monkeypatch.setattr(tuner, "tune_shape", lambda *args: seen.append(args) or tuned)
    result = run("tune", op, "--cols", "1024", FLAGS[op])
    assert result.exit_code == 0, result.output
    assert seen[0][:6] == (op, "f16", 49152, 1024, 0, flag_value)
    lines = result.output.splitlines()
    assert any(line.lstrip().startswith("* regs b128 k1") and "GB/s" in line for line in lines)
    assert any("warp c32 g32" in line and "ValueError: wrong" in line for line in lines)
    assert f"kept 'regs b128 k1' under {key}" in result.output


# -- on the GPU ------------------------------------------------------------------

def tuned_on_the_gpu(monkeypatch, tmp_path, op: str, key: str, candidate_type) -> None:
    """Runs `cupyops tune OP` over 4096 x 1024 float16 into a table in tmp_path
    (whole calls not memoised) and checks that the winner is kept under `key`
    and that norm.plan under auto takes it on the live GPU."""
    import cupy

    from cupyops.callcache import CallCache

    table = tune.TuningTable(tmp_path / "tuning.json")
    monkeypatch.setattr(tune, "default_table", lambda: table)
    monkeypatch.setattr(norm, "_calls", CallCache())
    result = run("tune", op, "--dtype", "float16", "--cols", "1024", "--rows", "4096")
    assert result.exit_code == 0, result.output
    device_id = cupy.cuda.runtime.getDevice()
    live = Target.live(device_id)
    best = table.lookup(tune.DeviceKey.live(device_id), op, key)
    assert best is not None and f"* {best['label']}" in result.output
    chosen = norm.plan(op, 4096, 1024, "f16", "auto", live)
    assert chosen.explain()["source"] == "tuned"
    assert chosen.spec == candidate_type.from_description(best, 4096, live).launch.spec


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_tuning_writes_the_winner_and_calls_run_it(monkeypatch, tmp_path, op):
    bias = op == "layer_norm"
    tuned_on_the_gpu(monkeypatch, tmp_path, op, shape_key("f16", 4096, 1024, bias=bias), Candidate)
    inputs = norm_tune.sample_inputs(op, "f16", 4096, 1024, False)
    expected = norm_tune.reference(op, inputs["x"], inputs["weight"], inputs["bias"])
    call = norm.layer_norm(inputs["x"], inputs["weight"], inputs["bias"]) if bias else \
        norm.rms_norm(inputs["x"], inputs["weight"])
    norm_tune.check_close("y", call, expected, "f16")
