"""The tuning tables shipped inside the package (issue 43, SPEC §11):
cupyops/profiles/tuned_<profile>.json are valid and their plans are what the
planners produce on the profile's target; under policy="auto" the user's table
for the live GPU comes first, then the shipped table of the target's profile,
then the rules (never under oneflow); `cupyops tune ship` writes the shipped
table from a user's table. CPU only: occupancy from NVRTC."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from conftest import keep_winner, stand_in_live

from cupyops import profile, tune
from cupyops.cli.main import main
from cupyops.cli.tune_ship import SHIPPED_OPS
from cupyops.launch import Target
from cupyops.ops import (fused_softmax, norm, norm_candidates, norm_grad_candidates, row_candidates, softmax,
                         softmax_candidates, softmax_rows)
from cupyops.ops.norm_spec import BACKWARD_OPS, FORWARD_OPS

H100 = Target.profile("h100")
DEVICE = tune.DeviceKey("NVIDIA H100 80GB HBM3", 12080)
SOFTMAX_KEY = softmax_candidates.shape_key("f16", 49152, 1024)
NORM_KEY = norm_candidates.shape_key("f16", 49152, 1024)


def _shape(shape_key: str) -> tuple:
    """A row family's shape key -> (dtype, its name=value fields: ints, the fused bias's dtype)."""
    dtype, *fields = shape_key.split("|")
    return dtype, {name: value if name == "bias" and not value.isdigit() else int(value)
                   for name, value in (field.split("=") for field in fields)}


def _auto_plan(op: str, shape_key: str, target: Target):
    """The planner's auto plan for a shipped key (its rows: the key's bucket)."""
    dtype, fields = _shape(shape_key)
    rows, cols, align, same_phase = fields.pop("rows"), fields.pop("cols"), fields.pop("align"), fields.pop("phase")
    if op in FORWARD_OPS + BACKWARD_OPS:
        return norm.plan(op, rows, cols, dtype, "auto", target, align, same_phase=bool(same_phase),
                         **{name: bool(value) for name, value in fields.items()})
    if op in fused_softmax.TUNED_OPS.values():
        return fused_softmax.plan(op.rsplit("_", 1)[1], rows, cols, dtype, "auto", target, _fusion(fields), align,
                                  bool(same_phase))
    assert not fields, shape_key
    return softmax.plan(op, rows, cols, dtype, "auto", target, align, bool(same_phase))


def _fusion(fields: dict):
    """A fused key's Fusion (its bias field: the bias's dtype, 0 without one; entries: 1 where absent)."""
    bias = fields.pop("bias")
    return fused_softmax.Fusion(bias or "", *(bool(fields.pop(name)) for name in ("mask", "causal", "dropout")),
                                entries=int(fields.pop("entries", 1)))


def _rebuilt(op: str, shape_key: str, best: dict, target: Target):
    """The launch of a shipped description over the key's rows."""
    dtype, fields = _shape(shape_key)
    if op in fused_softmax.TUNED_OPS.values():
        return fused_softmax.fused_launch(op.rsplit("_", 1)[1], dtype, fields["rows"], fields["cols"], target,
                                          _fusion(fields), best)
    if op in BACKWARD_OPS:   # the dx kernel, in its backward plan
        candidate = norm_grad_candidates.Candidate.from_description(best, fields["rows"], target)
        return candidate.plan(fields["rows"], fields["cols"], bool(fields["param_grad"]), target).main
    candidate_type = norm_candidates.Candidate if op in FORWARD_OPS else softmax_candidates.Candidate
    return candidate_type.from_description(best, fields["rows"], target).launch


def _launch(plan) -> tuple:
    """A launch's fields (a plan from a table compares unequal to the same KernelLaunch)."""
    return (plan.spec, plan.block, plan.grid, plan.smem_bytes)


def check_shipped(name: str) -> int:
    """Checks the shipped table of profile `name` as the planners read it:
    keys of a row op and its shape key, descriptions that rebuild into a launch
    that can run on the profile's target and is not the rule's, and the
    planner's auto plan of the key being that launch, from the shipped table.
    Returns the number of plans."""
    target = Target.profile(name)
    plans = tune.shipped(name)
    for key, entry in plans.items():
        op, shape_key = key.split("|", 1)
        assert op in SHIPPED_OPS and set(entry) == {"best", "us", "measured_on"}, key
        assert profile.matching_profile(entry["measured_on"].split("|")[0]) == name
        assert not row_candidates.is_rule(entry["best"])
        launch = _rebuilt(op, shape_key, entry["best"], target)
        assert row_candidates.can_launch(target, launch), key
        chosen = _auto_plan(op, shape_key, target)
        assert _launch(chosen.main if op in FORWARD_OPS + BACKWARD_OPS else chosen) == _launch(launch), key
        assert chosen.explain()["source"] == "shipped"
    return len(plans)


@pytest.mark.parametrize("name", profile.PROFILE_NAMES)
def test_every_shipped_table_is_valid_and_planned(name):
    path = tune.shipped_path(name)
    document = json.loads(path.read_text())
    assert set(document) == {"_profile", "_about", "plans"} and document["_profile"] == name
    assert path.read_text() == json.dumps(document, indent=1, sort_keys=True) + "\n"   # as `tune ship` writes
    check_shipped(name)


def test_a_shipped_table_of_another_profile_is_refused(tmp_path):
    path = tmp_path / "tuned_h100.json"
    path.write_text(json.dumps({"_profile": "h200", "_about": "", "plans": {}}))
    with pytest.raises(ValueError, match="profile 'h100'"):
        tune.read_shipped(path, "h100")
    path.write_text(json.dumps({"_profile": "h100", "_about": "", "plans": {"softmax": {"us": 1.0}}}))
    with pytest.raises(ValueError, match=re.escape("not 'op|shape key'")):
        tune.read_shipped(path, "h100")
    with pytest.raises(ValueError, match="unknown tuning profile"):
        tune.shipped_path("v100")


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """The user's table in tmp_path/user.json (the device key fixed to an
    H100's), the shipped tables in tmp_path/profiles, and a stand-in live
    target (the H100 profile's facts with a device id; occupancy and
    resources from NVRTC as the profile's)."""
    user = tune.TuningTable(tmp_path / "user.json")
    monkeypatch.setattr(tune, "PROFILE_DIR", tmp_path / "profiles")
    live = stand_in_live(monkeypatch, user, H100, DEVICE)
    tune.shipped.cache_clear()
    yield user, live
    tune.shipped.cache_clear()


def _winner(table, device, op, shape_key, label, module=softmax_candidates):
    """Keeps the candidate `label` of the 49152 x 1024 f16 shape as `table`'s winner (1 us)."""
    found = [c.describe() for c in module.candidates(op, "f16", 49152, 1024, H100)]
    return keep_winner(table, device, op, shape_key, found, label)


def _ship(user: tune.TuningTable, name: str = "h100") -> dict:
    result = CliRunner().invoke(main, ["tune", "ship", "--profile", name, "--table", str(user.path)])
    assert result.exit_code == 0, result.output
    return json.loads(tune.shipped_path(name).read_text())["plans"]


def test_user_table_then_shipped_then_rule(tables, monkeypatch, tmp_path):
    user, live = tables
    rule = softmax_rows.plan("softmax", 49152, 1024, "f16", "auto", H100)
    shipped_winner = _winner(user, DEVICE, "softmax", SOFTMAX_KEY, "regs b256 k1 packed")
    _ship(user)
    user_winner = _winner(user, DEVICE, "softmax", SOFTMAX_KEY, "regs b128 k1")
    expected = {source: _launch(softmax_candidates.Candidate.from_description(winner, 49152, H100).launch)
                for source, winner in (("tuned", user_winner), ("shipped", shipped_winner))}
    assert expected["tuned"] != expected["shipped"] != _launch(rule)
    chosen = softmax.plan("softmax", 49152, 1024, "f16", "auto", live)           # the user's table first
    assert _launch(chosen) == expected["tuned"] and chosen.explain()["source"] == "tuned"
    chosen = softmax.plan("softmax", 49152, 1024, "f16", "auto", H100)           # a profile: the shipped table
    assert _launch(chosen) == expected["shipped"] and chosen.explain()["source"] == "shipped"
    monkeypatch.setattr(tune, "default_table", lambda: tune.TuningTable(tmp_path / "empty.json"))
    chosen = softmax.plan("softmax", 49152, 1024, "f16", "auto", live)           # no user entry: shipped
    assert _launch(chosen) == expected["shipped"] and chosen.explain()["source"] == "shipped"
    other = softmax.plan("softmax", 49152, 2048, "f16", "auto", live)            # neither: the rule
    assert other == softmax_rows.plan("softmax", 49152, 2048, "f16", "auto", H100)
    assert "source" not in other.explain()


def test_rows_past_the_most_measured_take_that_winner(tables):
    """A shape with more rows than either table measured takes the winner at the most rows
    measured, if those fill a wave; fewer rows, rows between two measured and rows measured
    below a wave take the rules."""
    user, live = tables
    winner = _winner(user, DEVICE, "softmax", SOFTMAX_KEY, "regs b256 k1 packed")    # rows bucket 65536
    _ship(user)
    for rows in (65537, 1 << 20):
        chosen = softmax.plan("softmax", rows, 1024, "f16", "auto", H100)
        assert _launch(chosen) == _launch(softmax_candidates.Candidate.from_description(winner, rows, H100).launch)
        assert chosen.explain()["source"] == "shipped (rows 65536)"
    for rows in (32768, 1000):
        assert "source" not in softmax.plan("softmax", rows, 1024, "f16", "auto", H100).explain()
    # the user's table measured more rows, the rules winning there: they serve past it too
    _winner(user, DEVICE, "softmax", softmax_candidates.shape_key("f16", 1 << 18, 1024), "auto")
    found = row_candidates.stored_winner("softmax", softmax_candidates.shape_key("f16", 1 << 20, 1024), live)
    assert found["label"] == "auto" and found["source"] == "tuned (rows 262144)"
    assert row_candidates.stored_winner("softmax", softmax_candidates.shape_key("f16", 1 << 17, 1024), live) is None
    # a winner at fewer rows than fill a wave (a row a warp on each of 132 SMs: 8448) serves only its own
    _winner(user, DEVICE, "softmax", softmax_candidates.shape_key("f16", 4096, 2048), "regs b128 k1")
    assert row_candidates.stored_winner("softmax", softmax_candidates.shape_key("f16", 4096, 2048), live)
    assert row_candidates.stored_winner("softmax", softmax_candidates.shape_key("f16", 1 << 16, 2048), live) is None


def test_oneflow_and_other_profiles_ignore_the_shipped_table(tables):
    user, live = tables
    _winner(user, DEVICE, "softmax", SOFTMAX_KEY, "regs b256 k1 packed")
    _ship(user)
    assert softmax.plan("softmax", 49152, 1024, "f16", "auto", H100).explain()["source"] == "shipped"
    for target in (H100, live):
        assert softmax.plan("softmax", 49152, 1024, "f16", "oneflow", target) == \
            softmax_rows.plan("softmax", 49152, 1024, "f16", "oneflow", H100)
    for device in ("h200", "a100"):   # h200's table is empty; a100 names no profile
        target = Target.profile(device)
        assert softmax.plan("softmax", 49152, 1024, "f16", "auto", target) == \
            softmax_rows.plan("softmax", 49152, 1024, "f16", "auto", target)


def test_a_shipped_fused_softmax_winner_is_planned(tables):
    from cupyops.ops import fused_softmax_tune

    user, _ = tables
    fusion = fused_softmax.Fusion("f16", False, True, False)
    key = fused_softmax.tuning_key("f16", 16384, 4096, fusion)
    found = [d for d, _ in fused_softmax_tune.candidates("forward", "f16", 16384, 4096, H100, fusion)]
    keep_winner(user, DEVICE, "fused_softmax_forward", key, found, "regs b256 k2")
    assert list(_ship(user)) == [f"fused_softmax_forward|{key}"]
    assert check_shipped("h100") == 1
    chosen = fused_softmax.plan("forward", 16384, 4096, "f16", "auto", H100, fusion)
    assert chosen.spec.path.block_size == 256 and chosen.explain()["source"] == "shipped"
    assert fused_softmax.plan("forward", 16384, 4096, "f16", "oneflow", H100, fusion) == \
        fused_softmax.rule_plan("forward", 16384, 4096, "f16", "oneflow", H100, fusion)


def test_explain_on_a_profile_says_shipped(tables):
    user, _ = tables
    winner = _winner(user, DEVICE, "softmax", SOFTMAX_KEY, "regs b256 k1 packed")
    _ship(user)
    result = CliRunner().invoke(main, ["explain", "softmax", "--shape", "49152,1024", "--device", "h100", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    launch = softmax_candidates.Candidate.from_description(winner, 49152, H100).launch
    assert info["source"] == "shipped" and info["kernel"] == launch.spec.name and info["grid"] == list(launch.grid)
    result = CliRunner().invoke(main, ["explain", "softmax", "--shape", "49152,1024", "--device", "h200", "--json"])
    assert json.loads(result.stdout)["source"] == "rule"


def test_norm_planner_takes_the_shipped_winner(tables):
    user, live = tables
    winner = _winner(user, DEVICE, "layer_norm", NORM_KEY, "regs b128 k1 packed", norm_candidates)
    _ship(user)
    launch = norm_candidates.Candidate.from_description(winner, 49152, H100).launch
    for target, source in ((H100, "shipped"), (live, "tuned")):   # the live GPU's user table has it too
        chosen = norm.plan("layer_norm", 49152, 1024, "f16", "auto", target)
        assert chosen.main == launch and chosen.explain()["source"] == source
    oneflow = norm.plan("layer_norm", 49152, 1024, "f16", "oneflow", H100)
    assert "source" not in oneflow.explain() and oneflow.main != launch
    assert check_shipped("h100") == 1


def test_norm_backward_planner_takes_the_shipped_winner(tables):
    user, _ = tables
    found = norm_grad_candidates.candidates("rms_norm_backward", "f16", 49152, 1024, H100)
    labels = [c.label for c in found]
    label = next(label for label in labels if label not in ("auto", "oneflow"))
    key = norm_grad_candidates.shape_key("f16", 49152, 1024)
    keep_winner(user, DEVICE, "rms_norm_backward", key, [c.describe() for c in found], label)
    assert list(_ship(user)) == [f"rms_norm_backward|{key}"]
    assert check_shipped("h100") == 1
    chosen = norm.plan("rms_norm_backward", 49152, 1024, "f16", "auto", H100)
    assert chosen.main == found[labels.index(label)].launch and chosen.explain()["source"] == "shipped"


def test_tune_ship_round_trip(tables):
    user, _ = tables
    pcie = tune.DeviceKey("NVIDIA H100 PCIe", 12040)
    h200 = tune.DeviceKey("NVIDIA H200", 12080)
    shipped = _winner(user, DEVICE, "softmax", SOFTMAX_KEY, "regs b256 k1 packed")
    slower = _winner(user, pcie, "softmax", SOFTMAX_KEY, "regs b128 k1")
    user.store(pcie, "softmax", SOFTMAX_KEY, tune.Result(slower, 2.0, []))   # the fastest GPU's winner ships
    _winner(user, DEVICE, "log_softmax", SOFTMAX_KEY, "auto")              # the rule's plan: not shipped
    on_h200 = _winner(user, h200, "softmax", SOFTMAX_KEY, "regs b128 k1")
    user.store(DEVICE, "conv2d_int8", "n1", tune.Result({"tile_m": 64}, 1.0, []))   # not a row op
    plans = _ship(user)
    assert plans == {f"softmax|{SOFTMAX_KEY}": {"best": shipped, "us": 1.0,
                                                "measured_on": "NVIDIA H100 80GB HBM3|cuda12080"}}
    text = tune.shipped_path("h100").read_text()
    assert _ship(user) == plans and tune.shipped_path("h100").read_text() == text    # regenerable, byte for byte
    assert check_shipped("h100") == 1
    assert _ship(user, "h200") == {f"softmax|{SOFTMAX_KEY}": {"best": on_h200, "us": 1.0,
                                                              "measured_on": "NVIDIA H200|cuda12080"}}
    assert check_shipped("h200") == 1
    _winner(user, DEVICE, "softmax", SOFTMAX_KEY, "auto")                   # measured again: now the rule's
    assert _ship(user) == {}
    assert "source" not in softmax.plan("softmax", 49152, 1024, "f16", "auto", H100).explain()


def test_tune_ship_refuses_a_missing_table(tmp_path):
    result = CliRunner().invoke(main, ["tune", "ship", "--profile", "h100", "--table", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "no such file" in result.output
