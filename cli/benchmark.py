"""`cupyops bench`: one op over a sweep of row lengths, or over named shapes
reduced over one axis, against its baselines.

Bytes counted: each array the op must read or write, once
(softmax forward: 2 * size * itemsize, size = rows * cols in a sweep). Every figure is also given as
a fraction of the device-to-device copy ceiling measured in the same run
(1 GiB). The "copy" baseline is a device-to-device copy moving the op's own
bytes (half read, half written): what moving that much costs at this size,
where launch and ramp-up weigh on small shapes that a 1 GiB copy hides."""
from __future__ import annotations

import csv
import math

import click

from cupyops import bench as timing

BASELINES = ("cupyx", "torch", "oneflow", "copy")


def run(op: str, entry, dtype, shapes: list, axis: int, baselines: list, rows=None) -> dict:
    """Times OP over each shape, reduced over axis. rows: the rows of a sweep over cols (shapes
    (rows, cols), axis -1), which the table then labels by cols; None for shapes given whole."""
    points = [(list(shape), shape[axis], entry.arrays_moved * math.prod(shape) * dtype.itemsize,
               lambda shape=tuple(shape): entry.providers(shape, axis, dtype)) for shape in shapes]
    return {"op": op, "rows": rows, "axis": axis, **time_points(f"{op} {dtype.name}", dtype, points, baselines)}


def time_points(label: str, dtype, points: list, baselines: list) -> dict:
    """Times each point (shape, cols, bytes, providers() -> {name: callable}, "cupyops" first)
    and the baselines it offers, L2 flushed, with the copy ceiling measured in the same run."""
    import cupy

    from cupyops.device import live_facts

    facts = live_facts(cupy.cuda.runtime.getDevice())
    timer = timing.Timer()
    copy_gbs = timing.copy_ceiling_gbs(timer)
    notes, timed = [], []
    with click.progressbar(points, label=label, file=click.get_text_stream("stderr")) as bar:
        for shape, cols, num_bytes, make_providers in bar:
            providers = make_providers()
            if "copy" in baselines:
                providers["copy"] = timing.device_copy(num_bytes // 2)
            for name in baselines:
                if name not in providers and f"{name} missing" not in notes:
                    notes.append(f"{name} missing")
            point = {"shape": list(shape), "cols": cols, "bytes": num_bytes,
                     "compile_s": timing.compile_seconds(providers["cupyops"])}
            for name in ["cupyops", *baselines]:
                if name in providers:
                    t = timer.time(providers[name])
                    point[name] = {"us": t.median_us, "reps": t.reps,
                                   "gbs": timing.gbs(num_bytes, t)}
            timed.append(point)
            del providers
            cupy.get_default_memory_pool().free_all_blocks()
    return {"dtype": dtype.name, "device": facts.name, "copy_gbs": copy_gbs,
            "baselines": [b for b in baselines if f"{b} missing" not in notes], "notes": notes, "points": timed}


def _label(result: dict, point: dict) -> str:
    """A point's name: its cols in a sweep over cols, else its shape."""
    if result["rows"] is not None:
        return str(point["cols"])
    return "x".join(map(str, point["shape"]))


def _over(result: dict) -> str:
    """What the points share: the rows of a sweep over cols, the reduced axis, or nothing."""
    if result["rows"] is not None:
        return f"rows={result['rows']}"
    return f"axis={result['axis']}" if result["axis"] is not None else "shapes"


def _rows(result: dict):
    for point in result["points"]:
        ours = point["cupyops"]
        row = {"shape": _label(result, point), "cols": point["cols"], "us": ours["us"],
               "gbs": ours["gbs"], "of_copy": ours["gbs"] / result["copy_gbs"],
               "compile_s": point["compile_s"]}
        for name in result["baselines"]:
            if name in point:
                row[f"{name}_us"] = point[name]["us"]
                row[f"x_{name}"] = point[name]["us"] / ours["us"]
        yield row


def format_table(result: dict) -> str:
    lines = [f"{result['op']} {result['dtype']} {_over(result)} on {result['device']}; "
             f"copy ceiling {result['copy_gbs']:.0f} GB/s (read + write)"]
    rows = list(_rows(result))
    label = "cols" if result["rows"] is not None else "shape"
    width = max([7, *(len(row["shape"]) for row in rows)])
    header = f"{label:>{width}} {'us':>9} {'GB/s':>7} {'copy':>6}"
    for name in result["baselines"]:
        header += f" {'x' + name:>9}"
    lines.append(header + f" {'compile s':>9}")
    for row in rows:
        line = f"{row['shape']:>{width}} {row['us']:>9.1f} {row['gbs']:>7.0f} {row['of_copy']:>6.1%}"
        for name in result["baselines"]:
            line += f" {row.get('x_' + name, float('nan')):>9.2f}"
        lines.append(line + f" {row['compile_s']:>9.2f}")
    lines.extend(f"note: {note} (skipped)" for note in result["notes"])
    return "\n".join(lines)


def emit(result: dict, csv_path=None, json_path=None, plot_path=None) -> None:
    """Prints the table; writes the CSV, JSON and PNG plot asked for."""
    import json

    click.echo(format_table(result))
    if csv_path:
        write_csv(result, csv_path)
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(result, handle, indent=1)
    if plot_path:
        plot(result, plot_path)


def write_csv(result: dict, path: str) -> None:
    rows = list(_rows(result))
    fields = sorted({key for row in rows for key in row}, key=lambda k: (k != "cols", k))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["op", "dtype", "rows", "axis", "device", *fields])
        writer.writeheader()
        for row in rows:
            writer.writerow({"op": result["op"], "dtype": result["dtype"], "rows": result["rows"],
                             "axis": result["axis"], "device": result["device"], **row})


def plot(result: dict, path: str) -> None:
    """Writes figure(result) as a PNG (matplotlib, imported only here; --plot checks it is there)."""
    figure(result).savefig(path, dpi=120)


def figure(result: dict):
    """GB/s against cols (a sweep) or shape: a line per provider, the copy ceiling dashed,
    titled with the op, dtype, what the points share and the device."""
    from matplotlib.figure import Figure

    sweep = result["rows"] is not None
    labels = [_label(result, point) for point in result["points"]]
    where = [point["cols"] for point in result["points"]] if sweep else list(range(len(labels)))
    chart = Figure(figsize=(8, 4.5))
    axes = chart.subplots()
    for name in ["cupyops", *result["baselines"]]:
        axes.plot(where, [point[name]["gbs"] for point in result["points"]], marker="o",
                  label="copy of the same bytes" if name == "copy" else name)
    axes.axhline(result["copy_gbs"], color="gray", linestyle="--", label="copy ceiling (1 GiB)")
    axes.set_ylim(bottom=0)
    if sweep:
        axes.set_xscale("log", base=2)
    else:
        axes.set_xticks(where, labels)
    axes.set_xlabel("cols" if sweep else "shape")
    axes.set_ylabel("GB/s")
    axes.set_title(f"{result['op']} {result['dtype']}, {_over(result)}, {result['device']}")
    axes.legend()
    chart.tight_layout()
    return chart
