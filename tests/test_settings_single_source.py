"""Every setting's default and choice list is written once (issue 34.1).

The config dataclasses (`pagedserve/config.py`) own the defaults and the choice tuples;
`EngineArgs` refers to them, and `core/`, `worker/`, `quantization/`, `structured_outputs/`
import the tuples. These tests read the source, so a second copy fails here even while it
still agrees with the first.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pagedserve
from pagedserve import config, engine_args, envs
from pagedserve.engine_args import EngineArgs

PACKAGE = pathlib.Path(pagedserve.__file__).parent
CONFIG_CLASSES = (config.ModelConfig, config.CacheConfig, config.SchedulerConfig, config.LoRAConfig,
                  config.ParallelConfig, config.EngineConfig, config.StructuredOutputsConfig)
# EngineArgs name -> the config field whose default it takes, where the names differ.
RENAMED = {"gpu_memory_utilization": "memory_utilization", "swap_space": "swap_space_bytes"}


def _config_fields() -> dict[str, dataclasses.Field]:
    found: dict[str, dataclasses.Field] = {}
    for cls in CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            found.setdefault(f.name, f)
    return found


def _engine_args_defaults() -> dict[str, ast.expr]:
    tree = ast.parse(pathlib.Path(engine_args.__file__).read_text())
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    defaults = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(stmt.value, ast.Call):
            for kw in stmt.value.keywords:
                if kw.arg == "default":
                    defaults[stmt.target.id] = kw.value
    return defaults


def test_engine_args_take_each_default_from_the_config() -> None:
    fields = _config_fields()
    defaults = _engine_args_defaults()
    # (a config field with no default, like ModelConfig.model, has nothing to restate)
    shared = [name for name in defaults if RENAMED.get(name, name) in fields
              and fields[RENAMED.get(name, name)].default is not dataclasses.MISSING]
    assert len(shared) >= 30, shared  # the check must cover the settings, not pass vacuously
    restated = [name for name in shared if isinstance(defaults[name], (ast.Constant, ast.Tuple, ast.List))]
    assert not restated, f"EngineArgs states these defaults again instead of taking the config's: {restated}"
    args = EngineArgs(model="m")
    for name in shared:
        expected = fields[RENAMED.get(name, name)].default
        if name == "swap_space":
            expected = expected / 2**30
        assert getattr(args, name) == expected, name


def _string_tuples(path: pathlib.Path) -> list[tuple[frozenset[str], int]]:
    tuples = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Tuple) and len(node.elts) >= 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            tuples.append((frozenset(e.value for e in node.elts), node.lineno))
    return tuples


def _choice_lists() -> dict[frozenset[str], str]:
    """The choice tuples config.py and envs.py define: set of values -> name."""
    lists = {}
    for module in (config, envs):
        for name, value in vars(module).items():
            if name.isupper() or name.startswith("_") and name[1:].isupper():
                if isinstance(value, tuple) and len(value) >= 2 and all(isinstance(v, str) for v in value):
                    lists[frozenset(value)] = f"{module.__name__}.{name}"
    return lists


def test_the_choice_lists_exist() -> None:
    names = set(_choice_lists().values())
    for name in ("SCHEDULING_POLICIES", "PREEMPTION_MODES", "KV_CACHE_DTYPES", "LORA_DTYPES",
                 "STRUCTURED_OUTPUT_BACKENDS", "QUANTIZATION_METHODS", "KV_ALLOCATIONS", "BATCHING_POLICIES"):
        assert f"pagedserve.config.{name}" in names


def test_no_choice_list_is_written_twice() -> None:
    """Outside config.py / envs.py, no tuple literal holds the values of a setting's choice list.
    (Inside them two settings may share values, e.g. "cpp" / "off" for two kernels.)"""
    lists = _choice_lists()
    homes = {pathlib.Path(config.__file__), pathlib.Path(envs.__file__)}
    copies = [f"{path.relative_to(PACKAGE)}:{line} restates {lists[values]}"
              for path in sorted(PACKAGE.rglob("*.py")) if path not in homes
              for values, line in _string_tuples(path) if values in lists]
    assert not copies, copies


def test_environment_is_read_only_in_envs() -> None:
    readers = [f"{path.relative_to(PACKAGE)}:{node.lineno}"
               for path in sorted(PACKAGE.rglob("*.py")) if path.name != "envs.py"
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
               and isinstance(node.value, ast.Name) and node.value.id == "os"]
    assert not readers, f"environment variables are read in pagedserve/envs.py only: {readers}"


def test_preemption_policy_and_scheduler_config_agree() -> None:
    from pagedserve.core.scheduler import PreemptionPolicy, SchedulerLimits

    assert PreemptionPolicy().mode == config.SchedulerConfig().preemption_mode
    assert SchedulerLimits(1, 1).policy == config.SchedulerConfig().scheduling_policy
