"""The compiled decode forward: torch.compile (inductor, CPU) with one static graph per size.

gpt-fast's recipe for a cheap hot loop, fitted to a paged engine:

    step with T tokens, each request running one token, T <= max(sizes)
        -> pad input_ids / positions to the next size S >= T (padding: token 0, position 0)
        -> graph[S](input_ids, positions) -> hidden (S, hidden_size) -> hidden[:T]
    any other step (prefill, mixed, larger batches) -> the eager model, unchanged

The graph holds everything between the embedding and the final norm: the C++ kernels
(GEMV, fused norms / rotary / SiLU) as opaque calls (their fakes: fake_ops.py), the paged
attention as one opaque op that reads the step's metadata at run time (attention_op.py),
and the glue (views, splits, RoPE tables) as generated code. It is compiled once per size
at engine start (`warm_up`), like the C++ kernels, so no request waits on the compiler;
the shapes are static, so a running engine never recompiles (`fullgraph=True`: a graph
break is an error at start-up, not a silent slow path).
"""

from __future__ import annotations

import logging
import time
import types
import warnings
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.compilation.attention_op import MissedGraph, step_context
from pagedserve.compilation.fake_ops import register_fakes

logger = logging.getLogger(__name__)


def _decode(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # meta=None: inside the graph every Attention layer calls the opaque op instead.
    return model(input_ids, positions, None)


class CompiledDecode:
    """One compiled graph per batch size for `model(input_ids, positions, meta)`.

    Args:
        model: the loaded model (weights processed), eval mode.
        sizes: the batch sizes (tokens) to compile, e.g. (1, 2, 4, 8).
        options: inductor options (torch.compile's `options`), e.g. {"cpp_wrapper": True}.
    """

    def __init__(self, model: nn.Module, sizes: tuple[int, ...], options: dict | None = None) -> None:
        self.model = model
        self.sizes = tuple(sorted(sizes))
        register_fakes()
        # Dynamo keeps its graphs on the code object: each instance gets its own copy of
        # `_decode`'s, so engines in one process never share (or exhaust) a recompile limit.
        fn = types.FunctionType(_decode.__code__.replace(), _decode.__globals__, "decode")
        self._compiled: Callable[..., torch.Tensor] = torch.compile(
            fn, backend="inductor", dynamic=False, fullgraph=True, options=options or {}
        )
        self._run = torch._dynamo.run(self._compiled)  # cached graphs only, never compiles
        self.compile_seconds: dict[int, float] = {}
        # Steps run through each size's graph (read by tests and benchmarks).
        self.calls: dict[int, int] = dict.fromkeys(self.sizes, 0)
        self.guard_misses = 0

    @torch.inference_mode()
    def warm_up(self, device: torch.device) -> float:
        """Compiles every size (dummy inputs, no KV write); returns the seconds it took."""
        total = 0.0
        for size in self.sizes:
            start = time.perf_counter()
            # Two tensors: dynamo guards on aliasing, and a step's ids and positions never alias.
            ids, positions = (torch.zeros(size, dtype=torch.int64, device=device) for _ in range(2))
            with step_context(None, []), warnings.catch_warnings():
                # quantization/gemv.py's op lookup is lru_cached; dynamo warns that it traces
                # through the cache, which is harmless here (the lookup returns the same ops).
                warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
                self._compiled(self.model, ids, positions)
            self.compile_seconds[size] = time.perf_counter() - start
            total += self.compile_seconds[size]
        logger.info("compiled decode ready: sizes %s in %.1f s", list(self.sizes), total)
        return total

    def takes(self, num_tokens: int, max_query_len: int) -> bool:
        """Whether a step runs here: every request one token, and a size fits."""
        return max_query_len == 1 and num_tokens <= self.sizes[-1]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """(T,) ids and positions -> hidden (T, hidden_size), through the graph of the
        smallest size >= T; None if no graph's guards hold (the caller runs eagerly).

        A running engine never compiles: after warm-up the graphs run in dynamo's run-only
        mode, so a guard miss (which would otherwise be a multi-second recompile in the middle
        of serving) runs the frame eagerly, where the first attention layer, finding no
        metadata, raises `MissedGraph` before writing anything; it is counted in
        `guard_misses`, logged once, and the runner runs that step eagerly."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        if size != n:
            pad = input_ids.new_zeros(size - n)
            input_ids, positions = torch.cat((input_ids, pad)), torch.cat((positions, pad))
        try:
            with step_context(meta, kv_caches):
                hidden = self._run(self.model, input_ids, positions)
        except MissedGraph as exc:
            # Raised by the first attention layer, before any KV write.
            self.guard_misses += 1
            if self.guard_misses == 1:
                logger.warning("compiled decode: a step missed every graph's guards and ran eagerly "
                               "(further misses are only counted): %s", exc)
            return None
        self.calls[size] += 1
        return hidden[:n]


def build_compiled_decode(
    model: nn.Module, sizes: tuple[int, ...], device: torch.device, options: dict | None = None
) -> CompiledDecode | None:
    """The compiled decode, warmed up (every size compiled), or None with a warning when it
    cannot be built here (no C++ compiler, an op dynamo cannot trace): the engine then runs
    eagerly, as it does without a C++ kernel."""
    try:
        compiled = CompiledDecode(model, sizes, options)
        compiled.warm_up(device)
    except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager path
        logger.warning("compilation_config: the decode graph could not be compiled, running "
                       "eagerly: %s: %s", type(exc).__name__, exc)
        return None
    return compiled
