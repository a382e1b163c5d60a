"""Which attention backend a device gets (the factory lives here, not beside the interface in
backend.py, so that the interface and its implementations import in one direction only)."""

from __future__ import annotations

import logging

import torch

from pagedserve import envs
from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.cpp_paged import CppPagedAttentionBackend
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend
from pagedserve.cpp_build import KernelUnavailable

logger = logging.getLogger(__name__)


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The attention backend for `device`.

    `PAGEDSERVE_ATTENTION_BACKEND` (read in `pagedserve.envs`) forces `torch` or `cpp`;
    unset, CPU gets the fused C++ kernel and everything else the pure-torch backend. On CPU
    the kernel measured 3.3-3.8x faster than gather + SDPA on decode and 1.1-1.5x on prefill
    chunks (benchmarks/attention_micro.py, fp32, 1 and 2 threads). When the C++ kernel
    cannot be built (no compiler, no ninja), the torch backend is used and a warning logged;
    a forced `cpp` then fails (KernelUnavailable), as every forced kernel does.
    """
    device = torch.device(device)
    choice = envs.attention_backend()
    if choice == "cpp" or (choice is None and device.type == "cpu"):
        # Not cpp_build.resolve: the backend loads its kernel itself (`cpp_paged.load_extension`,
        # which a test replaces to stand for a machine without a compiler).
        try:
            return CppPagedAttentionBackend(device=device)
        except KernelUnavailable as exc:
            if choice == "cpp":
                raise
            logger.warning("C++ paged attention unavailable, using the torch backend: %s", exc)
    return TorchPagedAttentionBackend(device=device)
