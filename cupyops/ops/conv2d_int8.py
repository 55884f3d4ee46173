"""int8 convolution on tensor cores by implicit GEMM, NCHW32 (SPEC §7):
plan (cupyops/ops/conv_plan.py: default rule, or measured here) -> launch -> public function.

Two policies share one loader and one epilogue (kernels/conv_int8.cuh):
- "megengine": MegEngine's kernel, mma.sync m8n8k16, two stages through
  registers, threadblock 128x128x64 and warp 64x64x64 (smaller tiles from
  MegEngine's list where K is small).
- "auto": on sm_90 (compute capability 9.0 exactly: sm_90a code runs nowhere
  else) wgmma m64nNk32 from the shared stages, warpgroups of 64 x N; elsewhere
  mma.sync m16n8k32 (sm_80 and newer). Both with a cp.async pipeline of 3-8
  stages (wgmma's of 64- or 128-byte GEMM_K steps); on sm_90 also warp-specialised
  wgmma whose producer warpgroup has the copy engine bring the filter and
  copies the pixels by cp.async, or has the engine bring both (im2col tensor
  maps, cupyops/ops/conv_tma.py), or holds whole input rows for a filter's
  taps (halo tiles, cupyops/ops/conv_halo.py); the tile tables and the
  candidates are in cupyops/ops/conv_plan.py. The configuration comes from the measured
  tuner (cupyops.tune) or else the default rule, split-K (int32 partials summed
  by a second kernel that applies the epilogue) where the tiles of N * OH * OW
  leave SMs idle; on sm_90 also pairs of blocks on one tile, each summing half
  its GEMM_K, the pair's sums exchanged in distributed shared memory.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Optional

import numpy

from .. import arrays, callcache, device, jit, tensor_map, tune
from ..callcache import CallCache, call_key, run_on, writable
from ..launch import LaunchCache, Target, live_function
from ..packed import POINTER, PackedLaunch
from ..profile import profile_for
from . import conv_layout, conv_tma
from .conv_layout import INTERLEAVE, OUT_KINDS, ConvGeometry
from .conv_plan import OP, REDUCE_THREADS, ConvInt8Spec, ConvPlan, SplitReduceSpec, candidates, plan, plan_from

POLICIES = ("auto", "megengine")
SM_MAX_THREADS = 2048
SM_REGISTERS = 65536
MAPS_CACHED = 64             # pairs of array addresses a ReadyConv keeps tensor maps for
MAP_BYTES = f"{tensor_map.MAP_DTYPE.itemsize}s"   # a tensor map argument, packed per pair of addresses


# -- launch -------------------------------------------------------------------

@dataclass(frozen=True)
class Epilogue:
    """What the epilogue applies (kernel_params' keyword arguments, less the split)."""
    out_dtype: str = "int8"
    bias_kind: Optional[str] = None
    relu: bool = False
    has_z: bool = False
    alpha_per_channel: bool = False
    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 0.0


@functools.lru_cache(maxsize=1024)
def _params(geometry: ConvGeometry, splits: int, steps_per_split: int, epilogue: Epilogue) -> numpy.ndarray:
    """The kernel's parameter block, built once per shape and epilogue (read-only)."""
    params = conv_layout.kernel_params(geometry, splits=splits, steps_per_split=steps_per_split, **asdict(epilogue))
    params.flags.writeable = False
    return params


class ReadyConv:
    """A plan bound to one epilogue on one GPU: its compiled kernels with their grids and
    parameter blocks packed (packed.PackedLaunch: the parameter block is copied into the
    launch's arguments once) and (persistent kernels) tensor maps per pair of array
    addresses, so that calling it, ready(x, w, y, z, alpha_vec, bias), only launches."""
    __slots__ = ("main", "maps", "chosen", "reduce")

    def __init__(self, chosen: ConvPlan, epilogue: Epilogue, device_id: int):
        spec, g = chosen.spec, chosen.geometry
        self.chosen = chosen
        function = live_function(spec, device_id, spec.smem_bytes)
        grid = chosen.grid
        # persistent kernels: as many blocks as the GPU holds at once, each walking tiles and splits;
        # blocks splitting GEMM_K in a cluster: one job a cluster, the grid all of them
        self.maps = {} if spec.tma else None
        if spec.tma:
            blocks = grid[0] * grid[2]
            if spec.k_blocks == 1:
                blocks = min(blocks, _resident_blocks(spec, device_id) // spec.cluster * spec.cluster)
            grid = (blocks, 1, 1)
        params = _params(g, chosen.splits, 0, epilogue)   # the reduction's, where GEMM_K is split
        self.reduce = None
        main_params = params
        if chosen.splits > 1:   # int32 partials, then the reduction applies the epilogue
            facts = Target.live(device_id).facts
            tuned = profile_for(facts)
            groups = -(-g.n * g.k * g.oh * g.ow // 8)   # 8 output channels a thread
            blocks = min(-(-groups // REDUCE_THREADS), facts.sm_count * tuned.CONV_REDUCE_BLOCKS_PER_SM)
            main_params = _params(g, chosen.splits, chosen.steps_per_split, replace(epilogue, out_dtype="int32"))
            self.reduce = (PackedLaunch(live_function(SplitReduceSpec(), device_id), (blocks,), (REDUCE_THREADS,), 0,
                                        (POINTER,) * 5 + (params,)), (chosen.splits, *g.output_shape))
        # the tensor maps over x and w (persistent kernels), then x or w, y, z, alpha and bias
        operands = (MAP_BYTES,) * 2 + (POINTER,) if spec.tma else (POINTER,) * 2
        self.main = PackedLaunch(function, grid, chosen.block, spec.smem_bytes,
                                 operands + (POINTER,) * 4 + (main_params,))

    def operands(self, x, w) -> tuple:
        """The kernel's first arguments: the addresses of x and w, or the tensor maps over
        them and the address of x."""
        key = (x.data.ptr, w.data.ptr)
        if self.maps is None:
            return key
        found = self.maps.get(key)
        if found is None:
            if len(self.maps) >= MAPS_CACHED:
                self.maps.clear()
            maps = conv_tma.maps(self.chosen.geometry, self.chosen.spec, *key)
            found = self.maps[key] = (*(m.tobytes() for m in maps), key[0])
        return found

    def __call__(self, x, w, y, z, alpha_vec, bias) -> None:
        epilogue = (0 if z is None else z.data.ptr, 0 if alpha_vec is None else alpha_vec.data.ptr,
                    0 if bias is None else bias.data.ptr)
        if self.maps is None and self.reduce is None:
            self.main((x.data.ptr, w.data.ptr, y.data.ptr, *epilogue))
            return
        operands = self.operands(x, w)
        if self.reduce is None:
            self.main((*operands, y.data.ptr, *epilogue))
            return
        import cupy

        reduce, partials_shape = self.reduce
        partials = cupy.empty(partials_shape, dtype=numpy.int32)
        self.main((*operands, partials.data.ptr, 0, 0, 0))
        reduce((partials.data.ptr, y.data.ptr, *epilogue))


def launch(chosen: ConvPlan, x, w, y, z, alpha_vec, bias, epilogue: Epilogue) -> None:
    """Runs `chosen` on the current device and stream: y = conv(x, w) with the epilogue."""
    ReadyConv(chosen, epilogue, x.device.id)(x, w, y, z, alpha_vec, bias)


@functools.lru_cache(maxsize=256)
def _resident_blocks(spec: ConvInt8Spec, device_id: int) -> int:
    """Blocks of `spec` the GPU holds at once: its SMs times the blocks an SM fits by
    shared memory (each with the driver's reserve), registers (per warp, in 256s) and threads."""
    facts = Target.live(device_id).facts
    raw = jit.kernel(spec, device_id)
    smem_per_sm = facts.smem_per_block_optin + device.BLOCK_RESERVED_SMEM
    by_smem = smem_per_sm // (spec.smem_bytes + raw.shared_size_bytes + device.BLOCK_RESERVED_SMEM)
    warp_registers = -(-raw.num_regs * 32 // 256) * 256
    by_registers = SM_REGISTERS // (warp_registers * spec.threads_per_block // 32)
    return facts.sm_count * max(1, min(by_smem, by_registers, SM_MAX_THREADS // spec.threads_per_block))


_plans = LaunchCache()


def _time_candidate(geometry: ConvGeometry, arch: str, arrays_: tuple, timer):
    """A timing callable for the tuner: the median microseconds of one candidate by `timer`."""
    x, w, y = arrays_

    def time_us(candidate: dict) -> float:
        ready = ReadyConv(plan_from(geometry, candidate, arch, "measuring"), Epilogue(), x.device.id)
        return timer.time(lambda: ready(x, w, y, None, None, None)).median_us
    return time_us


def tune_shape(geometry: ConvGeometry, device_id: int, table: Optional[tune.TuningTable] = None) -> tune.Result:
    """Times every candidate of `geometry` on GPU `device_id` and keeps the winner."""
    import cupy

    from ..bench import Timer

    geometry.check()
    target = Target.live(device_id)
    facts = target.facts
    with cupy.cuda.Device(device_id):
        # random bytes, as real inputs: the tensor cores draw more power on them than on
        # constant ones, and the clock a kernel keeps depends on it
        rng = cupy.random.default_rng(0)
        x = rng.integers(-128, 128, (geometry.n, geometry.c // INTERLEAVE, geometry.h, geometry.w, INTERLEAVE),
                         dtype=numpy.int8)
        w = rng.integers(-128, 128, (geometry.k, geometry.c // INTERLEAVE, geometry.r, geometry.s, INTERLEAVE),
                         dtype=numpy.int8)
        y = cupy.empty(geometry.output_shape, numpy.int8)
        found = candidates(geometry, facts.sm_count, facts.smem_per_block_optin, facts.arch)
        jit.precompile([plan_from(geometry, c, facts.arch, "measuring").spec for c in found], facts.arch, device_id)
        # screened by three runs each, the closest to the fastest timed in full
        timer = Timer(min_reps=5, max_reps=50, budget_s=0.05)
        return tune.tune(table or tune.default_table(), tune.DeviceKey.live(device_id), OP, geometry.key(),
                         found, _time_candidate(geometry, facts.arch, (x, w, y), timer),
                         _time_candidate(geometry, facts.arch, (x, w, y), timer.with_reps(3, 3)))


def live_plan(geometry: ConvGeometry, policy: str, device_id: int) -> ConvPlan:
    """The plan on GPU `device_id`: from the tuning table where it was tuned among the
    candidates offered now, else tuned now on first use (unless CUPYOPS_AUTOTUNE=0), else
    by the default rule; memoised per process."""
    def make():
        target = Target.live(device_id)
        if policy != "auto":
            return plan(geometry, policy, target)
        geometry.check()
        device, facts = tune.DeviceKey.live(device_id), target.facts
        offered = candidates(geometry, facts.sm_count, facts.smem_per_block_optin, facts.arch)
        tuned = tune.default_table().lookup(device, OP, geometry.key(), tune.space_of(offered))
        if tuned is None and tune.autotune_enabled():
            tuned = tune_shape(geometry, device_id).best
        return plan(geometry, policy, target, tuned)
    return _plans.get((geometry, policy, device_id), make)


# -- public function ----------------------------------------------------------

# Whole calls per layout of their arrays (callcache.call_key): a repeated call costs a
# key, a lookup, its output and its launches. Each entry: (ReadyConv, output shape, dtype).
_calls = CallCache()


def _writes_directly(out, x, w, bias, z, alpha_vec) -> bool:
    """Whether the kernel may write `out` itself: it overlaps none of x, w, bias and alpha_vec
    (other blocks still read them), and z only by holding z's very elements (each z element
    is read by the thread that then writes that element; callcache.writable)."""
    return writable(out, (x, w, bias, alpha_vec), in_place=False) and writable(out, (z,))


def _replay(ready: tuple, x, w, bias, z, alpha_vec, out):
    """The ready call's result: into out where the kernel may write it, else computed into a
    fresh array and copied into out."""
    launch, shape, dtype = ready
    direct = out is not None and _writes_directly(out, x, w, bias, z, alpha_vec)
    y = out if direct else callcache.empty(shape, dtype)
    launch(x, w, y, z, alpha_vec, bias)
    return callcache.delivered(y, out)


def conv2d_int8(x, w, bias=None, z=None, *, stride=1, padding=0, dilation=1, alpha=1.0, beta=1.0,
                gamma=0.0, relu=False, out_dtype="int8", out=None, policy="auto", stream=None):
    """int8 convolution on tensor cores: y = alpha * conv(x, w) + beta * bias + gamma * z, then ReLU.

    x: int8 NCHW32 (N, C/32, H, W, 32) (see :func:`to_nchw32`); w: the packed
    filter from :func:`pack_conv_filter`; bias: float32 or int32 (K,); z: int8
    NCHW32 like the output; alpha: a float or a float32 (K,) vector (per-channel
    scales). The output is NCHW32 (N, K/32, OH, OW, 32): "int8" rounds half to
    even and saturates, "float16" / "float32" keep the epilogue's value,
    "int32" returns the raw accumulators (no epilogue). On dequantised values
    this is ``torch.nn.functional.conv2d(x, w, stride=stride, padding=padding,
    dilation=dilation)`` scaled by alpha, plus bias and z, then ReLU. `out` may be z
    itself or a view of its very elements (the residual updated in place); an out
    overlapping x, w, bias or alpha gets the result through a fresh array.
    policy: "auto" (the tuned or default-rule plan: wgmma on sm_90, fed by cp.async
    or, where the tuner finds it faster, by a producer warpgroup and the copy engine,
    for stride 1 also from whole input rows held for a filter's taps; mma.sync
    m16n8k32 elsewhere) or "megengine" (MegEngine's kernel, for comparison). A
    repeated call with arrays of the same layout replays its launch."""
    vector = None if type(alpha) is float else alpha if hasattr(alpha, "__cuda_array_interface__") else None
    key = call_key((policy, out_dtype, stride, padding, dilation, relu, beta, gamma, alpha if vector is None else None),
                   (x, w, bias, z, out, vector))
    ready = _calls.find(key)
    if ready is not None:
        if stream is None and (out is None or _writes_directly(out, x, w, bias, z, vector)):
            launch, shape, dtype = ready
            y = callcache.empty(shape, dtype) if out is None else out
            launch(x, w, y, z, vector, bias)
            return y
        return run_on(stream, _replay, ready, x, w, bias, z, vector, out)
    given = (x, w, bias, z, alpha)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if out_dtype not in OUT_KINDS:
        raise ValueError(f"out_dtype must be one of {tuple(OUT_KINDS)}, got {out_dtype!r}")
    x = conv_layout.nchw32_operand(x, "x", "expected int8 NCHW32 (N, C/32, H, W, 32): convert with "
                                   "cupyops.to_nchw32")
    w = conv_layout.nchw32_operand(w, "w", "expected the packed (K, C/32, R, S, 32) filter: "
                                   "cupyops.pack_conv_filter")
    device_id = x.device.id
    if w.device.id != device_id:
        raise ValueError(f"w is on GPU {w.device.id}, x on GPU {device_id}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has {w.shape[1] * INTERLEAVE} input channels, x {x.shape[1] * INTERLEAVE}")
    n, c32, h, width, _ = x.shape
    k, _, r, s, _ = w.shape
    geometry = ConvGeometry(n, c32 * INTERLEAVE, h, width, k, r, s, conv_layout.pair(stride, "stride"),
                            conv_layout.pair(padding, "padding"), conv_layout.pair(dilation, "dilation"))
    geometry.check()
    alpha_per_channel = numpy.ndim(alpha) > 0 or hasattr(alpha, "__cuda_array_interface__")
    raw = out_dtype == "int32"
    if raw and (bias is not None or z is not None or relu or alpha_per_channel or alpha != 1.0):
        raise ValueError('out_dtype="int32" returns the raw accumulators: give no alpha, bias, z or relu')
    alpha_vec = None
    if alpha_per_channel:
        alpha_vec = conv_layout.channel_vector(alpha, "alpha", k, (numpy.float32,), device_id)
    if bias is not None:
        bias = conv_layout.channel_vector(bias, "bias", k, (numpy.float32, numpy.int32), device_id)
    if z is not None:
        z = conv_layout.nchw32_operand(z, "z", f"expected the output's shape {geometry.output_shape}")
        if z.shape != geometry.output_shape:
            raise ValueError(f"z has shape {z.shape}, expected the output's {geometry.output_shape}")
        if z.device.id != device_id:
            raise ValueError(f"z is on GPU {z.device.id}, x on GPU {device_id}")
    out = conv_layout.check_out(out, geometry.output_shape, numpy.dtype(out_dtype), device_id)
    epilogue = Epilogue(out_dtype, None if bias is None else bias.dtype.name, bool(relu), z is not None,
                        alpha_per_channel, 1.0 if alpha_per_channel else float(alpha), float(beta), float(gamma))
    with arrays.on_device(x, stream):
        ready = (ReadyConv(live_plan(geometry, policy, device_id), epilogue, device_id), geometry.output_shape,
                 numpy.dtype(out_dtype))
        y = _replay(ready, x, w, bias, z, alpha_vec, out)
    if all(a is b for a, b in zip((x, w, bias, z, alpha_vec if alpha_per_channel else alpha), given)):
        _calls.remember(key, ready)   # the arrays were used as given: a call of this layout may skip the checks
    return y
