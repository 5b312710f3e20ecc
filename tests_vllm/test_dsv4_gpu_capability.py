"""Patch ``dsv4_gpu_capability``: vLLM's DeepSeek-V4 CUDA selector, run with the device
capability of each GPU generation, refuses at start-up what its backends declare they
cannot serve (vLLM's own classes and declarations; the CUDA platform is stood in for)."""

from __future__ import annotations

import types

import pytest

from vllm_mla.vllm import patches

model = pytest.importorskip("vllm.models.deepseek_v4.nvidia.model")


@pytest.fixture
def on_gpu(monkeypatch):
    """Sets the capability vLLM's selector sees; returns (original, patched) selectors."""
    from vllm.platforms.interface import DeviceCapability

    def set_capability(major: int, minor: int = 0):
        platform = types.SimpleNamespace(
            get_device_capability=lambda: DeviceCapability(major, minor)
        )
        monkeypatch.setattr(model, "current_platform", platform)
        original = model._select_dsv4_attn_cls
        (patch,) = [p for p in patches.PATCHES if p.name == "dsv4_gpu_capability"]
        return original, patch.build(original)

    return set_capability


def config(backend=None):
    return types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=backend))


@pytest.mark.parametrize(("major", "minor"), [(8, 0), (8, 6), (8, 9)])
def test_sm8x_is_refused_with_every_backends_declaration(on_gpu, major, minor):
    original, select = on_gpu(major, minor)
    # vLLM alone hands SM8x FlashMLA's class, which fails in a kernel at the first step
    assert original(config()) is model.DeepseekV4FlashMLAAttention
    with pytest.raises(ValueError) as refused:
        select(config())
    text = str(refused.value)
    assert f"compute capability {major}.{minor}" in text
    picked = "picked DeepseekV4FlashMLAAttention (FLASHMLA_SPARSE_DSV4) for attention backend"
    assert f"{picked} auto" in text
    assert "DeepseekV4FlashMLAAttention (FLASHMLA_SPARSE_DSV4): 9.x / 10.x" in text
    assert "DeepseekV4FlashInferSM120Attention (FLASHINFER_MLA_SPARSE_DSV4): 10.x / 12.x" in text


@pytest.mark.parametrize(
    ("major", "expected"),
    [
        (9, "DeepseekV4FlashMLAAttention"),
        (10, "DeepseekV4FlashMLAAttention"),
        (12, "DeepseekV4FlashInferSM120Attention"),
    ],
)
def test_what_vllm_serves_is_left_alone(on_gpu, major, expected):
    original, select = on_gpu(major)
    assert select(config()) is original(config()) is getattr(model, expected)


def test_a_forced_backend_the_gpu_cannot_run_is_refused_by_name(on_gpu):
    backends = model.AttentionBackendEnum
    _, select = on_gpu(12)
    with pytest.raises(ValueError, match="for attention backend FLASHMLA_SPARSE_DSV4"):
        select(config(backends.FLASHMLA_SPARSE_DSV4))
    _, select = on_gpu(9)
    with pytest.raises(ValueError, match=r"picked DeepseekV4FlashInferMLAAttention"):
        select(config(backends.FLASHINFER_MLA_SPARSE_DSV4))
    _, select = on_gpu(10)
    assert select(config(backends.FLASHINFER_MLA_SPARSE_DSV4)) is (
        model.DeepseekV4FlashInferMLAAttention
    )
