"""cupyops command line: explain, compile, bench, tune (a subcommand per op), info."""
from __future__ import annotations

import os

import click

from cupyops import jit

from . import conv, elementwise, rowwise  # noqa: F401  (register their ops' subcommands)
from . import fused_softmax  # noqa: F401
from . import dask_bench  # noqa: F401  (bench dask)
from . import tune_norm, tune_ship, tune_softmax  # noqa: F401  (tune layer_norm, rms_norm, softmax, ship)
from .common import bench, compile_, explain, tune


@click.group()
@click.version_option(package_name="cupyops", message="cupyops %(version)s")
def main():
    """Fused GPU kernels for CuPy arrays."""


main.add_command(explain)
main.add_command(compile_)
main.add_command(bench)
main.add_command(tune)


@main.command()
def info():
    """Device, CuPy / CUDA / NVRTC versions, kernel cache location and size."""
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    click.echo(f"cupyops       {__import__('cupyops').__version__} (kernels/ {jit.headers_fingerprint()})")
    click.echo(f"cupy          {cupy.__version__}")
    try:
        click.echo(f"nvrtc         {'.'.join(map(str, nvrtc.getVersion()))}")
    except Exception as error:  # NVRTC missing
        click.echo(f"nvrtc         unavailable ({error})")
    if cupy.is_available():
        from cupyops.device import live_facts

        device_id = cupy.cuda.runtime.getDevice()
        facts = live_facts(device_id)
        click.echo(f"device        {device_id}: {facts.name} ({facts.arch}, {facts.sm_count} SMs, "
                   f"L2 {facts.l2_bytes >> 20} MiB)")
        click.echo(f"cuda runtime  {cupy.cuda.runtime.runtimeGetVersion()}")
        click.echo(f"cuda driver   {cupy.cuda.runtime.driverGetVersion()}")
    else:
        click.echo("device        none (no usable GPU)")
    cache_dir = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    size = count = 0
    for root, _, files in os.walk(cache_dir):
        for name in files:
            count += 1
            size += os.path.getsize(os.path.join(root, name))
    click.echo(f"kernel cache  {cache_dir} ({count} files, {size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
