"""The one loader of the package's C++ kernels (`pagedserve/csrc/*.cpp`) as torch op libraries.

    kernel = cpp_build.FUSED_OPS                   # a `Kernel`: source file, op namespace
    loaded = cpp_build.load(kernel)                # built once per machine, loaded once per process
    loaded.ops                                     # torch.ops.<namespace>, or None ...
    loaded.reason                                  # ... and why (no compiler, build error, CPU lacks X)
    loaded.require()                               # the ops, or KernelUnavailable(reason)

ISA variants (`ISA_VARIANTS`, chosen by `PAGEDSERVE_ISA`): "native" compiles with -march=native
(on an AVX-512 CPU the kernels take their AVX-512 code), "avx2" for x86-64-v3 (what an AVX2-only
CPU runs), "portable" for baseline x86-64 (the scalar fallbacks; kernels that need AVX2 report
themselves unavailable and their callers take the torch paths). Tests build every variant the
CPU can execute (`runnable_isas`), so each code path runs on every machine that can run it; a
variant the CPU cannot run is refused with the flags it lacks.

Build cache. The sources compile with -march=native, so a build is keyed by the CPU's flags,
the torch version, the compile flags and the sources' bytes (the kernel's .cpp and the shared
`pagedserve_common.h`), and lives under `envs.torch_extensions_dir()`. The sources are copied
into that build directory and compiled from there: an editable checkout and an installed wheel
with the same sources share one build, and an edited source gets a new directory instead of
recompiling over another process's library.

`load` never raises: a kernel that cannot be built or cannot run on this CPU gives its reason,
which the callers turn into their fallback (a logged warning) or, when a `PAGEDSERVE_*`
variable forces the kernel, an error at model construction. The result is cached per process
(a failed build is not retried on every call).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve import envs
from pagedserve.file_lock import file_lock

logger = logging.getLogger(__name__)

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
COMMON_HEADER = "pagedserve_common.h"
CFLAGS = ("-O3", "-fopenmp")


class KernelUnavailable(RuntimeError):
    """A C++ kernel could not be built or loaded here, or is forced but cannot run."""


@dataclass(frozen=True)
class IsaVariant:
    """One instruction-set target of the kernels.

    Attributes:
        march: the compiler's target flags.
        needs: /proc/cpuinfo flags a CPU must have to run the build (x86-64 only when any).
    """

    march: tuple[str, ...]
    needs: tuple[str, ...] = ()


ISA_VARIANTS: dict[envs.IsaName, IsaVariant] = {
    "native": IsaVariant(("-march=native",)),
    "avx2": IsaVariant(("-march=x86-64-v3", "-mtune=generic"),
                       ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")),
    "portable": IsaVariant(("-march=x86-64", "-mtune=generic")),
}
_X86 = platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo (empty where it cannot be read)."""
    return frozenset(_cpuinfo_flags().split())


def cpu_description() -> str:
    """The CPU's model name, cores and SIMD level, for benchmark output and logs (the same code
    runs 1.3-2x apart on the CPUs this project meets), e.g.
    "AMD EPYC, 2 cores, AVX-512 (F BW VL VNNI BF16), no AMX"."""
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line for line in cpuinfo if line.startswith("model name")).partition(":")[2].strip()
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    flags = cpu_flags()
    if "avx512f" in flags:
        parts = [name.upper() for name in ("f", "bw", "vl", "vnni", "bf16", "fp16")
                 if f"avx512{'_' if name in ('vnni', 'bf16', 'fp16') else ''}{name}" in flags]
        level = f"AVX-512 ({' '.join(parts)})"
    else:
        level = "AVX2" if "avx2" in flags else "no AVX2"
    amx = "AMX" if "amx_tile" in flags else "no AMX"
    return f"{model}, {os.cpu_count()} cores, {level}, {amx}"


def _cpuinfo_flags() -> str:
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        return next(line for line in cpuinfo if line.startswith("flags")).partition(":")[2]
    except (OSError, StopIteration):
        return ""


def check_isa(isa: envs.IsaName, flags: frozenset[str] | None = None) -> None:
    """Raises KernelUnavailable when a CPU with `flags` (default: this one) cannot run the
    `isa` build, naming the flags it lacks."""
    if isa == "native":
        return
    if not _X86:
        raise KernelUnavailable(f"PAGEDSERVE_ISA={isa} is an x86-64 target; this CPU is "
                                f"{platform.machine()} (use native)")
    have = cpu_flags() if flags is None else flags
    missing = [flag for flag in ISA_VARIANTS[isa].needs if flag not in have]
    if missing:
        raise KernelUnavailable(f"PAGEDSERVE_ISA={isa} needs CPU flags this CPU lacks: "
                                f"{', '.join(missing)}")


def runnable_isas() -> tuple[envs.IsaName, ...]:
    """The distinct variants this CPU executes: native always; avx2 where native is AVX-512
    (elsewhere it is the native code); portable on x86-64."""
    found: list[envs.IsaName] = ["native"]
    if _X86 and "avx512f" in cpu_flags():
        try:
            check_isa("avx2")
            found.append("avx2")
        except KernelUnavailable:
            pass
    if _X86:
        found.append("portable")
    return tuple(found)


@dataclass(frozen=True, eq=False)  # identity: a cheap key of `load`'s cache
class Kernel:
    """One C++ source and the op library it registers.

    Attributes:
        name: short name, for messages and the build directory.
        source: file name under `pagedserve/csrc/`.
        namespace: the `torch.ops` namespace of the default build (the source registers
            `TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m)`, which the loader defines).
        what: what it is, for log lines and errors.
        cflags: flags beyond `CFLAGS`.
        runs_here: name of a `() -> bool` op saying whether this CPU has the kernel's ISA
            (the build compiles everywhere; a False answer makes the kernel unavailable).
    """

    name: str
    source: str
    namespace: str
    what: str
    cflags: tuple[str, ...] = ()
    runs_here: str | None = None


PAGED_ATTENTION = Kernel("paged_attention", "paged_attention_cpu.cpp", "pagedserve_cpu",
                         "paged-attention kernel")
FUSED_OPS = Kernel("fused", "fused_ops_cpu.cpp", "pagedserve_fused", "fused elementwise ops")
# The int8 epilogue multiplies and adds in separate roundings, as torch does.
GEMV = Kernel("gemv", "gemv_cpu.cpp", "pagedserve_gemv", "decode GEMV kernel",
              cflags=("-ffp-contract=off",), runs_here="available")
INT8 = Kernel("int8", "int8_linear_cpu.cpp", "pagedserve_int8", "int8 linear kernel",
              runs_here="available")
LORA = Kernel("lora_sgmv", "lora_sgmv_cpu.cpp", "pagedserve_lora", "LoRA kernel")
# Calls the three kernels above through the dispatcher by their default namespaces.
DECODER_LOOP = Kernel("decoder_loop", "decoder_loop_cpu.cpp", "pagedserve_loop", "decoder loop")
KERNELS = (PAGED_ATTENTION, FUSED_OPS, GEMV, INT8, LORA, DECODER_LOOP)


@dataclass(frozen=True)
class Loaded:
    """The outcome of `load`: the op namespace, or None and the reason.

    `built` is False when the build failed, True when it succeeded (even if this CPU then
    lacks the kernel's instructions); `seconds` is what building / loading took.
    """

    kernel: Kernel
    ops: Any | None
    reason: str | None
    seconds: float
    built: bool

    def require(self) -> Any:
        """The ops; raises KernelUnavailable with the reason when there are none."""
        if self.ops is None:
            raise KernelUnavailable(f"the C++ {self.kernel.what} is unavailable: {self.reason}")
        return self.ops


def machine_signature() -> str:
    """CPU flags and torch version: what a -march=native build depends on."""
    flags = _cpuinfo_flags() or platform.processor() or platform.machine()
    return f"{flags}|torch {torch.__version__}"


# (kernel name, isa, extra cflags, namespace) -> the outcome, once per process. A plain dict
# rather than functools.cache: torch.compile traces through layers that ask for their ops
# on every call, and dynamo ignores cache wrappers (it would trace the build); a dict hit
# it can follow.
_LOADED: dict[tuple[str, str, tuple[str, ...], str | None], Loaded] = {}


def load(kernel: Kernel, extra_cflags: tuple[str, ...] = (), namespace: str | None = None,
         isa: envs.IsaName | None = None) -> Loaded:
    """Build (first use on this machine, 10-30 s) or load `kernel`; never raises for a
    kernel that cannot be built or run (its `Loaded` says why).

    Args:
        extra_cflags: a variant build (e.g. `-DPAGEDSERVE_ATTN_ROW_BLOCKS=0` for an A/B);
            it must come with its own `namespace` so several builds load into one process
            (tests and A/B benchmarks).
        namespace: the op namespace; default `kernel.namespace`.
        isa: the instruction-set variant; default `PAGEDSERVE_ISA` (native). Another variant
            than the process's needs its own `namespace` (`load_isa` names one).

    Raises:
        KernelUnavailable: the ISA variant cannot run on this CPU (a setting to correct,
            not a fallback to take).
    """
    isa = isa or envs.isa()
    key = (kernel.name, isa, extra_cflags, namespace)
    loaded = _LOADED.get(key)
    if loaded is None:
        check_isa(isa)
        loaded = _LOADED[key] = _load(kernel, isa, extra_cflags, namespace)
    return loaded


def resolve(kernel: Kernel, choice: str | None) -> Any | None:
    """The one rule of every "use the C++ kernel or fall back" choice (`PAGEDSERVE_*` values):
    "cpp" forces the kernel (KernelUnavailable when it cannot be built or run here); None
    (auto) takes it where it builds and runs, else logs the fallback once and returns None; any
    other value ("torch", "off") turns it off. The ISA variant is `PAGEDSERVE_ISA`'s.
    """
    if choice not in (None, "cpp"):
        return None
    loaded = load(kernel)
    if loaded.ops is None:
        if choice == "cpp":
            loaded.require()
        _warn_fallback(kernel.what, loaded.reason or "")
    return loaded.ops


@functools.cache
def _warn_fallback(what: str, reason: str) -> None:
    logger.warning("the C++ %s is unavailable, using the torch path: %s", what, reason)


def load_isa(kernel: Kernel, isa: envs.IsaName) -> Loaded:
    """`kernel` built for `isa`, in the default namespace when that is the process's variant,
    else in `<namespace>_<isa>` (tests run every variant the CPU can execute side by side)."""
    namespace = None if isa == envs.isa() else f"{kernel.namespace}_{isa}"
    return load(kernel, namespace=namespace, isa=isa)


def _load(kernel: Kernel, isa: envs.IsaName, extra_cflags: tuple[str, ...],
          namespace: str | None) -> Loaded:
    namespace = namespace or kernel.namespace
    start = time.perf_counter()
    try:
        _build(kernel, kernel_cflags(kernel, isa, extra_cflags, namespace))
    except KernelUnavailable as exc:
        logger.warning("%s", exc)
        return Loaded(kernel, None, str(exc), time.perf_counter() - start, built=False)
    seconds = time.perf_counter() - start
    ops = getattr(torch.ops, namespace)
    if kernel.runs_here is not None and not getattr(ops, kernel.runs_here)():
        reason = f"this CPU lacks the instructions the {kernel.what} needs"
        logger.info("%s; using the torch path", reason)
        return Loaded(kernel, None, reason, seconds, built=True)
    level = f"{ops.isa()}, " if hasattr(ops, "isa") else ""
    logger.info("C++ %s ready (%s%.1f s)", kernel.what, level, seconds)
    return Loaded(kernel, ops, None, seconds, built=True)


def load_all(kernels: Iterable[Kernel] = KERNELS) -> dict[str, Loaded]:
    """Builds / loads every kernel (`python -m pagedserve.cpp_build`)."""
    return {kernel.name: load(kernel) for kernel in kernels}


def _sources(kernel: Kernel) -> list[pathlib.Path]:
    paths = [CSRC / kernel.source, CSRC / COMMON_HEADER]
    for path in paths:
        if not path.is_file():
            raise KernelUnavailable(f"C++ source not found at {path} (an install without "
                                    f"pagedserve/csrc?)")
    return paths


def kernel_cflags(kernel: Kernel, isa: envs.IsaName, extra_cflags: tuple[str, ...] = (),
                  namespace: str | None = None) -> tuple[str, ...]:
    """The compiler flags of one build of `kernel` (what `load` passes to `_build`)."""
    return (*CFLAGS, *ISA_VARIANTS[isa].march, *kernel.cflags, *extra_cflags,
            f"-DPAGEDSERVE_OPS_NAMESPACE={namespace or kernel.namespace}")


def build_folder(kernel: Kernel, cflags: tuple[str, ...]) -> pathlib.Path:
    """The build folder of `kernel` with `cflags`: named by the machine, flags and sources."""
    digest = hashlib.sha1(f"{machine_signature()}|{' '.join(cflags)}".encode())
    for path in _sources(kernel):
        digest.update(path.read_bytes())
    return envs.torch_extensions_dir() / f"pagedserve_{kernel.name}_{digest.hexdigest()[:10]}"


def _build(kernel: Kernel, cflags: tuple[str, ...]) -> None:
    sources = _sources(kernel)
    build_dir = build_folder(kernel, cflags)
    name = build_dir.name
    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    for path in sources:  # the digest names these bytes: a racing process copies the same
        target = src_dir / path.name
        if not target.exists():
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(path, partial)
            os.replace(partial, target)
    if not (build_dir / f"{name}.so").exists():
        logger.info("compiling the C++ %s (first use here, 10-30 s)", kernel.what)
    # torch marks a build in progress with a `lock` file (its FileBaton) that a builder killed
    # mid-compile leaves behind, and every later load then waits on it forever. Builders of
    # this folder take `build.flock` first, which dies with its process: whoever holds it and
    # still finds `lock` knows it is stale.
    with file_lock(build_dir / "build.flock"):
        baton = build_dir / "lock"
        if baton.exists():
            logger.warning("removing a stale build lock left by an interrupted build: %s", baton)
            baton.unlink(missing_ok=True)
        _cpp_load(kernel, name, src_dir, build_dir, cflags)


def _cpp_load(kernel: Kernel, name: str, src_dir: pathlib.Path, build_dir: pathlib.Path,
              cflags: tuple[str, ...]) -> None:
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=name,
            sources=[str(src_dir / kernel.source)],
            extra_cflags=list(cflags),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler / ninja, compile error
        raise KernelUnavailable(
            f"building the C++ {kernel.what} failed ({type(exc).__name__}: {exc}). It needs a "
            f"C++17 compiler with OpenMP and ninja (pip install ninja); build dir {build_dir}"
        ) from exc


def _build_one(job: tuple[str, envs.IsaName]) -> tuple[str, envs.IsaName, bool, str | None]:
    """A worker process's build of one (kernel, ISA variant)."""
    kernel = next(k for k in KERNELS if k.name == job[0])
    loaded = load_isa(kernel, job[1])
    return kernel.name, job[1], loaded.built, loaded.reason


def main(argv: list[str] | None = None) -> None:
    """`python -m pagedserve.cpp_build [--isa runnable] [--jobs 2]`: build the kernels now (an
    image's build step; `make test` builds every variant the tests run, both cores at once,
    since one compile uses one core)."""
    import argparse
    from concurrent.futures import ProcessPoolExecutor

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--isa", default="native", choices=(*envs.ISAS, "runnable"),
                        help="a variant, or every variant this CPU runs (default native)")
    parser.add_argument("--jobs", type=int, default=1, help="builds at once (default 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    isas = runnable_isas() if args.isa == "runnable" else (args.isa,)
    # The slowest compile first (GEMV: ~50 s of the ~100 s in all), so two jobs end together.
    ordered = sorted(KERNELS, key=lambda kernel: kernel is not GEMV)
    jobs = [(kernel.name, isa) for isa in isas for kernel in ordered]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_build_one, jobs))
    else:
        results = [_build_one(job) for job in jobs]
    failed = [f"{name} ({isa}): {reason}" for name, isa, built, reason in results if not built]
    raise SystemExit(f"failed: {'; '.join(failed)}" if failed else 0)


if __name__ == "__main__":
    main()
