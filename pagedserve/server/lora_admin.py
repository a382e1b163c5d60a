"""LoRA adapters over HTTP: served names, and runtime load/unload (vLLM's endpoints).

Runtime updates are off unless `--enable-lora-runtime-updates`; they sit behind the API key
(the /v1 router) and accept only adapter folders inside a `--lora-dir` root, checked after
resolving `..` and symlinks; every file the loader then opens must resolve inside that root
too (a symlinked weights file is refused), so a request cannot make the server read elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field, StringConstraints

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.lora.peft_loader import LoRALoadError, read_peft_adapter, to_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import StrictRequest

# A served name: no control characters; a path: no NUL, at most PATH_MAX.
LoRAName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+$")]
LoRAPath = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]


class LoadLoRARequest(StrictRequest):
    lora_name: LoRAName
    lora_path: LoRAPath


class UnloadLoRARequest(StrictRequest):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]


def parse_lora_module(spec: str) -> tuple[str, str, str | None]:
    """One --lora-modules item, in either of vLLM's forms: `name=path`, or a JSON object with
    `name`, `path` and optionally `base_model_name`. Returns (name, path, base_model_name)."""
    if spec.lstrip().startswith("{"):
        try:
            item = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: invalid JSON {spec!r}: {exc}") from None
        unknown = set(item) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: unknown key(s) {sorted(unknown)} in {spec!r}")
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: a JSON item needs string 'name' and 'path', got {spec!r}")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: 'base_model_name' must be a string in {spec!r}")
        return name, path, base
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {spec!r}")
    return name, path, None


@dataclass
class LoRARegistry:
    """Served adapter names -> LoRARequest; ids are handed out in order."""

    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    lora_dirs: list[Path] = field(default_factory=list)
    runtime_updates: bool = False
    # Names whose load is under way: a second load of the same name is refused meanwhile.
    loading: set[str] = field(default_factory=set)
    _next_id: int = 1

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        request = LoRARequest(name, self._next_id, path, base_model_name=base_model_name)
        self._next_id += 1
        return request

    def register_modules(self, engine, modules: list[str]) -> None:
        """`--lora-modules name=path '{"name": ..., "path": ..., "base_model_name": ...}' ...`:
        each adapter is loaded and validated now."""
        for spec in modules:
            name, path, base = parse_lora_module(spec)
            request = self.new_request(name, path, base)
            engine.lora_manager.register(request, load_now=True)
            self.adapters[name] = request

    def check_path(self, path: str) -> tuple[str, Path]:
        """The resolved adapter folder and the --lora-dir root that holds it; 400 otherwise."""
        try:
            resolved = Path(os.path.realpath(path))
            for root in self.lora_dirs:
                real_root = Path(os.path.realpath(root))
                if resolved.is_relative_to(real_root):
                    return str(resolved), real_root
        except (OSError, ValueError) as exc:
            raise APIError(400, f"lora_path is not a usable path: {exc}", "lora_path") from None
        raise APIError(400, f"lora_path {path!r} is outside the allowed --lora-dir roots", "lora_path")


async def load_adapter(ctx, body: LoadLoRARequest) -> dict:
    registry: LoRARegistry = ctx.loras
    if not registry.runtime_updates:
        raise APIError(404, "runtime LoRA updates are off (start with --enable-lora-runtime-updates)", None, "not_found")
    name = body.lora_name
    if name in registry.adapters or name in registry.loading or name in ctx.model_names:
        raise APIError(400, f"lora_name {name!r} is already loaded (or being loaded)", "lora_name")
    path, root = registry.check_path(body.lora_path)
    registry.loading.add(name)  # claimed before the first await: concurrent loads of a name see it
    try:
        await _load(ctx, registry.new_request(name, path), root)
    finally:
        registry.loading.discard(name)
    return {"object": "lora_adapter", "lora_name": name, "status": "loaded"}


async def _load(ctx, request: LoRARequest, root: Path) -> None:
    registry: LoRARegistry = ctx.loras
    manager = ctx.engine.engine.lora_manager
    try:
        # Read and validate off the event loop and off the engine thread; the tensors are
        # converted on the engine thread (no torch arithmetic elsewhere: engine/engine_thread.py).
        read = await asyncio.to_thread(
            read_peft_adapter, request, manager.module_dims, manager.num_layers, manager.config.max_lora_rank,
            confine_to=root,
        )
        await asyncio.to_thread(
            ctx.engine.call_in_engine_thread, lambda e: e.lora_manager.register(request, adapter=to_adapter(read))
        )
    except LoRALoadError as exc:
        raise APIError(400, f"lora_path: {exc}", "lora_path") from None
    except ValueError as exc:
        raise APIError(400, str(exc), "lora_name") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    registry.adapters[request.lora_name] = request


async def unload_adapter(ctx, body: UnloadLoRARequest) -> dict:
    """Unloads an adapter (vLLM's semantics): its name leaves the registry at once, so a new
    request for it is a 404 and a second concurrent unload of it is a 404 too; its in-flight
    requests end with a 404 naming it; then the engine unregisters it between two steps."""
    registry: LoRARegistry = ctx.loras
    if not registry.runtime_updates:
        raise APIError(404, "runtime LoRA updates are off (start with --enable-lora-runtime-updates)", None, "not_found")
    # Claimed before the first await: of two concurrent unloads of one name, one finds it.
    request = registry.adapters.pop(body.lora_name, None)
    if request is None:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r}", "lora_name", "not_found")
    try:
        await ctx.engine.unload_lora(request)
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}
