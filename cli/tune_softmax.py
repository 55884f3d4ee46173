"""`cupyops tune softmax`: time every candidate row plan of the softmax family
(cupyops.ops.softmax_candidates) on the live GPU and keep the winners in the
tuning table, which policy="auto" then plans those shapes from."""
from __future__ import annotations

import click

from cupyops import dtypes
from cupyops.ops.softmax_rows import OPS

from .common import dtype_option, int_list, live_device
from .common import tune as tune_group
from .rowwise import DEFAULT_COLS, DEFAULT_ROWS


def _ops(text: str) -> list:
    found = [op.strip() for op in text.split(",") if op.strip()]
    unknown = sorted(set(found) - set(OPS))
    if unknown or not found:
        raise click.BadParameter(f"unknown op(s) {unknown or [text]}; known: {', '.join(OPS)}", param_hint="--op")
    return found


@tune_group.command(name="softmax")
@dtype_option
@click.option("--cols", default=DEFAULT_COLS, show_default=True, help="Comma-separated row lengths.")
@click.option("--rows", default=DEFAULT_ROWS, show_default=True, type=int,
              help="Rows timed; the winner serves every row count that rounds up to the same power of two.")
@click.option("--op", "ops", default="softmax", show_default=True,
              help=f"Comma-separated ops among {', '.join(OPS)}.")
def tune_softmax(dtype, cols, rows, ops):
    """Time every candidate plan of the softmax ops' rows (reduced axis last) on the live GPU,
    each checked against a float64 reference first, and keep the fastest in the tuning table."""
    from cupyops import tune
    from cupyops.ops.softmax_tune import moved_bytes, tune_shape

    ops = _ops(ops)
    cols_list = int_list(cols)
    if not cols_list or min(cols_list) < 1:
        raise click.BadParameter(f"cols must be positive, got {cols!r}", param_hint="--cols")
    if rows < 1:
        raise click.BadParameter(f"rows must be positive, got {rows}", param_hint="--rows")
    device_id = live_device("tune times the live GPU, and no GPU is usable here")
    short = dtypes.NAMES[dtype]
    table = tune.default_table()
    for op in ops:
        for num_cols in cols_list:
            click.echo(f"{op} {dtype} {rows} x {num_cols}")
            tuned = tune_shape(op, short, rows, num_cols, device_id, table)
            if tuned is None:
                click.echo("  rows split across blocks (softmax_split): no row plan to tune")
                continue
            num_bytes = moved_bytes(op, short, rows, num_cols)
            for description, us in tuned.result.timings:
                label = description["label"]
                mark = "*" if description is tuned.result.best else " "
                figures = (f"{us:>9.1f} us {num_bytes / us / 1e3:>7.0f} GB/s" if us is not None
                           else f"failed: {tuned.errors.get(label, 'no timing')}")
                click.echo(f"  {mark} {label:<26} {figures}")
            click.echo(f"  kept {tuned.result.best['label']!r} under {tuned.shape_key}")
    click.echo(f"tuning table: {table.path}")
