"""Building the package's C++ kernels (csrc/*.cpp) as torch op libraries, once per machine.

The sources compile with -march=native, so a build is keyed by the CPU's flags, the torch
version and the compile flags, and cached under `envs.torch_extensions_dir()`.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import platform
import time

import torch

from pagedserve import envs

logger = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def machine_signature() -> str:
    """CPU flags and torch version: what a -march=native build depends on."""
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return f"{flags}|torch {torch.__version__}"


def load_cpp_ops(
    prefix: str, source: pathlib.Path, cflags: list[str], what: str, error: type[Exception]
) -> float:
    """Compile (first use on this machine) or load `source`; returns the seconds it took.

    Its ops then live under the `torch.ops` namespace the source registers.

    Raises:
        error: no source file, no compiler / ninja, or the build failed (message says which).
    """
    from torch.utils import cpp_extension

    if not source.is_file():
        raise error(f"C++ source not found at {source} (not a source checkout?)")
    tag = hashlib.sha1(f"{machine_signature()}|{' '.join(cflags)}".encode()).hexdigest()[:10]
    name = f"{prefix}_{tag}"
    build_dir = envs.torch_extensions_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{name}.so").exists():
        logger.info("compiling the C++ %s (first use here, 10-30 s)", what)
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler / ninja, compile error
        raise error(
            f"building the C++ {what} failed ({type(exc).__name__}: {exc}). It needs a C++17 "
            f"compiler with OpenMP and ninja (pip install ninja); build dir {build_dir}"
        ) from exc
    return time.perf_counter() - start
