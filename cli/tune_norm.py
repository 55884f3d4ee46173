"""`cupyops tune layer_norm` / `rms_norm`: time every candidate forward plan
(cupyops.ops.norm_candidates) on the live GPU and keep the winners in the
tuning table, which policy="auto" then plans those shapes from."""
from __future__ import annotations

import click

from cupyops import dtypes

from .common import dtype_option, echo_tuned, live_device, tuned_shapes
from .common import tune as tune_group
from .rowwise import DEFAULT_COLS, DEFAULT_ROWS


def _tune_command(op: str):
    @dtype_option
    @click.option("--cols", default=DEFAULT_COLS, show_default=True, help="Comma-separated row lengths.")
    @click.option("--rows", default=DEFAULT_ROWS, show_default=True, type=int,
                  help="Rows timed; the winner serves every row count that rounds up to the same power of two.")
    @click.option("--residual", is_flag=True, help="Time calls with a residual (h = x + residual normalised).")
    def command(dtype, cols, rows, residual):
        from cupyops import tune
        from cupyops.ops.norm_tune import moved_bytes, tune_shape

        cols_list = tuned_shapes(cols, rows)
        device_id = live_device("tune times the live GPU, and no GPU is usable here")
        short = dtypes.NAMES[dtype]
        table = tune.default_table()
        for num_cols in cols_list:
            click.echo(f"{op} {dtype} {rows} x {num_cols}{' with a residual' if residual else ''}")
            tuned = tune_shape(op, short, rows, num_cols, device_id, residual, table)
            echo_tuned(tuned, moved_bytes(short, rows, num_cols, residual))
        click.echo(f"tuning table: {table.path}")

    command.__doc__ = (f"Time every candidate forward plan of {op} (weight{' and bias' if op == 'layer_norm' else ''}"
                       f", a residual with --residual) on the live GPU, each checked against a float64 "
                       f"reference first, and keep the fastest in the tuning table.")
    return tune_group.command(name=op)(command)


for _op in ("layer_norm", "rms_norm"):
    _tune_command(_op)
