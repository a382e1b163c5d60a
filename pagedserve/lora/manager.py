"""Where each LoRA adapter lives: device (in KV blocks) <- host cache <- disk.

    disk ──(background thread)──> host cache (LRU, max_cpu_loras) ──(write)──> device run of KV blocks

Device residency is S-LoRA's unified paging: an adapter takes a run of consecutive KV
blocks from the same block pool as the KV cache (so adapters and KV compete for one
budget, with no fixed reservation), and its weights are read in place from there. An
adapter is pinned while running requests use it; idle ones are evicted least recently
used first when another adapter or the KV cache needs the blocks.

The scheduler asks `prepare(lora_id)` before admitting a request: READY means resident now;
LOADING means a disk load is under way on the background thread (the request waits, the
other requests keep running); FAILED carries the load error for that request alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from pagedserve.config import LoRAConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.protocols import Residency
from pagedserve.lora.layout import AdapterLayout, plan_layout
from pagedserve.lora.peft_loader import (
    AdapterFile,
    LoRAAdapter,
    LoRALoadError,
    read_peft_adapter,
    to_adapter,
)
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.segments import ResidentAdapter

logger = logging.getLogger(__name__)


# Writes an adapter's weights into the KV blocks starting at the given block (the runner owns tensors).
WriteAdapter = Callable[[LoRAAdapter, AdapterLayout, int], None]


class LoRAManager:
    """The device / host / disk tiers of LoRA adapters; the scheduler's `AdapterResidency`."""

    def __init__(
        self,
        config: LoRAConfig,
        pool: BlockPool,
        module_dims: dict[str, tuple[int, int]],
        num_layers: int,
        block_elems: int,
        write_adapter: WriteAdapter,
        shard: Callable[[LoRAAdapter], LoRAAdapter] | None = None,
        num_caches: int | None = None,
    ) -> None:
        """`shard`: with tensor parallelism, rank 0's part of an adapter (its layout plans the
        blocks every rank uses: all ranks' shards have the same shapes); `write_adapter` gets
        the whole adapter and writes each rank's part. `num_caches`: the KV cache tensors
        (None: one per layer; fewer with windowed layers, lora/layout.py)."""
        self.config = config
        self.pool = pool
        self.module_dims = module_dims
        self.num_layers = num_layers
        self.block_elems = block_elems
        self.num_caches = num_caches
        self.write_adapter = write_adapter
        self.shard = shard
        self.registered: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._host_capacity = config.max_cpu_loras or max(config.max_loras, 16)
        self._loading: dict[int, Future[AdapterFile]] = {}
        self._errors: dict[int, LoRALoadError] = {}
        self._device: OrderedDict[int, ResidentAdapter] = OrderedDict()  # LRU: oldest first
        self._users: dict[int, int] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        self.num_disk_loads = 0
        self.num_device_loads = 0

    # ---- registry and host tier ----------------------------------------------------------

    def register(self, request: LoRARequest, load_now: bool = False, adapter: LoRAAdapter | None = None) -> None:
        """Makes an adapter known by id; `load_now` loads and validates it synchronously,
        `adapter` hands over one already loaded (it goes to the host cache).

        Raises:
            LoRALoadError: (with load_now) the adapter is missing, corrupt, or unsupported.
            ValueError: the id is already registered with another name or path.
        """
        known = self.registered.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already used by adapter {known.lora_name!r}")
        self.registered[request.lora_int_id] = request
        self._errors.pop(request.lora_int_id, None)
        if adapter is not None:
            self._to_host(request.lora_int_id, adapter)
        elif load_now and request.lora_int_id not in self._host:
            self._to_host(request.lora_int_id, self._load(request))

    def unregister(self, lora_id: int) -> None:
        if self._users.get(lora_id):
            raise ValueError(f"adapter {lora_id} is in use by running requests")
        self._evict_device(lora_id)
        self._host.pop(lora_id, None)
        self.registered.pop(lora_id, None)

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        return to_adapter(self._read(request))

    def _read(self, request: LoRARequest) -> AdapterFile:
        """The loader thread's part of a load: files only, no torch arithmetic (a parallel op
        there would give the process a second OpenMP pool; engine/engine_thread.py)."""
        self.num_disk_loads += 1
        return read_peft_adapter(request, self.module_dims, self.num_layers, self.config.max_lora_rank)

    def _to_host(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        while len(self._host) > self._host_capacity:
            # The oldest copy that is neither this adapter (about to be placed) nor a resident
            # one's (resident adapters keep theirs). Rotating residents to the end used to bring
            # `lora_id` to the front once all others were resident, and it was the one evicted.
            old_id = next((i for i in self._host if i != lora_id and i not in self._device), None)
            if old_id is None:
                break  # over capacity until a resident adapter leaves the pool
            del self._host[old_id]

    # ---- device tier ---------------------------------------------------------------------

    def prepare(self, lora_id: int) -> Residency:
        """Makes the adapter resident if it can be now; never blocks on disk."""
        if lora_id in self._device:
            self._device.move_to_end(lora_id)
            return Residency.READY
        if lora_id in self._errors:
            return Residency.FAILED
        if lora_id not in self._host and not self._poll_load(lora_id):
            return Residency.FAILED if lora_id in self._errors else Residency.LOADING
        if self._place(lora_id):
            return Residency.READY
        return Residency.FAILED if lora_id in self._errors else Residency.LOADING

    def error(self, lora_id: int) -> LoRALoadError:
        return self._errors[lora_id]

    def wait_for_loads(self, timeout_s: float) -> None:
        """Blocks until a background load finishes, at most `timeout_s` (none pending: returns).

        For a step that scheduled nothing because its requests wait on loads: an engine loop
        stepping again at once holds the GIL the loader thread needs, and a ~20 ms adapter load
        took ~4 s (benchmark report, 0.5B base: the first LoRA run of an engine ran at 0.65x)."""
        if self._loading:
            wait(list(self._loading.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _poll_load(self, lora_id: int) -> bool:
        """True once the adapter reached the host cache; starts a background load if needed."""
        future = self._loading.get(lora_id)
        if future is None:
            if lora_id not in self.registered:
                self._errors[lora_id] = LoRALoadError(f"LoRA adapter id {lora_id} is not registered")
                return False
            self._loading[lora_id] = self._loader.submit(self._read, self.registered[lora_id])
            return False
        if not future.done():
            return False
        del self._loading[lora_id]
        try:
            self._to_host(lora_id, to_adapter(future.result()))
        except LoRALoadError as exc:
            self._errors[lora_id] = exc
            return False
        return True

    def _place(self, lora_id: int) -> bool:
        adapter = self._host[lora_id]
        planned = self.shard(adapter) if self.shard is not None else adapter
        layout = plan_layout(planned, self.num_layers, self.block_elems, self.num_caches)
        if layout.num_blocks > self.pool.num_blocks:
            # Waiting would never help: fail the adapter's requests instead of stalling them.
            self._errors[lora_id] = LoRALoadError(
                f"LoRA adapter {adapter.name!r} needs {layout.num_blocks} KV blocks, more than the "
                f"whole KV cache ({self.pool.num_blocks} blocks); raise kv_cache_memory_bytes"
            )
            return False
        while len(self._device) >= self.config.max_loras:
            if not self.evict_idle():
                return False
        first = self.pool.allocate_contiguous(layout.num_blocks)
        while first is None:
            if not self.evict_idle():
                return False
            first = self.pool.allocate_contiguous(layout.num_blocks)
        self.write_adapter(adapter, layout, first)
        self._device[lora_id] = ResidentAdapter(layout, first)
        self.num_device_loads += 1
        return True

    def evict_idle(self) -> bool:
        """Frees the least recently used adapter no running request uses; False if none."""
        for lora_id in self._device:
            if not self._users.get(lora_id):
                self._evict_device(lora_id)
                return True
        return False

    def _evict_device(self, lora_id: int) -> None:
        resident = self._device.pop(lora_id, None)
        if resident is not None:
            self.pool.release(range(resident.first_block, resident.first_block + resident.layout.num_blocks))

    def resident(self, lora_id: int) -> ResidentAdapter:
        return self._device[lora_id]

    def acquire(self, lora_id: int) -> None:
        self._users[lora_id] = self._users.get(lora_id, 0) + 1

    def release(self, lora_id: int) -> None:
        self._users[lora_id] -= 1

    def device_blocks(self) -> set[int]:
        """Every KV block id holding a resident adapter."""
        return {
            b for r in self._device.values() for b in range(r.first_block, r.first_block + r.layout.num_blocks)
        }

    @property
    def num_device_blocks(self) -> int:
        return sum(r.layout.num_blocks for r in self._device.values())

    def resident_ids(self) -> list[int]:
        return list(self._device)

    def host_ids(self) -> list[int]:
        return list(self._host)

    def check_idle(self) -> None:
        """Leak check: no running request holds an adapter."""
        held = {i: n for i, n in self._users.items() if n}
        assert not held, f"adapters still pinned by requests: {held}"

    def free_all(self) -> None:
        """Evicts every resident adapter (their blocks go back to the pool)."""
        for lora_id in list(self._device):
            self._evict_device(lora_id)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
