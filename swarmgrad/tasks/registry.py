"""Task names -> factories, and ``get_task`` which also accepts ``module:attribute`` specs."""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable

from swarmgrad.errors import ConfigError
from swarmgrad.tasks.base import Task

TaskFactory = Callable[..., Task]
TASKS: dict[str, TaskFactory] = {}


def register_task(name: str, factory: TaskFactory, *, replace: bool = False) -> TaskFactory:
    """Make ``factory(**options)`` available as ``name``; returns the factory (usable as a decorator body)."""
    if ":" in name or not name:
        raise ConfigError(f"task name {name!r} must be non-empty and contain no ':' (that marks module:attribute)")
    if name in TASKS and not replace and TASKS[name] is not factory:
        raise ConfigError(f"task {name!r} is already registered; pass replace=True to override it")
    TASKS[name] = factory
    return factory


def get_task(spec: str, **options: Any) -> Task:
    """A registered task by name, or ``module:attribute`` naming a Task or a factory returning one.

    Options whose value is None are dropped, so a CLI can pass every flag it has (``data_dir=None``)
    without each task having to accept it.
    """
    options = {key: value for key, value in options.items() if value is not None}
    if ":" in spec:
        target, where = _import_attribute(spec), spec
    elif spec in TASKS:
        target, where = TASKS[spec], f"task {spec!r}"
    else:
        close = difflib.get_close_matches(spec, TASKS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown task {spec!r}.{hint} Built-in tasks: {', '.join(sorted(TASKS))}; "
                          "or pass module:attribute naming your own Task")
    if isinstance(target, Task):
        if options:
            raise ConfigError(f"{where} is a ready-made Task and takes no options; got {', '.join(sorted(options))}")
        return target
    if not callable(target):
        raise ConfigError(f"{where} is a {type(target).__name__}, not a Task or a function returning one")
    _check_options(target, options, where)
    task = target(**options)
    if not isinstance(task, Task):
        raise ConfigError(f"{where} returned a {type(task).__name__}, expected a swarmgrad.tasks.Task")
    return task


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


def _check_options(factory: TaskFactory, options: dict[str, Any], where: str) -> None:
    """Reject unknown options here, with their names, instead of as a TypeError from inside the factory."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call speak for itself
    try:
        signature.bind(**options)
    except TypeError:
        accepted = [name for name, p in signature.parameters.items()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise ConfigError(f"{where} does not take option(s) {', '.join(sorted(options))}; "
                          f"it accepts: {', '.join(accepted) or 'no options'}") from None
