"""An advisory lock on a file, held across processes and released when its holder dies.

`fcntl.flock` belongs to the open file: a process killed mid-build drops it with its file
descriptors, so no lock outlives its owner (unlike a lock *file*, which a killed process leaves
behind). Platforms without fcntl get no lock; callers use it to avoid duplicate work or to know
that a marker left on disk is stale, never for correctness of what they write.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator


@contextlib.contextmanager
def file_lock(path: pathlib.Path) -> Iterator[None]:
    """Holds an exclusive lock on `path` (created if missing) for the `with` block."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
