"""Resolve the device a (possibly quantized or wrapped) linear module lives on."""

from __future__ import annotations

import torch
from torch import nn

# Tensor attributes checked first, in the order quant methods name their main tensor.
DEVICE_ATTRS = ("weight", "qweight", "weight_packed")


class DeviceResolutionError(RuntimeError):
    """The module holds no tensor from which a device can be read."""


def resolve_device(module: nn.Module) -> torch.device:
    """Device of ``module``'s weights.

    Looks at ``weight``, ``qweight``, ``weight_packed``, then a wrapped
    ``base_layer`` (LoRA and similar wrappers), then any parameter or buffer.
    Guarantees a device or raises DeviceResolutionError naming the module.
    """
    for attr in DEVICE_ATTRS:
        tensor = getattr(module, attr, None)
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and base is not module:
        try:
            return resolve_device(base)
        except DeviceResolutionError:
            pass
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    raise DeviceResolutionError(
        f"cannot resolve the device of {type(module).__name__}: it has no "
        f"{', '.join(DEVICE_ATTRS)}, base_layer, parameter or buffer"
    )
