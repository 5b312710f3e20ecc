"""Catch MLA weights that sleep level 2 discarded and nobody reloaded (feature ``wake-check``).

vLLM's recovery from ``sleep(level=2)`` is ``wake_up(tags=["weights"])`` ->
``reload_weights`` -> ``wake_up(tags=["kv_cache"])``; forgetting the reload serves
garbage with no warning, and vLLM keeps no "weights discarded, not reloaded" flag. Here:

- every MLA post-load (initial load and every ``reload_weights``) registers the layer
  (a weak reference; nothing is computed or allocated inside post-load);
- ``Worker.sleep(level=2)``, before vLLM discards anything, fingerprints each layer's
  absorbed weights and kept sources (``vllm_mla.weights.fingerprint``: on the device,
  outside any graph, kept on the host) and arms the check; a post-load while armed (a
  reload) marks its layer as rewritten;
- ``Worker.wake_up`` with the weights makes the check due; the first
  ``Worker.execute_model`` while it is due compares every layer not rewritten since
  the sleep once: a changed fingerprint raises (``VLLM_MLA_WAKE_CHECK=raise``,
  default) or logs (``warn``) one line naming the layers; ``off`` does nothing.

Cost outside those moments: one attribute test per ``execute_model`` (per step, not per
layer), nothing on the decode path itself.
"""

from __future__ import annotations

import logging
import weakref

from torch import nn

from vllm_mla import envs
from vllm_mla.memory.ledger import layer_owners
from vllm_mla.weights.fingerprint import fingerprint

logger = logging.getLogger("vllm_mla")
MESSAGE = (
    "weights of {n} MLA layers were discarded by sleep level 2 and not reloaded: "
    "call reload_weights before serving ({layers})"
)


class WeightsDiscarded(RuntimeError):
    """MLA weights changed since their last (re)load: a level-2 sleep without reload."""


class WakeCheck:
    """The registered layers, their pre-sleep fingerprints and the sleep state."""

    def __init__(self) -> None:
        self.layers: dict[str, weakref.ref] = {}
        self.prints: dict[str, tuple] = {}  # taken at the level-2 sleep
        self.rewritten: set[str] = set()  # post-loaded (reloaded) since that sleep
        self.armed = False  # a level-2 sleep happened since the last check
        self.due = False  # ... and the weights were woken up: check before serving

    def register(self, layer: nn.Module, name: str) -> None:
        """After a post-load: ``layer`` is served from now on (a reload while armed
        rewrote its weights, so the check skips it)."""
        self.layers[name] = weakref.ref(layer)
        if self.armed:
            self.rewritten.add(name)

    def _live(self) -> dict[str, nn.Module]:
        alive = {name: ref() for name, ref in self.layers.items()}
        for name in [n for n, layer in alive.items() if layer is None]:
            del self.layers[name]
        return {n: layer for n, layer in alive.items() if layer is not None}

    @staticmethod
    def fingerprint_of(layer: nn.Module) -> tuple:
        return fingerprint([t for group in layer_owners(layer).values() for t in group])

    def on_sleep(self, level: int) -> None:
        """Before vLLM's sleep: a level-2 sleep fingerprints every layer and arms."""
        if level < 2 or envs.wake_check_mode() == "off":
            return
        self.prints = {name: self.fingerprint_of(layer) for name, layer in self._live().items()}
        self.rewritten = set()
        self.armed = True

    def on_wake(self, tags: list[str] | None) -> None:
        if self.armed and (tags is None or "weights" in tags):
            self.due = True

    def mismatched(self) -> list[str]:
        """Layers (alive, not rewritten since the sleep) whose weights changed."""
        return [
            name
            for name, layer in self._live().items()
            if name not in self.rewritten
            and name in self.prints
            and self.fingerprint_of(layer) != self.prints[name]
        ]

    def before_step(self) -> None:
        """Called at each ``execute_model``: compares once after a level-2 wake-up."""
        if not self.due:
            return
        self.due = self.armed = False
        changed = self.mismatched() if envs.wake_check_mode() != "off" else []
        self.prints, self.rewritten = {}, set()
        if not changed:
            logger.info("vllm-mla: MLA weights intact after the level-2 wake-up")
            return
        shown = ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "")
        message = MESSAGE.format(n=len(changed), layers=shown)
        if envs.wake_check_mode() == "raise":
            raise WeightsDiscarded(message)
        logger.warning("vllm-mla: %s", message)

    def reset(self) -> None:
        self.layers.clear()
        self.prints.clear()
        self.rewritten.clear()
        self.armed = self.due = False


STATE = WakeCheck()
