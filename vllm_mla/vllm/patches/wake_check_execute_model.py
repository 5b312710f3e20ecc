"""Patch vLLM's worker step so the first step after a level-2 wake-up checks the MLA
weights before serving.

Target: ``vllm.v1.worker.gpu_worker.Worker.execute_model(self, scheduler_output)``
(vLLM 0.32, 0.33; the CPU worker inherits it).
Why: the first step after the wake-up is the last moment before discarded weights
would produce output; a reload in between re-records the fingerprints.
How: when the check is due, ``vllm_mla.vllm.wake_check.STATE.before_step()`` compares
every recorded MLA layer once (raise / warn per ``VLLM_MLA_WAKE_CHECK``); then the
original runs unchanged. Otherwise one attribute test per step.
Removal: with ``wake_check_sleep``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_mla.vllm.wake_check import STATE


def make_execute_model(original: Callable) -> Callable:
    """The replacement for ``Worker.execute_model``."""

    @functools.wraps(original)
    def execute_model(self, scheduler_output):
        if STATE.due:
            STATE.before_step()
        return original(self, scheduler_output)

    return execute_model
