"""Run a callback right after a module is first imported: an import hook, never an import.

Some of what the plugin installs belongs to one model's vLLM package (GLM-5.3-Flash's
``vllm.models.glm5next``), whose import costs a vLLM process seconds; a process serving
another model must not pay it. ``when_imported`` defers the work to the moment vLLM loads
that module (when it resolves the model class, before any layer is built).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType

Callback = Callable[[ModuleType], None]
_pending: dict[str, list[Callback]] = {}


class _ThenCallbacks(importlib.abc.Loader):
    """``loader``, then the callbacks waiting for the module it executed."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        callbacks = _pending.pop(module.__name__, [])
        self.loader.exec_module(module)
        for callback in callbacks:
            callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a waited-for module as the path finder does and wraps its loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCallbacks(spec.loader)
        return spec


_FINDER = _Finder()


def when_imported(name: str, callback: Callback) -> bool:
    """Call ``callback(module)`` once ``name`` has been imported: now if it already is
    (returns True), else right after its first import (returns False)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return True
    _pending.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return False


def pending() -> dict[str, int]:
    """{module: callbacks still waiting for its import}."""
    return {name: len(callbacks) for name, callbacks in _pending.items()}


def cancel(names: Iterable[str] | None = None) -> None:
    """Drop the callbacks waiting for ``names`` (None: every one); the hook leaves once
    none waits (the patch registry's ``revert``, the plugin's ``reset``, tests)."""
    for name in list(_pending) if names is None else names:
        _pending.pop(name, None)
    if not _pending and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


__all__ = ["cancel", "pending", "when_imported"]
