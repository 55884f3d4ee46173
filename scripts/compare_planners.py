"""This tree's planner against a baseline tree's, on the live GPU in one run: the default sweep of
the row-wise ops (softmax, log_softmax, layer_norm, rms_norm, each forward and backward) in
float16, bfloat16 and float32, rows 49152, each point's `cupyops` time under both trees and the
`oneflow` policy's under this one.

For each (op, dtype) `cupyops bench` runs in a subprocess under the baseline tree, then under this
tree, then (with --repeats 2) in the reverse order, each run measuring the L2-flushed time; a
point keeps each tree's fastest run. The table gives after / before as a speed ratio (before's
microseconds over after's) and after against oneflow, and marks the points below 0.98 or below
oneflow. The baseline tree is a folder holding another commit's files, e.g. made with
`git archive <commit> | tar -x -C DIR` (the device machine has no git history to extract from).

Usage (repository root): python scripts/compare_planners.py --baseline-dir DIR [--ops softmax,...]
[--dtypes float16,...] [--cols 32,128,...] [--rows 49152] [--repeats 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm", "rms_norm",
       "layer_norm_backward", "rms_norm_backward")
COLS = "32,128,256,1024,2048,4096,8192,12345,16384,32768"
HERE = Path(__file__).resolve().parent.parent


def bench(tree: Path, op: str, dtype: str, rows: int, cols: str, oneflow: bool) -> dict:
    """({cols: {provider: us}}, the device name) of one `cupyops bench` run under `tree`."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "bench.json"
        command = [sys.executable, "-m", "cupyops.cli", "bench", op, "--dtype", dtype, "--rows", str(rows),
                   "--cols", cols, "--baseline", "oneflow" if oneflow else "copy", "--json", str(path)]
        subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                       stdout=subprocess.DEVNULL)
        found = json.loads(path.read_text())
    return {point["cols"]: {name: point[name]["us"] for name in ("cupyops", "oneflow") if name in point}
            for point in found["points"]}, found["device"]


def fastest(runs: list) -> dict:
    """Each point's fastest time over the runs of one tree."""
    best: dict = {}
    for run in runs:
        for cols, times in run.items():
            for name, us in times.items():
                best.setdefault(cols, {})[name] = min(us, best.get(cols, {}).get(name, us))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-dir", type=Path, required=True)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtypes", default="float16,bfloat16,float32")
    parser.add_argument("--cols", default=COLS)
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=2, choices=(1, 2))
    parser.add_argument("--json", type=Path, help="where to keep every point's times")
    options = parser.parse_args()
    baseline = options.baseline_dir.resolve()
    results, worst, device = [], [], None
    print(f"{'op':22s} {'dtype':9s} {'cols':>6s} {'before us':>10s} {'after us':>9s} {'after/before':>12s} "
          f"{'x oneflow':>9s}")
    for op in options.ops.split(","):
        for dtype in options.dtypes.split(","):
            order = [(baseline, "before"), (HERE, "after")]
            runs = {"before": [], "after": []}
            for tree, label in order + (order[::-1] if options.repeats == 2 else []):
                found, device = bench(tree, op, dtype, options.rows, options.cols, oneflow=label == "after")
                runs[label].append(found)
            before, after = fastest(runs["before"]), fastest(runs["after"])
            for cols in sorted(after):
                ratio = before[cols]["cupyops"] / after[cols]["cupyops"]
                versus = after[cols]["oneflow"] / after[cols]["cupyops"]
                flag = "  <" if ratio < 0.98 or versus < 1.0 else ""
                print(f"{op:22s} {dtype:9s} {cols:6d} {before[cols]['cupyops']:10.1f} {after[cols]['cupyops']:9.1f} "
                      f"{ratio:12.3f} {versus:9.3f}{flag}", flush=True)
                results.append({"op": op, "dtype": dtype, "cols": cols, "before_us": before[cols]["cupyops"],
                                "after_us": after[cols]["cupyops"], "oneflow_us": after[cols]["oneflow"]})
                worst.append((min(ratio, versus), op, dtype, cols))
            if options.json:     # kept after each (op, dtype): a run cut short keeps what it measured
                options.json.write_text(json.dumps({"device": device, "rows": options.rows, "points": results},
                                                   indent=1))
    low = min(worst)
    print(f"{device}: {len(results)} points; lowest of after/before and x oneflow {low[0]:.3f} "
          f"({low[1]} {low[2]} cols {low[3]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
