"""What every tuning script does around its candidates: the live target, a
timer, the copy ceiling measured once (printed as the output's header), and
each candidate run once on a NaN-filled output and checked before it is timed,
so a fast wrong kernel cannot win."""
from __future__ import annotations

import cupy

from cupyops import bench
from cupyops.device import live_facts
from cupyops.launch import Target


class Tuning:
    def __init__(self, budget_s: float):
        self.device_id = cupy.cuda.runtime.getDevice()
        self.target = Target.live(self.device_id)
        self.timer = bench.Timer(budget_s=budget_s)
        self.copy_gbs = bench.copy_ceiling_gbs(self.timer)
        print(f"# {live_facts(self.device_id).name}; copy ceiling {self.copy_gbs:.0f} GB/s")

    def measure(self, run, out, error_of, num_bytes: int):
        """(median µs, GB/s, fraction of copy, error): `run` once on `out`
        filled with NaN, `error_of(out)` its error, then `run` timed."""
        out.fill(float("nan"))
        run()
        error = error_of(out)
        timing = self.timer.time(run)
        gbs = bench.gbs(num_bytes, timing)
        return timing.median_us, gbs, gbs / self.copy_gbs, error
