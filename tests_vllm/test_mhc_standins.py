"""GLM-5.3-Flash's mHC blocks on CPU (``cpu_glm5next_mhc_*``): vLLM's own decoder-layer
methods with its mHC ops answered by their torch paths, and the layer's RMSNorm, which
vLLM CPU drops, applied.

Tolerance: the norm is checked against RMSNorm written out here in fp32; vLLM's rounds to
bf16 twice (the normalized value, then its product with the bf16 weight), each within
2**-8 relative, so 2**-7 relative per element.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from vllm_mla.vllm import patches

N, D = 4, 64
EPS = 1e-6
BF16_TWICE = 2.0**-7  # two bf16 roundings (module docstring)
MODEL = "vllm.models.glm5next.common.model"


def _method(name: str):
    """(the patch's replacement, vLLM's own method) for ``Glm5NextDecoderLayer.<name>``."""
    patch = next(p for p in patches.PATCHES if p.name == f"cpu_glm5next_mhc_{name}")
    layer_cls = importlib.import_module(MODEL).Glm5NextDecoderLayer
    original = getattr(layer_cls, patch.qualname.split(".")[-1])
    if getattr(original, patches.MARK, None):  # the plugin applied it in this process
        original = original.__wrapped__
    return patch.build(original), original


def _layer():
    """What vLLM's mHC methods read of the decoder layer; the ops built without vLLM's
    config (their torch paths need no state)."""
    mhc = importlib.import_module("vllm.model_executor.layers.mhc")
    ops = {
        "mhc_pre_op": mhc.MHCPreOp,
        "mhc_post_op": mhc.MHCPostOp,
        "mhc_fused_post_pre_op": mhc.MHCFusedPostPreOp,
    }
    return SimpleNamespace(
        rms_norm_eps=EPS,
        hc_eps=EPS,
        mhc_post_mult_value=2.0,
        mhc_sinkhorn_iterations=20,
        **{name: cls.__new__(cls) for name, cls in ops.items()},
    )


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mix = (2 + N) * N
    return {
        "streams": torch.randn(5, N, D, generator=gen).bfloat16(),
        "fn": torch.randn(mix, N * D, generator=gen) / (N * D) ** 0.5,
        "scale": torch.rand(3, generator=gen) + 0.5,
        "base": torch.randn(mix, generator=gen),
        "weight": (1 + 0.2 * torch.randn(D, generator=gen)).bfloat16(),
        "out": torch.randn(5, D, generator=gen).bfloat16(),
    }


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * weight.float()


def _torch_pre(x):
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    return mhc_pre_torch(x["streams"], x["fn"], x["scale"], x["base"], EPS, EPS, EPS, 2.0, 20)


def test_the_pre_block_normalizes_the_layer_input_vllm_cpu_leaves_raw():
    pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
    hc_pre, _ = _method("pre")
    layer, x = _layer(), _inputs()
    op = layer.mhc_pre_op
    post, comb, got = hc_pre(layer, x["streams"], x["fn"], x["scale"], x["base"], x["weight"], EPS)
    assert layer.mhc_pre_op is op  # the op is the layer's own again
    want_post, want_comb, raw = _torch_pre(x)
    assert torch.equal(post, want_post) and torch.equal(comb, want_comb)
    torch.testing.assert_close(got.float(), _rms_norm(raw, x["weight"]), rtol=BF16_TWICE, atol=0)
    assert not torch.allclose(got.float(), raw.float(), rtol=0.1)  # the norm matters here


def test_the_fused_block_expands_then_normalizes_the_next_input():
    pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    fused, _ = _method("fused_post_pre")
    layer, x = _layer(), _inputs(1)
    post, comb, _ = _torch_pre(x)
    args = (x["out"], x["streams"], post, comb, x["fn"], x["scale"], x["base"], x["weight"], EPS)
    residual, _, _, got = fused(layer, *args)
    want_residual = mhc_post_torch(x["out"], x["streams"], post, comb)
    assert torch.equal(residual, want_residual)
    _, _, raw = _torch_pre({**x, "streams": want_residual})
    torch.testing.assert_close(got.float(), _rms_norm(raw, x["weight"]), rtol=BF16_TWICE, atol=0)


def test_the_last_post_block_is_vllms_torch_expansion():
    pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    hc_post, _ = _method("post")
    layer, x = _layer(), _inputs(2)
    post, comb, _ = _torch_pre(x)
    got = hc_post(layer, x["out"], x["streams"], post, comb)
    assert torch.equal(got, mhc_post_torch(x["out"], x["streams"], post, comb))


def test_off_the_cpu_vllms_method_runs_unchanged():
    seen = []
    patch = next(p for p in patches.PATCHES if p.name == "cpu_glm5next_mhc_post")
    hc_post = patch.build(lambda *args: seen.append(args) or "vllm")
    meta = torch.empty(2, D, device="meta")
    assert hc_post(object(), meta, meta, meta, meta) == "vllm" and len(seen) == 1
