"""Aggregation rules: how a part's owner combines the contributions it received (moshpit), and how a
gossiping peer takes in the pushes that arrived (gossip), when any of them may lie.

One module per rule, named after it (``trimmed_mean.py`` is ``trimmed-mean``), whose ``RULE`` is a
``base.Rule``. The names are read from the package's files, not from the modules, so validation,
help texts and errors get them without importing torch, and a new rule is one new module.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Rule

_NOT_RULES = {"base"}  # what the rules share
RULE_NAMES: tuple[str, ...] = tuple(sorted(
    module.name.replace("_", "-") for module in pkgutil.iter_modules(__path__) if module.name not in _NOT_RULES))


class UnknownRule(ValueError):
    """No rule of that name: the message names the rules there are."""


def get_rule(name: str) -> Rule:
    """The rule called ``name`` (its module is imported on first use)."""
    if name not in RULE_NAMES:
        raise UnknownRule(f"unknown aggregator {name!r}; use one of {', '.join(RULE_NAMES)}")
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}").RULE
