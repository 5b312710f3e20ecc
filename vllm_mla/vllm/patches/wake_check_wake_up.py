"""Patch vLLM's worker wake-up so waking the weights after a level-2 sleep makes the
MLA weights check due.

Target: ``vllm.v1.worker.gpu_worker.Worker.wake_up(self, tags)`` (vLLM 0.32, 0.33).
Why: the weights woken after a level-2 sleep are remapped memory whose contents are
gone until ``reload_weights`` rewrites them.
How: the original runs unchanged, then ``vllm_mla.vllm.wake_check.STATE.on_wake(tags)``
(``tags`` None or with ``"weights"``: the armed check is due before the next step).
Removal: with ``wake_check_sleep``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_mla.vllm.wake_check import STATE


def make_wake_up(original: Callable) -> Callable:
    """The replacement for ``Worker.wake_up``."""

    @functools.wraps(original)
    def wake_up(self, tags: list[str] | None = None) -> None:
        result = original(self, tags)
        STATE.on_wake(tags)
        return result

    return wake_up
