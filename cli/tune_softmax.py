"""`cupyops tune softmax`: time every candidate row plan of the softmax family
(cupyops.ops.softmax_candidates) on the live GPU and keep the winners in the
tuning table, which policy="auto" then plans those shapes from."""
from __future__ import annotations

import click

from cupyops import dtypes
from cupyops.ops.softmax_rows import OPS

from .common import dtype_option, echo_tuned, live_device, tuned_shapes
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
    cols_list = tuned_shapes(cols, rows)
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
            echo_tuned(tuned, moved_bytes(op, short, rows, num_cols))
    click.echo(f"tuning table: {table.path}")
