"""The softmax family's planning model (issue 43, SPEC §11): the candidate
generator (structural validity, the policies' plans among the candidates,
descriptions that rebuild them), the planner reading the tuning table (a
winner where it has one, the rule otherwise; never under oneflow) and
`cupyops tune softmax`. CPU tests plan for the H100 profile (occupancy from
NVRTC); the GPU tests tune a small shape on the live GPU."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import keep_winner

from cupyops import tune
from cupyops.cli.main import main
from cupyops.launch import Target
from cupyops.ops import softmax, softmax_rows, softmax_tune
from cupyops.ops.softmax_candidates import Candidate, candidates, shape_key

H100 = Target.profile("h100")
DEVICE = tune.DeviceKey("NVIDIA H100 80GB HBM3", 12080)
# (op, dtype, cols, align): warp-path rows, peeled rows off the 16-byte grid,
# rows for the async, shared-memory and uncached paths
SHAPES = [("softmax", "f16", 1024, 16), ("log_softmax_backward", "f32", 12345, 4),
          ("softmax", "f16", 32768, 16), ("softmax_backward", "bf16", 4096, 16)]


@pytest.mark.parametrize("op, dtype, cols, align", SHAPES)
def test_candidates_are_valid_and_hold_both_policies(op, dtype, cols, align):
    found = candidates(op, dtype, 49152, cols, H100, align)
    launches = [c.launch for c in found]
    assert len(set(launches)) == len(launches) > 2
    for policy in ("auto", "oneflow"):
        assert softmax_rows.plan(op, 49152, cols, dtype, policy, H100, align) in launches
    for candidate in found:
        launch = candidate.launch
        threads = launch.block[0] * launch.block[1] * launch.block[2]
        assert threads <= 1024 and launch.smem_bytes <= H100.facts.smem_per_block_optin
        assert H100.max_active_blocks(launch.spec, threads, launch.smem_bytes, True) >= 1
        assert (launch.spec.op, launch.spec.dtype) == (op, dtype)
        description = json.loads(json.dumps(candidate.describe()))
        assert Candidate.from_description(description, 49152, H100) == candidate


def test_shape_key_rounds_rows_up_to_a_power_of_two():
    assert shape_key("f16", 49152, 1024) == "f16|cols=1024|rows=65536|align=16|phase=1"
    assert shape_key("f16", 65536, 1024) == shape_key("f16", 32769, 1024)
    assert shape_key("f16", 65537, 1024) != shape_key("f16", 65536, 1024)
    assert shape_key("f32", 7, 1001, 4, False) == "f32|cols=1001|rows=8|align=4|phase=0"


@pytest.fixture
def live_table(monkeypatch, tmp_path):
    """A tuning table in tmp_path, the device key fixed, and a stand-in live
    target (the H100 profile's facts with a device id)."""
    table = tune.TuningTable(tmp_path / "tuning.json")
    monkeypatch.setattr(tune, "default_table", lambda: table)
    monkeypatch.setattr(tune.DeviceKey, "live", classmethod(lambda cls, device_id: DEVICE))
    return table, Target(H100.facts, device_id=0)


def _keep(table, op, dtype, rows, cols, label):
    """Stores the candidate `label` of the shape as the table's winner."""
    found = [c.describe() for c in candidates(op, dtype, rows, cols, H100)]
    return keep_winner(table, DEVICE, op, shape_key(dtype, rows, cols), found, label)


def test_planner_takes_the_tables_winner(live_table):
    table, live = live_table
    assert softmax.plan("softmax", 49152, 512, "f16", "auto", live) == \
        softmax_rows.plan("softmax", 49152, 512, "f16", "auto", H100)     # no entry: the rule
    winner = _keep(table, "softmax", "f16", 49152, 1024, "regs b256 k1 packed")
    for rows in (49152, 40000):   # the same power of two: the grid follows rows
        chosen = softmax.plan("softmax", rows, 1024, "f16", "auto", live)
        expected = Candidate.from_description(winner, rows, H100).launch
        assert (chosen.spec, chosen.block, chosen.grid, chosen.smem_bytes) == \
            (expected.spec, expected.block, expected.grid, expected.smem_bytes)
        assert chosen.explain()["source"] == "tuned"
    rule = softmax.plan("softmax", 49152, 1024, "f16", "auto", live, 8, False)   # another key
    assert rule.spec.impl == "warp" and "source" not in rule.explain()
    assert softmax.plan("softmax", 49152, 1024, "f16", "auto", H100).spec.impl == "warp"   # a profile


def test_oneflow_ignores_the_table(live_table):
    table, live = live_table
    _keep(table, "log_softmax", "f16", 49152, 512, "warp p2 c16 g32 r2")
    assert softmax.plan("log_softmax", 49152, 512, "f16", "auto", live).spec.name == \
        "log_softmax_warp_f16_f32_p2_c16_g32_r2_nopad"
    assert softmax.plan("log_softmax", 49152, 512, "f16", "oneflow", live) == \
        softmax_rows.plan("log_softmax", 49152, 512, "f16", "oneflow", H100)


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_tune_softmax_cli_help_and_refusals():
    result = run("tune", "softmax", "--help")
    assert result.exit_code == 0 and "--op" in result.output and "--cols" in result.output
    for args, message in ((("--op", "softmax,foo"), "unknown op"), (("--cols", "0"), "cols must be positive"),
                          (("--rows", "0"), "rows must be positive"), (("--dtype", "int8"), "int8")):
        result = run("tune", "softmax", *args)
        assert result.exit_code == 2 and message in result.output, result.output


def test_tune_softmax_cli_prints_every_candidate_and_marks_the_winner(monkeypatch):
    from cupyops.cli import tune_softmax as command

    timings = [({"label": "auto"}, 12.0), ({"label": "warp p4"}, None), ({"label": "regs b256"}, 10.0)]
    tuned = softmax_tune.Tuned(tune.Result(timings[2][0], 10.0, timings), {"warp p4": "ValueError: wrong"},
                               "f16|cols=1024|rows=65536|align=16|phase=1")
    monkeypatch.setattr(command, "live_device", lambda message: 0)
    monkeypatch.setattr(softmax_tune, "tune_shape", lambda *args: tuned)
    result = run("tune", "softmax", "--cols", "1024")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.lstrip().startswith("* regs b256") and "GB/s" in line for line in lines)
    assert any("warp p4" in line and "ValueError: wrong" in line for line in lines)
    assert "kept 'regs b256' under f16|cols=1024|rows=65536" in result.output


# -- on the GPU ------------------------------------------------------------------

@pytest.mark.gpu
def test_tuning_writes_the_winner_and_calls_run_it(monkeypatch, tmp_path):
    import cupy

    from cupyops.callcache import CallCache
    from cupyops.launch import LaunchCache

    table = tune.TuningTable(tmp_path / "tuning.json")
    monkeypatch.setattr(tune, "default_table", lambda: table)
    for name, cache in (("_launches", LaunchCache()), ("_calls", CallCache())):
        monkeypatch.setattr(softmax, name, cache)
    result = run("tune", "softmax", "--dtype", "float16", "--cols", "1024", "--rows", "4096",
                 "--op", "softmax,log_softmax_backward")
    assert result.exit_code == 0, result.output
    device_id = cupy.cuda.runtime.getDevice()
    live = Target.live(device_id)
    for op in ("softmax", "log_softmax_backward"):
        best = table.lookup(tune.DeviceKey.live(device_id), op, shape_key("f16", 4096, 1024))
        assert best is not None and f"* {best['label']}" in result.output
        chosen = softmax.plan(op, 4096, 1024, "f16", "auto", live)
        assert chosen.explain()["source"] == "tuned"
        assert chosen.spec == Candidate.from_description(best, 4096, live).launch.spec
        inputs = softmax_tune.sample_inputs(op, "f16", 4096, 1024)
        expected = softmax_tune.reference(op, inputs)
        error = float(cupy.abs(getattr(softmax, op)(*inputs, axis=-1).astype(cupy.float64) - expected).max())
        assert error <= softmax_tune.TOLERANCE["f16"] * max(1.0, float(cupy.abs(expected).max()))
