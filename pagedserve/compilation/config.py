"""`CompilationConfig`: vLLM's `compilation_config`, the subset this engine honours. No torch.

    LLM(model, compilation_config={"level": 3, "compile_sizes": [1, 2, 4, 8]})
    pagedserve serve MODEL --compilation-config '{"level": 3}'     (or -O3, or -O 3)
    inductor options: {"level": 3, "inductor_compile_config": {"cpp_wrapper": true}}

level 0 (the default here): eager. level 3: the decode forward (every step whose requests
each run one token, at most max(compile_sizes) tokens) runs through torch.compile with the
inductor CPU backend, one static-shape graph per size, the batch padded up to the next size
(vLLM pads to its CUDA-graph capture sizes the same way). Prefill and mixed steps stay eager.
vLLM's levels 1 and 2 (dynamo without inductor) are refused rather than treated as 3.
`enforce_eager=True` wins over any level, as in vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

NO_COMPILATION = 0
PIECEWISE = 3  # vLLM's name for its inductor level; here one graph per size, attention opaque
DEFAULT_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class CompilationConfig:
    level: int = NO_COMPILATION
    # Batch sizes (tokens) with a compiled graph; a decode step pads up to the next one.
    compile_sizes: tuple[int, ...] = DEFAULT_SIZES
    # Inductor options (torch.compile's `options`), vLLM's key: e.g. {"cpp_wrapper": true}
    # (a C++ wrapper instead of Python around the kernels; ~5x the compile time). A dict is
    # not hashable, so it is kept as sorted (name, value) pairs.
    inductor_compile_config: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.level not in (NO_COMPILATION, PIECEWISE):
            raise ValueError(
                f"compilation_config.level must be 0 (eager) or 3 (torch.compile, inductor), got {self.level!r}"
            )
        sizes = self.compile_sizes
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"compilation_config.compile_sizes must be positive integers, got {list(sizes)!r}")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"compilation_config.compile_sizes has duplicates: {list(sizes)!r}")
        for name, _ in self.inductor_compile_config:
            # Checked here, not at compile time: no torch import in configs; inductor's own
            # config names every option it has.
            if not isinstance(name, str):
                raise ValueError(f"compilation_config.inductor_compile_config: keys must be strings, got {name!r}")

    @property
    def enabled(self) -> bool:
        return self.level == PIECEWISE

    @classmethod
    def from_value(cls, value: CompilationConfig | dict[str, Any] | int | str | None) -> CompilationConfig:
        """The config, a dict, a level (int or "3" / "-O3") or JSON text; unknown keys are
        refused by name."""
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, str):
            text = value.strip().removeprefix("-O")
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"compilation_config: not a level or valid JSON ({exc})") from None
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(level=value)
        if not isinstance(value, dict):
            raise ValueError(
                f"compilation_config must be a dict, a level or JSON text, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"compilation_config: unsupported key(s) {unknown} (supported: {sorted(known)})"
            )
        kwargs = dict(value)
        options = kwargs.get("inductor_compile_config")
        if isinstance(options, list | tuple) and all(isinstance(o, list | tuple) and len(o) == 2 for o in options):
            options = dict(options)  # the stored (name, value) pairs, e.g. from dataclasses.asdict
        if options is not None:
            if not isinstance(options, dict):
                raise ValueError(f"compilation_config.inductor_compile_config must be a dict, got {options!r}")
            kwargs["inductor_compile_config"] = tuple(sorted(options.items()))
        if "compile_sizes" in kwargs:
            sizes = kwargs["compile_sizes"]
            if not isinstance(sizes, list | tuple):
                raise ValueError(f"compilation_config.compile_sizes must be a list, got {sizes!r}")
            kwargs["compile_sizes"] = tuple(sizes)
        return cls(**kwargs)

    def with_enforce_eager(self, enforce_eager: bool) -> CompilationConfig:
        return replace(self, level=NO_COMPILATION) if enforce_eager else self
