"""Task names -> factories, found as the ``TaskFactory`` objects of this package's modules (a new
task is a new module here), and ``get_task``, which also accepts ``module:attribute`` specs."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pydantic

from swarmgrad.errors import ConfigError
from swarmgrad.settings import describe_validation_error
from swarmgrad.tasks.base import Task, TaskFactory, TaskOptions


def find_tasks(package: ModuleType | None = None) -> dict[str, TaskFactory]:
    """Task name -> factory, from every public module of ``package`` (this registry's own, which is
    loaded before any of its modules; sorted by name)."""
    package = package or sys.modules[__package__]
    found: dict[str, TaskFactory] = {}
    for module_info in pkgutil.iter_modules(package.__path__):
        if module_info.name == "registry" or module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        for factory in vars(module).values():
            if isinstance(factory, TaskFactory) and found.setdefault(factory.name, factory) is not factory:
                raise ConfigError(f"task {factory.name!r} is defined twice (again in {module.__name__})")
    return dict(sorted(found.items()))


TASKS = find_tasks()


def get_task(spec: str, options: Mapping[str, Any] | None = None, data_dir: str | Path | None = None) -> Task:
    """A registered task by name, or ``module:attribute`` naming a Task or a TaskFactory, built with
    ``options`` (checked against the task's ``TaskOptions``) and ``data_dir`` (see TaskFactory)."""
    options = dict(options or {})
    if ":" not in spec:
        factory = _registered(spec)
    else:
        target = _import_attribute(spec)
        if isinstance(target, Task):
            if options:
                raise ConfigError(f"{spec!r} is a ready-made Task and takes no options; "
                                  f"got {', '.join(sorted(options))}")
            return target
        if not isinstance(target, TaskFactory):
            raise ConfigError(f"{spec!r} is a {type(target).__name__}, not a swarmgrad.tasks.Task or TaskFactory")
        factory = target
    task = factory.build(parse_options(factory, options), None if data_dir is None else Path(data_dir))
    if not isinstance(task, Task):
        raise ConfigError(f"task {factory.name!r} built a {type(task).__name__}, expected a swarmgrad.tasks.Task")
    return task


def parse_options(factory: TaskFactory, options: Mapping[str, Any]) -> TaskOptions:
    """``options`` as the task's ``TaskOptions``; an unknown option or a bad value is one ConfigError
    naming the task and the option."""
    try:
        return factory.options.model_validate(dict(options))
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "extra_forbidden":
            takes = ", ".join(factory.options.model_fields) or "no options"
            raise ConfigError(f"task {factory.name!r} has no option {first['loc'][0]!r}; it takes: {takes}") from None
        if not first["loc"]:  # the options together (a model validator)
            raise ConfigError(f"task {factory.name!r}: {describe_validation_error(error)}") from None
        raise ConfigError(f"task {factory.name!r}: option {describe_validation_error(error)} "
                          f"(got {first['input']!r})") from None


def _registered(name: str) -> TaskFactory:
    if name in TASKS:
        return TASKS[name]
    close = difflib.get_close_matches(name, TASKS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown task {name!r}.{hint} Built-in tasks: {', '.join(TASKS)}; "
                      "or pass module:attribute naming your own Task or TaskFactory")


def _import_attribute(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"task spec {spec!r} must look like 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"cannot import module {module_name!r} for task {spec!r}: {error}. Is it installed, "
                          "or on PYTHONPATH (e.g. run from its directory with PYTHONPATH=.)?") from error
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as error:
            raise ConfigError(f"module {module_name!r} has no attribute {attribute!r} (task {spec!r})") from error
    return target
