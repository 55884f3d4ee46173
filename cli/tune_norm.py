"""`cupyops tune layer_norm` / `rms_norm` and their `_backward`: time every
candidate plan (cupyops.ops.norm_candidates, norm_grad_candidates) on the
live GPU and keep the winners in the tuning table, which policy="auto" then
plans those shapes from."""
from __future__ import annotations

import click

from cupyops import dtypes

from .common import dtype_option, echo_tuned, live_device, tuned_shapes
from .common import tune as tune_group
from .rowwise import DEFAULT_COLS, DEFAULT_ROWS


def _shape_options(command):
    """--dtype, --cols and --rows, as every norm tune command takes them."""
    command = click.option("--rows", default=DEFAULT_ROWS, show_default=True, type=int,
                           help="Rows timed; the winner serves every row count that rounds up to the same "
                                "power of two.")(command)
    command = click.option("--cols", default=DEFAULT_COLS, show_default=True,
                           help="Comma-separated row lengths.")(command)
    return dtype_option(command)


def _tune_shapes(op: str, dtype, cols: str, rows: int, tune_one, what: str = "") -> None:
    """Tunes each of --cols by tune_one(short dtype, cols, device id, table) -> (Tuned, bytes moved)."""
    from cupyops import tune

    cols_list = tuned_shapes(cols, rows)
    device_id = live_device("tune times the live GPU, and no GPU is usable here")
    short = dtypes.NAMES[dtype]
    table = tune.default_table()
    for num_cols in cols_list:
        click.echo(f"{op} {dtype} {rows} x {num_cols}{what}")
        echo_tuned(*tune_one(short, num_cols, device_id, table))
    click.echo(f"tuning table: {table.path}")


def _tune_command(op: str):
    @_shape_options
    @click.option("--residual", is_flag=True, help="Time calls with a residual (h = x + residual normalised).")
    def command(dtype, cols, rows, residual):
        from cupyops.ops.norm_tune import moved_bytes, tune_shape

        def tune_one(short, num_cols, device_id, table):
            return (tune_shape(op, short, rows, num_cols, device_id, residual, table),
                    moved_bytes(short, rows, num_cols, residual))

        _tune_shapes(op, dtype, cols, rows, tune_one, " with a residual" if residual else "")

    command.__doc__ = (f"Time every candidate forward plan of {op} (weight{' and bias' if op == 'layer_norm' else ''}"
                       f", a residual with --residual) on the live GPU, each checked against a float64 "
                       f"reference first, and keep the fastest in the tuning table.")
    return tune_group.command(name=op)(command)


def _tune_backward_command(op: str):
    grads = "dweight and dbias" if op.startswith("layer_norm") else "dweight"

    @_shape_options
    @click.option("--no-param-grad", "param_grad", flag_value=False, default=True,
                  help=f"Time calls that want dx alone (no {grads}).")
    def command(dtype, cols, rows, param_grad):
        from cupyops.ops.norm_grad_tune import moved_bytes, tune_shape

        def tune_one(short, num_cols, device_id, table):
            return (tune_shape(op, short, rows, num_cols, device_id, param_grad, table),
                    moved_bytes(short, rows, num_cols))

        _tune_shapes(op, dtype, cols, rows, tune_one, "" if param_grad else " without parameter gradients")

    command.__doc__ = (f"Time every candidate backward plan of {op} (with the weight; dx and {grads}, dx alone "
                       f"with --no-param-grad) on the live GPU, each checked against a float64 reference "
                       f"first, and keep the fastest in the tuning table.")
    return tune_group.command(name=op)(command)


for _op in ("layer_norm", "rms_norm"):
    _tune_command(_op)
    _tune_backward_command(f"{_op}_backward")
