"""Patch ``DefaultModelLoader.get_all_weights``: zero-pad checkpoint tensors to the padded
config.

Target: ``vllm.model_executor.model_loader.default_loader.DefaultModelLoader
.get_all_weights(self, model_config, model)`` (vLLM 0.32, 0.33, 0.34), feature ``tp-pad``.
Why: the padded config (``tp_pad_config``) sizes every rank's shard of the padded width;
the checkpoint holds the real width, so the last rank's weight loader would narrow past
its end.
How: where the config carries a padding record, each tensor the loader yields goes
through ``vllm_mla.tp_pad.pad_tensor`` (zero rows or columns by name; a clear error for a
tensor that cannot be padded in whole rows). The first load and ``reload_weights`` both
read the checkpoint here. Without a record the original's iterator is returned as is.
Removal: with ``tp_pad_config``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from vllm_mla import tp_pad
from vllm_mla.vllm.patches.tp_pad_config import RECORD


def make_get_all_weights(original: Callable) -> Callable:
    """The replacement for ``DefaultModelLoader.get_all_weights``."""

    def get_all_weights(self, model_config, model) -> Iterator:
        weights = original(self, model_config, model)
        record = getattr(model_config.hf_text_config, RECORD, None)
        if record is None:
            return weights
        pad = tp_pad.TPPad.from_record(record)
        return ((name, tp_pad.pad_tensor(name, tensor, pad)) for name, tensor in weights)

    return get_all_weights
