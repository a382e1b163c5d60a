"""LoRA adapters over HTTP: served names, and runtime load/unload (vLLM's endpoints).

Runtime updates are off unless `--enable-lora-runtime-updates`; they sit behind the API key
(the /v1 router) and accept only adapter folders inside a `--lora-dir` root, checked after
resolving `..` and symlinks, so a request cannot make the server read elsewhere.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from pagedserve.lora.peft_loader import LoRALoadError, load_peft_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.server.errors import APIError


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str


@dataclass
class LoRARegistry:
    """Served adapter names -> LoRARequest; ids are handed out in order."""

    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    lora_dirs: list[Path] = field(default_factory=list)
    runtime_updates: bool = False
    _next_id: int = 1

    def new_request(self, name: str, path: str) -> LoRARequest:
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    def register_modules(self, engine, modules: list[str]) -> None:
        """`--lora-modules name=path ...`: each adapter is loaded and validated now."""
        for spec in modules:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected name=path, got {spec!r}")
            request = self.new_request(name, path)
            engine.lora_manager.register(request, load_now=True)
            self.adapters[name] = request

    def check_path(self, path: str) -> str:
        resolved = Path(os.path.realpath(path))
        for root in self.lora_dirs:
            if resolved.is_relative_to(Path(os.path.realpath(root))):
                return str(resolved)
        raise APIError(400, f"lora_path {path!r} is outside the allowed --lora-dir roots", "lora_path")


async def load_adapter(ctx, body: LoadLoRARequest) -> dict:
    registry: LoRARegistry = ctx.loras
    if not registry.runtime_updates:
        raise APIError(404, "runtime LoRA updates are off (start with --enable-lora-runtime-updates)", None, "not_found")
    if body.lora_name in registry.adapters or body.lora_name in ctx.model_names:
        raise APIError(400, f"lora_name {body.lora_name!r} is already in use", "lora_name")
    path = registry.check_path(body.lora_path)
    request = registry.new_request(body.lora_name, path)
    engine = ctx.engine.engine
    manager = engine.lora_manager
    try:
        # Read and validate off the event loop and off the engine thread.
        adapter = await asyncio.to_thread(
            load_peft_adapter, request, manager.module_dims, manager.num_layers, manager.config.max_lora_rank
        )
    except LoRALoadError as exc:
        raise APIError(400, str(exc), "lora_path") from None
    await asyncio.to_thread(ctx.engine.call_in_engine_thread, lambda e: e.lora_manager.register(request, adapter=adapter))
    registry.adapters[body.lora_name] = request
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "loaded"}


async def unload_adapter(ctx, body: UnloadLoRARequest) -> dict:
    registry: LoRARegistry = ctx.loras
    if not registry.runtime_updates:
        raise APIError(404, "runtime LoRA updates are off (start with --enable-lora-runtime-updates)", None, "not_found")
    request = registry.adapters.get(body.lora_name)
    if request is None:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r}", "lora_name", "not_found")
    try:
        await asyncio.to_thread(ctx.engine.call_in_engine_thread, lambda e: e.lora_manager.unregister(request.lora_int_id))
    except ValueError as exc:
        raise APIError(400, str(exc), "lora_name") from None
    del registry.adapters[body.lora_name]
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}
