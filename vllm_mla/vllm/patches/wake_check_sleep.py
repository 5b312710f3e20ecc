"""Patch vLLM's worker sleep so a level-2 sleep arms the MLA weights check.

Target: ``vllm.v1.worker.gpu_worker.Worker.sleep(self, level)`` (vLLM 0.32, 0.33; the
CPU worker overrides it with a no-op, as CPU has no sleep mode).
Why: sleep level 2 discards the weights; vLLM keeps no flag for "discarded and not
reloaded", so forgetting ``reload_weights`` serves garbage with no warning.
How: first ``vllm_mla.vllm.wake_check.STATE.on_sleep(level)`` (level 2: fingerprint the
MLA layers while their memory is intact, arm the check; see ``wake_check_wake_up`` and
``wake_check_execute_model``), then the original, unchanged.
Removal: when vLLM refuses to serve weights discarded and not reloaded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_mla.vllm.wake_check import STATE


def make_sleep(original: Callable) -> Callable:
    """The replacement for ``Worker.sleep``."""

    @functools.wraps(original)
    def sleep(self, level: int = 1) -> None:
        STATE.on_sleep(level)  # before vLLM discards anything
        return original(self, level)

    return sleep
