"""Resumable benchmark cells: each result saved as JSON the moment it is measured.

A long study (`pagedserve bench report --models ...`) is a list of cells; a cell is one
measurement of one model (a rate, a batch size, a quantization level...). Layout:

    <out>/cells/<model>/<part>/<key>.json    {"cell": {...}, "seconds": s, "result": {...}}

A rerun loads the cells on disk and runs only the missing ones, so an interrupted study
(Ctrl-C, a reboot, a crashed cell) loses at most the cell in flight. Each record carries the
settings it was measured under (`fingerprint`); a cell saved under other settings counts as
missing and is measured again, so one folder never mixes two configurations. A cell that raised is
saved too, with its error, so that a model that cannot run a cell (a quantization its
format lacks) is not retried every time; `retry_errors` reruns those.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.bench.common import json_clean, progress


@dataclass(frozen=True)
class Cell:
    """One measurement: `part` of the study on `model` at `key` (e.g. "batch", "16").

    `cost` is a guess of the work (tokens through the model), only used to share the
    elapsed time out into a time-left estimate.
    """

    model: str
    part: str
    key: str
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    cost: float = field(default=1.0, compare=False)

    @property
    def name(self) -> str:
        return f"{self.model} / {self.part} / {self.key}"


def slug(text: str) -> str:
    """A file-name-safe form of a model name or key ('a/b c' -> 'a_b_c')."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_") or "_"


class CellStore:
    """The cells of one study folder: which are done, their results, saving new ones."""

    def __init__(self, out_dir: str | Path, fingerprint: dict[str, Any] | None = None) -> None:
        self.root = Path(out_dir) / "cells"
        self.fingerprint = json_clean(fingerprint or {})

    def path(self, cell: Cell) -> Path:
        return self.root / slug(cell.model) / slug(cell.part) / f"{slug(cell.key)}.json"

    def load(self, cell: Cell) -> dict[str, Any] | None:
        """The saved record of `cell` (None when it has not run, or ran under other settings)."""
        try:
            record: dict[str, Any] = json.loads(self.path(cell).read_text())
        except (OSError, ValueError):
            return None
        return record if record.get("fingerprint", {}) == self.fingerprint else None

    def save(self, cell: Cell, result: dict[str, Any], seconds: float) -> dict[str, Any]:
        record = {"cell": {"model": cell.model, "part": cell.part, "key": cell.key, "params": cell.params},
                  "fingerprint": self.fingerprint, "seconds": seconds, "date": time.strftime("%Y-%m-%d %H:%M"),
                  "result": result}
        path = self.path(cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(json_clean(record), indent=1) + "\n")
        os.replace(tmp, path)  # atomic: a cell file is whole or absent
        return record


def run_cells(
    cells: Iterable[Cell], store: CellStore, measure: Callable[[Cell], dict[str, Any]],
    show_progress: bool = True, retry_errors: bool = False,
) -> tuple[dict[Cell, dict[str, Any]], int]:
    """Runs every cell not saved yet; returns (cell -> saved record, number run now).

    The bar counts cells; its postfix is the time left, estimated from the cost of the cells
    still to run at the rate (seconds per unit of cost) the cells run so far achieved.
    """
    cells = list(cells)
    records: dict[Cell, dict[str, Any]] = {}
    todo = []
    for cell in cells:
        record = store.load(cell)
        if record is not None and not (retry_errors and "error" in record["result"]):
            records[cell] = record
        else:
            todo.append(cell)
    left = sum(c.cost for c in todo)
    done_cost, spent = 0.0, 0.0
    with progress(len(cells), "study", show_progress, leave=True) as bar:
        bar.update(len(records))
        for cell in todo:
            bar.set_description_str(cell.name)
            start = time.perf_counter()
            try:
                result = measure(cell)
            except Exception as exc:  # one failing cell must not lose the others
                result = {"error": f"{type(exc).__name__}: {exc}"}
            seconds = time.perf_counter() - start
            records[cell] = store.save(cell, result, seconds)
            done_cost, spent, left = done_cost + cell.cost, spent + seconds, left - cell.cost
            bar.set_postfix_str(f"~{format_duration(spent / done_cost * left)} left" if done_cost else "")
            bar.update(1)
    return records, len(todo)


def format_duration(seconds: float) -> str:
    """'42 s', '7.5 min', '2.1 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
