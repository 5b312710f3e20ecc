"""Device resolution for quantized and wrapped kv_b_proj modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_mla.weights import DeviceResolutionError, resolve_device

META = torch.device("meta")  # a device no fallback would guess


def module_with(**tensors) -> nn.Module:
    m = nn.Module()
    for name, (kind, t) in tensors.items():
        if kind == "param":
            m.register_parameter(name, nn.Parameter(t, requires_grad=False))
        elif kind == "buffer":
            m.register_buffer(name, t)
        else:
            setattr(m, name, t)
    return m


@pytest.mark.parametrize("attr", ["weight", "qweight", "weight_packed"])
def test_named_weight_attributes(attr):
    m = module_with(**{attr: ("param", torch.empty(2, 2, device=META))})
    m.register_buffer("other", torch.empty(1))  # cpu, must not win
    assert resolve_device(m) == META


def test_plain_tensor_attribute_counts():
    m = module_with(qweight=("attr", torch.empty(1, device=META)))
    assert resolve_device(m) == META


def test_named_attribute_wins_over_other_parameters():
    m = module_with(
        bias=("param", torch.empty(2)),
        weight_packed=("param", torch.empty(2, device=META)),
    )
    assert resolve_device(m) == META


def test_wrapped_base_layer():
    wrapper = nn.Module()
    wrapper.register_parameter("lora_a", nn.Parameter(torch.empty(1), requires_grad=False))
    wrapper.base_layer = module_with(qweight=("param", torch.empty(1, device=META)))
    assert resolve_device(wrapper) == META


def test_any_parameter_or_buffer():
    assert resolve_device(module_with(scales=("buffer", torch.empty(1, device=META)))) == META
    assert resolve_device(module_with(w_q=("param", torch.empty(1, device=META)))) == META


def test_nothing_to_resolve_is_a_clear_error():
    class Empty(nn.Module):
        pass

    with pytest.raises(DeviceResolutionError, match=r"Empty.*weight, qweight, weight_packed"):
        resolve_device(Empty())
