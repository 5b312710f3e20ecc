"""A test-only fault seam for the absorbed-weight lifecycle.

Every allocation, copy, dequantization chunk and release step of post-load and reload
calls ``site(kind, name)`` first. With no injector installed (always, outside tests)
that is one global write (the step reached, which a failure's error names) and a
comparison. Tests install an injector with
``inject(fn)``: ``fn(kind, name)`` may raise to simulate a failure at that point; it
also lets them count and list the sites a run passes through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

SITE_KINDS = ("alloc", "copy", "dequant", "release")

Injector = Callable[[str, str], None]
_injector: Injector | None = None
_last: tuple[str, str] | None = None  # the last site reached since ``begin``


def site(kind: str, name: str) -> None:
    """A point where a real failure could happen (allocation, copy, decode, release)."""
    global _last
    _last = (kind, name)
    if _injector is not None:
        _injector(kind, name)


def begin() -> None:
    """Start a lifecycle run: no step reached yet."""
    global _last
    _last = None


def last_step() -> str | None:
    """``"kind name"`` of the last site reached since ``begin`` (None before the first)."""
    return None if _last is None else f"{_last[0]} {_last[1]}"


@contextmanager
def inject(fn: Injector) -> Iterator[None]:
    """Install ``fn`` as the injector for the duration of the block (not re-entrant)."""
    global _injector
    if _injector is not None:
        raise RuntimeError("a fault injector is already installed")
    _injector = fn
    try:
        yield
    finally:
        _injector = None
