"""Every training strategy, found as one module of this package each (its ``StrategySettings``
subclass and its policy): a new strategy is a new module here, and ``RunConfig``'s ``Strategy``
union, its averaging check, ``make_policy``, help texts and error messages all read this table.

Importing it imports the strategy modules, which load without torch (base.py says how).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Protocol, Union

import pydantic

from swarmgrad.errors import ConfigError
from swarmgrad.peer.strategies.base import StrategySettings

if TYPE_CHECKING:
    import torch

    from swarmgrad.peer.strategies.base import Policy, ProgressCounter

NOT_STRATEGIES = frozenset({"base", "registry"})  # the package's modules that define no strategy


def find_strategies(package: ModuleType | None = None) -> dict[str, type[StrategySettings]]:
    """Strategy name -> settings class, from every module of ``package`` (this registry's own, which
    is loaded before any of its modules; sorted by module name)."""
    package = package or sys.modules[__package__]
    found: dict[str, type[StrategySettings]] = {}
    for module_info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
        if module_info.name in NOT_STRATEGIES or module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        for settings in vars(module).values():
            if (isinstance(settings, type) and issubclass(settings, StrategySettings)
                    and settings.__module__ == module.__name__):
                name = settings.model_fields["name"].default
                if name in found:
                    raise ConfigError(f"strategy {name!r} is defined twice: {found[name].__module__} and "
                                      f"{module.__name__}")
                found[name] = settings
    return found


STRATEGIES = find_strategies()
# Union[...] rather than X | Y: the members are a tuple found at import
Strategy = Annotated[Union[tuple(STRATEGIES.values())], pydantic.Field(discriminator="name")]  # noqa: UP007


def check_averaging(strategy: StrategySettings, kind: str) -> None:
    """Refuse an averaging kind that ``strategy``'s rounds do not work with, as one ConfigError."""
    if kind not in strategy.averagings:
        raise ConfigError(f"strategy {strategy.name} does not work with {kind} averaging; "
                          f"use {' or '.join(strategy.averagings)}")


class RunSettings(Protocol):
    """What ``make_policy`` reads of a RunConfig (peer/config.py builds its union from this module)."""

    strategy: Any
    averaging: Any


def make_policy(config: RunSettings, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                progress: ProgressCounter) -> Policy:
    """The policy of ``config.strategy``; gossip averaging makes it asynchronous (no shared epochs)."""
    return config.strategy.make_policy(model, optimizer, progress, synchronous=config.averaging.kind != "gossip")
