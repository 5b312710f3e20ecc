"""Patch ``pad_vocab_size``: a vocabulary every TP rank gets an equal share of.

Target: ``vllm.model_executor.layers.vocab_parallel_embedding.pad_vocab_size(vocab_size,
pad_to)`` (vLLM 0.32, 0.33, 0.34), feature ``tp-pad``.
Why: vLLM pads the vocabulary to a multiple of 64 and then divides it by the TP size,
which fails at 3 or 6 ranks (1024 / 3).
How: the original's size, grown to a multiple of ``lcm(pad_to, tp)`` where the TP size
does not divide it (``vllm_mla.tp_pad.padded_vocab``); vLLM's embedding loads the real
rows and zero-fills the rest, and its logits processor cuts the logits back to the real
vocabulary. Unchanged where TP divides it.
Removal: with ``tp_pad_config``.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla import tp_pad


def _tp_size() -> int:
    from vllm.distributed import parallel_state

    if parallel_state._TP is None:  # no TP group yet (a config-time call): nothing to share
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def make_pad_vocab_size(original: Callable) -> Callable:
    """The replacement for ``pad_vocab_size``."""

    def pad_vocab_size(vocab_size: int, pad_to: int = 64) -> int:
        return tp_pad.padded_vocab(original(vocab_size, pad_to), pad_to, _tp_size())

    return pad_vocab_size
