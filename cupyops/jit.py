"""Spec -> readable name -> Jinja2 source -> NVRTC (through CuPy and its disk cache).

Each kernel family describes one instantiation with a frozen dataclass
deriving from KernelSpec. Its `name` is the kernel symbol, the cache key and
the label in logs and benchmarks. `kernel(spec)` returns a memoised
cupy.RawKernel; `compile_cubin(spec, arch)` compiles without a GPU and
reports registers, shared memory and spills from the ptxas log; `precompile`
compiles many kernels at once, in threads.

A spec whose `arch_specific` is true (wgmma needs sm_90a) is compiled for the
arch-specific target, e.g. "sm_90a", which runs on that compute capability
alone. CuPy's RawKernel cannot ask NVRTC for it, so such kernels are compiled
here to a cubin, cached on disk beside CuPy's kernel cache and loaded with the
driver (CubinKernel, launched like a RawKernel's function).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import threading
import uuid
from pathlib import Path
from typing import ClassVar, Optional

import jinja2

# where resource_dir looks, found without importing the package (its
# __init__ imports this module)
_PACKAGE_DIR = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """kernels/ or templates/: inside the installed package, or beside it in a checkout."""
    for root in (_PACKAGE_DIR, _PACKAGE_DIR.parent):
        candidate = root / name
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cupyops resource folder {name!r} not found")


@functools.lru_cache(maxsize=None)
def headers_fingerprint() -> str:
    """Hash of every header in kernels/: part of each source, so CuPy's cache
    (keyed on the source text) never reuses a binary built from older headers."""
    digest = hashlib.sha256()
    for path in sorted(resource_dir("kernels").glob("*.cuh")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


class KernelSpec:
    """Base of the frozen dataclasses that name one kernel instantiation."""

    template: ClassVar[str]

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def threads_per_block(self) -> int:
        raise NotImplementedError

    @property
    def arch_specific(self) -> bool:
        """Whether the kernel needs the arch-specific target ("sm_90a" for "sm_90")."""
        return False

    def template_args(self) -> dict:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def explain_extra(self) -> dict:
        """Fields of this family that `cupyops explain` shows besides the common ones."""
        return {}


def render(spec: KernelSpec) -> str:
    """The complete CUDA translation unit for `spec`."""
    template = _environment().get_template(spec.template)
    return template.render(name=spec.name, fingerprint=headers_fingerprint(),
                           threads_per_block=spec.threads_per_block, **spec.template_args())


# Options CuPy adds to every RawKernel compile: the CPU path adds them too, so
# its register counts describe the binaries that run.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def compile_options() -> tuple:
    return ("-std=c++17", f"-I{resource_dir('kernels')}")


def target_arch(spec: KernelSpec, arch: str) -> str:
    """The arch NVRTC compiles `spec` for: `arch` ("sm_90"), or its arch-specific
    variant ("sm_90a") where the spec needs one."""
    return f"{arch}a" if spec.arch_specific else arch


_kernels: dict = {}
_kernels_lock = threading.Lock()


def kernel(spec: KernelSpec, device_id: int):
    """The cupy.RawKernel of `spec` for GPU `device_id` (compiled on first launch, then memoised)."""
    key = (spec, device_id)
    found = _kernels.get(key)
    if found is None:
        import cupy

        with _kernels_lock:
            found = _kernels.get(key)
            if found is None:
                if spec.arch_specific:
                    found = CubinKernel.load(spec, device_id)
                else:
                    found = cupy.RawKernel(render(spec), spec.name, options=compile_options(),
                                           backend="nvrtc")
                _kernels[key] = found
    return found


# NVRTC compiles at once in precompile: one a core the process may run on, and at most this
# many, since each compile holds its own working memory.
PRECOMPILE_THREADS = 16


def precompile(specs, arch: str, device_id: Optional[int] = None) -> None:
    """Compiles the arch-specific kernels among `specs` for `arch` (e.g. "sm_90") into
    the disk cache several at once (NVRTC runs outside the GIL), so that their first
    launches only load them: a tuner about to time many candidates calls it first.
    With `device_id`, the other kernels too (CuPy's RawKernel for that GPU, its disk
    cache); without, they compile on first launch, as always. A kernel that fails to
    compile here fails again, with its error, at that launch."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    todo = list(dict.fromkeys(spec for spec in specs if spec.arch_specific or device_id is not None))
    if not todo:
        return

    def compile_one(spec: KernelSpec) -> None:
        if spec.arch_specific:
            try:
                cached_cubin(spec, target_arch(spec, arch))
            except CompileError:
                pass
            return
        import cupy
        from cupy.cuda.compiler import CompileException

        try:
            with cupy.cuda.Device(device_id):
                kernel(spec, device_id).compile()
        except CompileException:
            pass

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(len(todo), cores, PRECOMPILE_THREADS)) as pool:
        list(pool.map(compile_one, todo))


class CubinKernel:
    """An arch-specific kernel of one GPU: NVRTC's cubin (cached on disk), loaded
    with the driver. Offers what launchers use of a cupy.RawKernel: `kernel` (the
    function to launch), register / shared / local sizes and the dynamic shared
    memory opt-in."""

    CACHE_FOLDER = "cupyops_cubin"

    def __init__(self, module, function, device_id: int):
        self._module = module            # keeps the module loaded
        self.kernel = function
        self.device_id = device_id

    @classmethod
    def load(cls, spec: KernelSpec, device_id: int) -> "CubinKernel":
        import cupy

        device = cupy.cuda.Device(device_id)
        with device:
            arch = target_arch(spec, f"sm_{device.compute_capability}")   # compute_capability: "90"
            module = cupy.cuda.function.Module()
            module.load(cached_cubin(spec, arch))
            return cls(module, module.get_function(spec.name), device_id)

    def _attribute(self, name: str) -> int:
        """The driver's CU_FUNC_ATTRIBUTE_<name> of the function."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            return cupy.cuda.driver.funcGetAttribute(getattr(cupy.cuda.driver, f"CU_FUNC_ATTRIBUTE_{name}"),
                                                     self.kernel.ptr)

    num_regs = property(lambda self: self._attribute("NUM_REGS"))
    shared_size_bytes = property(lambda self: self._attribute("SHARED_SIZE_BYTES"))
    local_size_bytes = property(lambda self: self._attribute("LOCAL_SIZE_BYTES"))

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES")

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device_id):
            cupy.cuda.driver.funcSetAttribute(
                self.kernel.ptr, cupy.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(value))


def _whole_elf(cubin: bytes) -> bytes:
    """`cubin` as long as its ELF header says: CuPy's getCUBIN drops the last byte (a
    NUL, taken for a string terminator), which loads only because a Python bytes
    object ends in a NUL in memory; the file kept on disk is the whole ELF."""
    import struct

    ph_offset, sh_offset = struct.unpack_from("<QQ", cubin, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)
    return cubin + bytes(max(0, end - len(cubin)))


def cached_cubin(spec: KernelSpec, arch: str) -> bytes:
    """NVRTC's cubin of `spec` for `arch` (e.g. "sm_90a"), from the disk cache beside
    CuPy's (keyed by the rendered source, arch, options and NVRTC version) or compiled now."""
    import os

    from cupy_backends.cuda.libs import nvrtc

    from .tune import cache_dir

    source = render(spec)
    options = [f"--gpu-architecture={arch}", *compile_options(), *CUPY_ADDED_OPTIONS]
    digest = hashlib.sha256("\0".join([source, *options, repr(nvrtc.getVersion())]).encode()).hexdigest()
    path = cache_dir() / CubinKernel.CACHE_FOLDER / f"{spec.name}_{digest[:32]}.cubin"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    cubin = _whole_elf(_nvrtc(spec, arch, source, options, lambda nvrtc_, program: nvrtc_.getCUBIN(program)))
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    scratch.write_bytes(cubin)
    scratch.replace(path)
    return cubin


@dataclasses.dataclass(frozen=True)
class CompileReport:
    name: str
    arch: str
    registers: int
    smem_bytes: int          # static shared memory
    spill_bytes: int         # spill stores + spill loads
    stack_bytes: int
    cubin_bytes: int
    seconds: float


class CompileError(RuntimeError):
    pass


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "smem_bytes": re.compile(r"(\d+) bytes smem"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _ptxas_number(log: str, key: str) -> int:
    match = _PTXAS[key].search(log)
    return int(match.group(1)) if match else 0


def _nvrtc(spec: KernelSpec, arch: str, source: str, options: list, fetch):
    """NVRTC-compiles `source`: fetch(nvrtc, program) of the compiled program."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, f"{spec.name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise CompileError(f"{spec.name} ({arch}): {error}\n{nvrtc.getProgramLog(program)}") from None
        return fetch(nvrtc, program)
    finally:
        nvrtc.destroyProgram(program)


def _compile_with_log(spec: KernelSpec, arch: str, source: str, options: list) -> tuple:
    """NVRTC-compiles `source`: (ptxas log of the entry function, cubin)."""
    return _nvrtc(spec, arch, source, options, lambda nvrtc, program: (
        _entry_log(nvrtc.getProgramLog(program), spec.name), nvrtc.getCUBIN(program)))


def _entry_log(log: str, name: str) -> str:
    """The part of a ptxas log about the entry function `name` (not its callees)."""
    start = log.find(f"Function properties for {name}\n")
    return log if start < 0 else log[start:]


def compile_ptx(spec: KernelSpec, arch: str) -> str:
    """The PTX NVRTC emits for `spec` on `arch` (e.g. "sm_90"): no GPU needed."""
    virtual = target_arch(spec, arch).replace("sm_", "compute_")
    options = [f"--gpu-architecture={virtual}", *compile_options(), *CUPY_ADDED_OPTIONS]
    ptx = _nvrtc(spec, arch, render(spec), options, lambda nvrtc, program: nvrtc.getPTX(program))
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@functools.lru_cache(maxsize=None)
def compile_cubin(spec: KernelSpec, arch: str) -> CompileReport:
    """Render and compile `spec` for `arch` (e.g. "sm_90"; "sm_90a" where the spec is
    arch-specific) with NVRTC alone: no GPU needed."""
    import time

    source = render(spec)
    arch = target_arch(spec, arch)
    options = [f"--gpu-architecture={arch}", "--ptxas-options=-v", *compile_options(),
               *CUPY_ADDED_OPTIONS]
    start = time.perf_counter()
    log, cubin = _compile_with_log(spec, arch, source, options)
    if _PTXAS["registers"].search(log) is None:
        # A cache in NVRTC (CUDA 13) answers a repeated compile without running
        # ptxas, so without its report: compile once more with a device
        # variable no other module has (the kernel itself is unchanged).
        unique = f"\n__device__ int cupyops_report_{uuid.uuid4().hex};\n"
        log, cubin = _compile_with_log(spec, arch, source + unique, options)
    return CompileReport(
        name=spec.name, arch=arch,
        registers=_ptxas_number(log, "registers"),
        smem_bytes=_ptxas_number(log, "smem_bytes"),
        spill_bytes=_ptxas_number(log, "spill_stores") + _ptxas_number(log, "spill_loads"),
        stack_bytes=_ptxas_number(log, "stack_bytes"),
        cubin_bytes=len(cubin),
        seconds=time.perf_counter() - start,
    )
