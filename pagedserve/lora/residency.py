"""Whether an adapter can be used this step (the scheduler's question to the LoRA manager)."""

from __future__ import annotations

import enum


class Residency(enum.Enum):
    READY = enum.auto()  # resident on the device now
    LOADING = enum.auto()  # a disk load is under way; try again next step
    FAILED = enum.auto()  # the adapter cannot be loaded; its requests fail
