"""The kernel loader: an outcome with a reason instead of an exception, one build per kernel."""

from __future__ import annotations

import threading

import pytest

from pagedserve import cpp_build, envs
from pagedserve.cpp_build import Kernel, KernelUnavailable


def test_missing_source_gives_a_reason_not_an_exception() -> None:
    kernel = Kernel("missing", "no_such_kernel.cpp", "pagedserve_missing", "test kernel")
    loaded = cpp_build.load(kernel)
    assert loaded.ops is None and not loaded.built
    assert "no_such_kernel.cpp" in loaded.reason
    with pytest.raises(KernelUnavailable, match="test kernel is unavailable"):
        loaded.require()


def test_every_kernel_has_its_source_and_the_shared_header() -> None:
    assert (cpp_build.CSRC / cpp_build.COMMON_HEADER).is_file()
    for kernel in cpp_build.KERNELS:
        source = (cpp_build.CSRC / kernel.source).read_text()
        assert '#include "pagedserve_common.h"' in source, kernel.name
        assert "TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE" in source, kernel.name


def test_load_is_cached_per_process() -> None:
    first = cpp_build.load(cpp_build.FUSED_OPS)
    if not first.built:
        pytest.skip(f"the fused ops cannot be built here: {first.reason}")
    assert cpp_build.load(cpp_build.FUSED_OPS) is first


def test_a_stale_build_lock_from_a_killed_build_does_not_hang_the_next_load() -> None:
    # A builder killed mid-compile leaves torch's `lock` file; torch alone waits on it forever.
    first = cpp_build.load(cpp_build.FUSED_OPS)
    if not first.built:
        pytest.skip(f"the fused ops cannot be built here: {first.reason}")
    kernel = cpp_build.FUSED_OPS
    cflags = cpp_build.kernel_cflags(kernel, envs.isa())
    baton = cpp_build.build_folder(kernel, cflags) / "lock"
    assert baton.parent.is_dir()
    baton.touch()
    errors: list[BaseException] = []

    def build() -> None:
        try:
            cpp_build._build(kernel, cflags)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        worker = threading.Thread(target=build, daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "the load waited on a stale build lock"
        assert not errors, errors
        assert not baton.exists()
    finally:
        baton.unlink(missing_ok=True)
