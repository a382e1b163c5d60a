"""`pagedserve serve --data-parallel-size N --distributed-executor-backend ray`: the replica set."""

from __future__ import annotations

import argparse

from pagedserve.distributed.replica_set import ReplicaSetEngine
from pagedserve.engine.async_engine import EngineObserver
from pagedserve.engine_args import EngineArgs


def build_replica_set(args: argparse.Namespace, engine_args: EngineArgs, observer: EngineObserver) -> ReplicaSetEngine:
    """The replicas the flags ask for; exits with a message on a combination that cannot run."""
    if engine_args.distributed_executor_backend != "ray":
        raise SystemExit("pagedserve: --data-parallel-size N needs --distributed-executor-backend ray")
    if engine_args.data_parallel_size < 1:
        raise SystemExit("pagedserve: --data-parallel-size must be >= 1")
    if getattr(args, "enable_lora_runtime_updates", False):
        # Adapters loaded at run time would be lost when Ray restarts a replica; --lora-modules
        # are registered again on every replica that comes back.
        raise SystemExit("pagedserve: --enable-lora-runtime-updates is not supported with replicas; "
                         "use --lora-modules")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit("pagedserve: replicas need Ray: pip install 'pagedserve[distributed]'") from None
    return ReplicaSetEngine(engine_args, engine_args.data_parallel_size, observer)
