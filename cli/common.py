"""What every op family's commands share: the verb groups they register under
(`cupyops explain OP`, `compile OP`, `bench OP`, `tune OP`), option parsing and the target a
plan is made for. Each family's module (rowwise, elementwise, ...) adds its subcommands."""
from __future__ import annotations

import json
import sys
from typing import Optional

import click

from cupyops import dtypes, jit
from cupyops.device import PROFILES
from cupyops.launch import Target


@click.group()
def explain():
    """Show the launch plan cupyops picks for OP (no kernel runs)."""


@click.group(name="compile")
def compile_():
    """Render and NVRTC-compile every kernel OP's plans need (no GPU needed)."""


@click.group()
def bench():
    """Time OP against its baselines on the live GPU (L2 flushed, copy ceiling measured)."""


@click.group()
def tune():
    """Time OP's candidate plans on the live GPU and keep the winners (beside CuPy's kernel cache)."""


def int_list(text: str) -> list:
    """'1,2,3' -> [1, 2, 3], a usage error otherwise."""
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def positive_shape(text: str, hint: str = "--shape") -> list:
    """A shape option: comma-separated positive sizes."""
    dims = int_list(text)
    if not dims or any(d < 1 for d in dims):
        raise click.BadParameter(f"shape needs positive sizes, got {text!r}", param_hint=hint)
    return dims


def live_device(no_gpu_message: str) -> int:
    """The current device's id, or a usage error saying no_gpu_message where no GPU is usable."""
    import cupy

    if not cupy.is_available():
        raise click.UsageError(no_gpu_message)
    return cupy.cuda.runtime.getDevice()


def target(device_name):
    """The device profile named, else the live GPU (a usage error where there is none)."""
    if device_name is not None:
        return Target.profile(device_name)
    return Target.live(live_device("no GPU here: name a device profile with --device "
                                   f"({', '.join(PROFILES)})"))


dtype_option = click.option("--dtype", default="float16", show_default=True,
                            type=click.Choice(sorted(dtypes.NAMES)))
policy_option = click.option("--policy", default="auto", show_default=True,
                             type=click.Choice(["auto", "oneflow"]))
device_option = click.option("--device", "device_name", type=click.Choice(sorted(PROFILES)), default=None,
                             help="Plan for a device profile (no GPU needed) instead of the live GPU.")
json_flag = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
source_flag = click.option("--source", is_flag=True, help="Also print the rendered CUDA source.")


def _needs_matplotlib(ctx, param, path):
    """--plot's check, made before anything is timed: matplotlib must be importable."""
    if path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install matplotlib "
                                   "(or install cupyops with its 'plot' extra)", ctx) from None
    return path


plot_option = click.option("--plot", "plot_path", type=click.Path(dir_okay=False), callback=_needs_matplotlib,
                           help="Write a PNG of GB/s per provider, the copy ceiling dashed (needs matplotlib).")


def show_plan(info: dict, header: str, as_json: bool, source: Optional[str], source_key: str = "source",
              width: int = 20) -> None:
    """explain's output: one JSON object (with the rendered source under source_key when asked),
    or the header, one line a field and the source."""
    if as_json:
        click.echo(json.dumps(info if source is None else {**info, source_key: source}))
        return
    click.echo(header)
    for key, value in info.items():
        click.echo(f"  {key:<{width}} {value}")
    if source is not None:
        click.echo(source)


def compile_and_report(kernels, *, spills_fail: bool = False) -> None:
    """NVRTC-compiles each kernel once and prints a row of its resources: `kernels` yields
    (label, arch, make_spec) with make_spec() the spec (planning may compile, so it is called
    here). A compile error prints FAILED with the label; the command exits with 1 after the
    rest, also on a spill where `spills_fail`."""
    seen, failures = set(), 0
    click.echo(f"{'arch':<6} {'kernel':<78} {'regs':>5} {'smem':>6} {'spill':>6} {'stack':>6} {'s':>6}")
    for label, arch, make_spec in kernels:
        try:
            spec = make_spec()
            if (arch, spec) in seen:
                continue
            seen.add((arch, spec))
            report = jit.compile_cubin(spec, arch)
        except jit.CompileError as error:
            failures += 1
            click.echo(f"FAILED {label} ({arch}): {error}", err=True)
            continue
        smem = getattr(spec, "smem_bytes", report.smem_bytes)
        click.echo(f"{arch:<6} {report.name:<78} {report.registers:>5} {smem:>6} {report.spill_bytes:>6} "
                   f"{report.stack_bytes:>6} {report.seconds:>6.2f}")
        failures += spills_fail and report.spill_bytes > 0
    archs = sorted({arch for arch, _ in seen})
    click.echo(f"{len(seen)} kernels compiled for {', '.join(archs) or 'no arch'}, {failures} failed"
               f"{' or spilled' if spills_fail else ''}")
    if failures:
        sys.exit(1)


def tuned_shapes(cols: str, rows: int) -> list:
    """A tune command's --cols (positive row lengths), --rows checked positive."""
    cols_list = int_list(cols)
    if not cols_list or min(cols_list) < 1:
        raise click.BadParameter(f"cols must be positive, got {cols!r}", param_hint="--cols")
    if rows < 1:
        raise click.BadParameter(f"rows must be positive, got {rows}", param_hint="--rows")
    return cols_list


def echo_tuned(tuned, num_bytes: int) -> None:
    """A tuner's report (cupyops.ops.row_candidates.Tuned): each candidate's
    µs and GB/s (or why it dropped out), the winner marked *, and its key."""
    for description, us in tuned.result.timings:
        label = description["label"]
        mark = "*" if description is tuned.result.best else " "
        figures = (f"{us:>9.1f} us {num_bytes / us / 1e3:>7.0f} GB/s" if us is not None
                   else f"failed: {tuned.errors.get(label, 'no timing')}")
        click.echo(f"  {mark} {label:<26} {figures}")
    click.echo(f"  kept {tuned.result.best['label']!r} under {tuned.shape_key}")
