"""The built-in playground: a chat page at `/` and the JSON numbers of its engine panel.

    GET /                  the page (static/index.html), served without the API key: it holds
                           no data, and every call it makes carries the key the user typed
    GET /playground/...    its script and style sheet (package data, no build step, no CDN)
    GET /v1/stats          the engine panel's numbers as JSON (behind the key, like /v1/models,
                           since it names the adapters)

/v1/stats reads the same state as /metrics, but takes its snapshot inside the engine thread
between two steps (one consistent view of the pool), so it can also count what the per-step
statistics leave out: cached-but-free blocks and the blocks that hold resident adapters.
During a long step it answers with the last snapshot (`snapshot_time` says when) rather than
waiting on the engine thread.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.server.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"


def engine_snapshot(engine: LLMEngine) -> dict[str, Any]:
    """The panel's numbers; runs in the engine thread (it reads the pool directly)."""
    stats = engine.get_stats()
    sched = stats.scheduler
    pool = engine.kv_manager.pool
    lora = engine.lora_manager
    adapter_blocks = lora.num_device_blocks if lora is not None else 0
    cached = pool.num_evictable_cached_blocks()
    return {
        "kv_blocks": {
            "total": pool.num_blocks,
            # Adapter pages are held blocks too; the bar shows them apart from requests' KV.
            "used": pool.num_used_blocks - adapter_blocks,
            "adapters": adapter_blocks,
            "cached": cached,
            "free": pool.num_free_blocks - cached,
            "block_size": engine.config.cache.block_size,
        },
        "requests": {"running": sched.num_running, "waiting": sched.num_waiting, "swapped": sched.num_swapped},
        "preemptions_total": sched.num_preemptions_total,
        "prefix_cache": {
            "queries": sched.prefix_cache_queries,
            "hits": sched.prefix_cache_hits,
            "hit_rate": sched.prefix_cache_hits / sched.prefix_cache_queries if sched.prefix_cache_queries else 0.0,
        },
        "tokens": {"prompt_total": stats.num_prompt_tokens_total,
                   "generation_total": stats.num_generation_tokens_total},
        "steps_total": stats.num_steps_total,
        "resident_lora_ids": lora.resident_ids() if lora is not None else [],
        "host_lora_ids": lora.host_ids() if lora is not None else [],
    }


class SnapshotCache:
    """The panel's last engine snapshot. A poll asks the engine thread for a fresh one (at
    most one asked at a time) and waits briefly; during a long step it serves the last one
    taken between steps instead of waiting on the engine thread (the page polls every second).
    """

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None
        self.taken_at = 0.0
        self._pending: asyncio.Future[dict[str, Any]] | None = None

    async def get(self, engine: Any) -> tuple[dict[str, Any], float]:
        """(a copy of the newest snapshot, when it was taken: time.time())."""
        if self._pending is None or self._pending.done():
            self._pending = asyncio.wrap_future(engine.submit_call(engine_snapshot))
        pending = self._pending
        # No snapshot yet (the first poll): worth waiting for the step to end.
        done, _ = await asyncio.wait({pending}, timeout=FRESH_WAIT_S if self.last is not None else FIRST_WAIT_S)
        if done:
            self.last, self.taken_at = pending.result(), time.time()
        if self.last is None:
            raise APIError(503, "the engine is busy with a long step; no statistics yet", None, "busy",
                           headers={"Retry-After": "1"})
        return copy.deepcopy(self.last), self.taken_at


# How long a poll waits for a fresh snapshot before serving the last one (seconds).
FRESH_WAIT_S = 0.25
FIRST_WAIT_S = 5.0


async def stats(request: Request) -> JSONResponse:
    ctx = request.app.state.ctx
    try:
        snap, taken_at = await request.app.state.snapshots.get(ctx.engine)
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    names = {lora.lora_int_id: name for name, lora in ctx.loras.adapters.items()}
    snap["adapters"] = {
        "served": list(ctx.loras.adapters),
        "resident": [names.get(i, str(i)) for i in snap.pop("resident_lora_ids")],
        "host": [names.get(i, str(i)) for i in snap.pop("host_lora_ids")],
    }
    # The client queued but not yet seen by the scheduler counts as waiting, as in /metrics.
    snap["requests"]["waiting"] = max(snap["requests"]["waiting"], ctx.engine.num_waiting)
    snap["model"] = ctx.model_names[0]
    snap["time"] = time.time()
    snap["snapshot_time"] = taken_at  # older than `time` while a long step runs
    return JSONResponse(snap)


async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def install_playground(app: FastAPI, check_api_key: Callable[..., None]) -> None:
    """Adds the page, its assets and /v1/stats to `app` (`check_api_key` guards /v1/stats)."""
    app.state.snapshots = SnapshotCache()
    router = APIRouter()
    router.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    router.add_api_route("/v1/stats", stats, methods=["GET"], dependencies=[Depends(check_api_key)])
    app.include_router(router)
    app.mount("/playground", StaticFiles(directory=STATIC_DIR), name="playground")
