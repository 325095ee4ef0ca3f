"""Run a callback once a module is imported, without importing it: configuring hivemind's logging must
not cost a command that ends before it needs hivemind (``import hivemind`` loads torch, ~1.5 s)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Callable, Optional, Sequence


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` now if ``name`` is imported, else right after the module ``name`` executes."""
    if name in sys.modules:
        callback()
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` through the other finders and wraps its loader's exec_module; one use, then gone."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = next((found for finder in sys.meta_path if hasattr(finder, "find_spec")
                     for found in [finder.find_spec(fullname, path, target)] if found is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback = spec.loader, self.callback

        class _ThenCallback(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                callback()

        spec.loader = _ThenCallback()
        return spec
