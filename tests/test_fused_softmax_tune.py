"""The fused attention softmax's planning model (issue 43): its candidates (structurally valid,
both policies' plans among them, descriptions that rebuild them), the planner reading the tuning
table under auto (never under oneflow) and `cupyops tune fused_softmax`. CPU tests plan for the
H200 profile; the GPU test tunes small shapes on the live GPU."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import keep_winner, stand_in_live

from cupyops import tune
from cupyops.cli.main import main
from cupyops.launch import Target
from cupyops.ops import fused_softmax as fs
from cupyops.ops import fused_softmax_tune as ft
from cupyops.ops.row_candidates import can_launch

H200 = Target.profile("h200")
DEVICE = tune.DeviceKey("NVIDIA H200", 13000)
FUSIONS = [fs.Fusion(causal=True), fs.Fusion("f32", True, False, True)]


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("cols", [128, 4096])
def test_candidates_are_valid_and_hold_both_policies(stage, cols):
    for fusion in FUSIONS:
        found = ft.candidates(stage, "f16", 16384, cols, H200, fusion)
        launches = [launch for _, launch in found]
        assert len(launches) == len(set(launches)) > 2
        assert [d["label"] for d, _ in found][:2] == ["auto", "oneflow"]
        for policy in ("auto", "oneflow"):
            assert fs.rule_plan(stage, 16384, cols, "f16", policy, H200, fusion) in launches
        for description, launch in found:
            assert can_launch(H200, launch)
            assert (launch.spec.stage, launch.spec.dtype, launch.spec.causal) == (stage, "f16", fusion.causal)
            assert launch.spec.path.impl in ft.FUSED_IMPLS and not launch.spec.path.storage_cache
            again = json.loads(json.dumps(description))
            assert fs.fused_launch(stage, "f16", 16384, cols, H200, fusion, again) == launch


def test_tuning_key_adds_the_fusion_to_softmaxs_key():
    key = fs.tuning_key("f16", 16384, 1024, fs.Fusion("bf16", True, False, True))
    assert key == "f16|cols=1024|rows=16384|align=16|phase=1|bias=bf16|mask=1|causal=0|dropout=1"
    assert fs.tuning_key("f16", 9000, 1024, fs.Fusion()) == fs.tuning_key("f16", 16384, 1024, fs.Fusion())
    assert fs.tuning_key("f16", 16384, 1024, fs.Fusion(causal=True)) != fs.tuning_key("f16", 16384, 1024, fs.Fusion())


@pytest.fixture
def live_table(monkeypatch, tmp_path):
    """A tuning table in tmp_path, the device key fixed, and a stand-in live target whose
    occupancy and resources are the H200 profile's (NVRTC's, no GPU needed)."""
    table = tune.TuningTable(tmp_path / "tuning.json")
    return table, stand_in_live(monkeypatch, table, H200, DEVICE)


def _keep(table, stage, cols, fusion, label):
    found = [d for d, _ in ft.candidates(stage, "f16", 16384, cols, H200, fusion)]
    return keep_winner(table, DEVICE, f"fused_softmax_{stage}", fs.tuning_key("f16", 16384, cols, fusion), found,
                       label)


def test_planner_takes_the_tables_winner_under_auto_only(live_table):
    table, live = live_table
    fusion = fs.Fusion("f16")
    rule = fs.plan("forward", 16384, 4096, "f16", "auto", live, fusion)
    assert rule == fs.rule_plan("forward", 16384, 4096, "f16", "auto", H200, fusion)
    assert "source" not in rule.explain()
    winner = _keep(table, "forward", 4096, fusion, "regs b256 k2")
    for rows in (16384, 9000):   # the same power of two: the grid follows rows
        chosen = fs.plan("forward", rows, 4096, "f16", "auto", live, fusion)
        expected = fs.fused_launch("forward", "f16", rows, 4096, H200, fusion, winner)
        assert (chosen.spec, chosen.block, chosen.grid, chosen.smem_bytes) == \
            (expected.spec, expected.block, expected.grid, expected.smem_bytes)
        assert chosen.spec.path.block_size == 256 and chosen.explain()["source"] == "tuned"
    assert fs.plan("forward", 16384, 4096, "f16", "oneflow", live, fusion) == \
        fs.rule_plan("forward", 16384, 4096, "f16", "oneflow", H200, fusion)
    assert fs.plan("backward", 16384, 4096, "f16", "auto", live, fusion) == \
        fs.rule_plan("backward", 16384, 4096, "f16", "auto", H200, fusion)     # another op
    assert fs.plan("forward", 16384, 4096, "f16", "auto", live, fs.Fusion()) == \
        fs.rule_plan("forward", 16384, 4096, "f16", "auto", H200, fs.Fusion())   # another fusion


def test_a_stored_auto_winner_keeps_the_rule(live_table):
    table, live = live_table
    fusion = fs.Fusion(causal=True)
    _keep(table, "backward", 1024, fusion, "auto")
    assert fs.plan("backward", 16384, 1024, "f16", "auto", live, fusion) == \
        fs.rule_plan("backward", 16384, 1024, "f16", "auto", H200, fusion)


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_tune_fused_softmax_cli_help_and_refusals():
    result = run("tune", "fused_softmax", "--help")
    assert result.exit_code == 0 and "--mask-shape" in result.output and "--stage" in result.output
    for args, message in ((("--stage", "forward,lse"), "stages are forward and backward"),
                          (("--shape", "2,3,0,8"), "positive"),
                          (("--shape", "2,3,8,8", "--mask-shape", "5,8,8"), "does not broadcast"),
                          (("--dropout", "1.0"), "dropout must be in [0, 1)")):
        result = run("tune", "fused_softmax", *args)
        assert result.exit_code == 2 and message in result.output, result.output


def test_moved_bytes_counts_mask_and_bias_once():
    assert ft.moved_bytes("forward", (2, 4, 8, 8), "f16") == 2 * 512 * 2
    assert ft.moved_bytes("backward", (2, 4, 8, 8), "f16", (2, 1, 1, 8), (4, 8, 8), "f32") == \
        3 * 512 * 2 + 16 + 256 * 4


# -- on the GPU ------------------------------------------------------------------

@pytest.mark.gpu
def test_tuning_writes_winners_that_calls_run(monkeypatch, tmp_path):
    import cupy

    from cupyops.launch import LaunchCache

    table = tune.TuningTable(tmp_path / "tuning.json")
    monkeypatch.setattr(tune, "default_table", lambda: table)
    monkeypatch.setattr(fs, "_launches", LaunchCache())
    result = run("tune", "fused_softmax", "--dtype", "float16", "--shape", "2,8,256,1024", "--causal",
                 "--dropout", "0.1", "--mask-shape", "2,1,1,1024")
    assert result.exit_code == 0, result.output
    assert result.output.count("kept ") == 2
    live = Target.live(cupy.cuda.runtime.getDevice())
    fusion = fs.Fusion("", True, True, True)
    for stage in ("forward", "backward"):
        assert tune.default_table().lookup(tune.DeviceKey.live(live.device_id), f"fused_softmax_{stage}",
                                           fs.tuning_key("f16", 4096, 1024, fusion)) is not None
    generator = cupy.random.default_rng(3)
    x = generator.standard_normal((2, 8, 256, 1024), dtype=cupy.float32).astype(cupy.float16)
    mask = generator.random((2, 1, 1, 1024)) < 0.9
    args = dict(scale=0.125, mask=mask, causal=True, dropout=0.1, seed=5)
    tuned, expected = (fs.fused_softmax(x, return_lse=True, policy=policy, **args) for policy in ("auto", "oneflow"))
    for got, want in zip(tuned, expected):
        assert float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max()) < 4e-3
    dy = generator.standard_normal(x.shape, dtype=cupy.float32).astype(cupy.float16)
    dx, want = (fs.fused_softmax_backward(dy, x, expected[1], policy=policy, **args) for policy in ("auto", "oneflow"))
    assert float(cupy.abs(dx.astype(cupy.float32) - want.astype(cupy.float32)).max()) < 4e-3
