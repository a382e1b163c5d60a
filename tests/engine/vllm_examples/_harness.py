"""Runs one example with its `vllm` imports rewritten to `pagedserve`, as a user would run it
(its own process, the environment's Hugging Face cache), then pickles what it left behind.

    python _harness.py EXAMPLE.py OUT.pkl

Values that cannot be pickled (engines, modules) are left out; `_leaks` records the engine's
leak check (None: no KV block or reference left).
"""

from __future__ import annotations

import pickle
import re
import sys
import types

_IMPORT = re.compile(r"^(\s*)(from|import)\s+vllm\b", re.M)


def main(example: str, out: str) -> None:
    with open(example) as f:
        source = f.read()
    if not _IMPORT.search(source):
        raise SystemExit(f"{example} does not import vllm")
    # A real __main__ module, as `python example.py` gives (pydantic resolves names through it).
    module = types.ModuleType("__main__")
    module.__file__ = example
    sys.modules["__main__"] = module
    namespace = module.__dict__
    exec(compile(_IMPORT.sub(r"\1\2 pagedserve", source), example, "exec"), namespace)  # noqa: S102
    engine = namespace.get("engine") or namespace["llm"].llm_engine
    try:
        engine.assert_no_leaks()
        leaks = None
    except AssertionError as exc:
        leaks = str(exc)
    kept = {"_leaks": leaks}
    for name, value in namespace.items():
        if name.startswith("__"):
            continue
        try:
            data = pickle.dumps(value)
        except Exception:  # noqa: BLE001, S112 - not data: skipped
            continue
        if b"__main__" not in data:  # the test process cannot load the example's own classes
            kept[name] = value
    with open(out, "wb") as f:
        pickle.dump(kept, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
