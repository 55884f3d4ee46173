"""`cupyops tune ship`: copy the tuning table's winners measured on GPUs of a
device profile into the table the package ships for it
(cupyops/profiles/tuned_<profile>.json), those that differ from the rule's plan."""
from __future__ import annotations

from pathlib import Path

import click

from cupyops import tune
from cupyops.ops import row_candidates
from cupyops.ops.fused_softmax import TUNED_OPS as FUSED_SOFTMAX_OPS
from cupyops.ops.norm_spec import BACKWARD_OPS, FORWARD_OPS
from cupyops.ops.softmax_rows import OPS as SOFTMAX_OPS
from cupyops.profile import PROFILE_NAMES

from .common import tune as tune_group

# The ops whose planners read the shipped tables (row_candidates.stored_winner).
SHIPPED_OPS = SOFTMAX_OPS + FORWARD_OPS + BACKWARD_OPS + tuple(FUSED_SOFTMAX_OPS.values())


def _keep(op: str, best: dict) -> bool:
    """A winner worth shipping: a row op's, not the rule's own plan."""
    return op in SHIPPED_OPS and not row_candidates.is_rule(best)


@tune_group.command(name="ship")
@click.option("--profile", "profile_name", required=True, type=click.Choice(PROFILE_NAMES),
              help="Device profile whose shipped table is written.")
@click.option("--table", "table_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Tuning table to read (default: the one beside CuPy's kernel cache).")
def ship(profile_name, table_path):
    """Write the tuning table's winners measured on GPUs of PROFILE (their name names it) into
    the package's cupyops/profiles/tuned_PROFILE.json, keeping only those that differ from the
    rule's plan; policy="auto" then plans those shapes from it on such GPUs and profile targets."""
    if table_path is not None and not table_path.is_file():
        raise click.BadParameter(f"no such file: {table_path}", param_hint="--table")
    table = tune.TuningTable(table_path) if table_path is not None else tune.default_table()
    plans = tune.ship(table, profile_name, _keep)
    for key, entry in plans.items():
        click.echo(f"  {key}: {entry['best']['label']!r} {entry['us']:.1f} us on {entry['measured_on']}")
    click.echo(f"{len(plans)} shipped plans in {tune.shipped_path(profile_name)} (from {table.path})")
