"""nvfp4_ds_mla in B12X_MLA_SPARSE on the installed vLLM: accepted, written and read by
this project's codec, b12x declining it by name, and DeepSeek-V3.2's fused CUDA write
routed to the portable writer (the patch, driven here with a stand-in original)."""

from __future__ import annotations

import pytest
import torch
from test_sparse_backend import make_impl, numpy_buffer

from vllm_mla.ops.sparse_mla import nvfp4_record, write_records
from vllm_mla.vllm import plugin, telemetry
from vllm_mla.vllm.patches import PATCHES, dsv32_nvfp4_write, installed_minor
from vllm_mla.vllm.sparse import impl as impl_mod
from vllm_mla.vllm.sparse.backend import ACCEPTED_KV_CACHE_DTYPES, B12XMLASparseBackend

FMT = "nvfp4_ds_mla"


@pytest.fixture
def serving():
    dsv32_nvfp4_write.serve(False)
    yield
    dsv32_nvfp4_write.serve(False)


def test_the_backend_serves_the_352_byte_record(serving):
    """Accepted by name, read as nvfp4 records by the impl; the impl's construction is
    what turns the DSv3.2 fused-write patch on in the process."""
    assert FMT in ACCEPTED_KV_CACHE_DTYPES
    assert FMT in B12XMLASparseBackend.supported_kv_cache_dtypes
    assert impl_mod.kv_format_of(FMT) == FMT
    assert not dsv32_nvfp4_write._serving
    impl = make_impl(FMT, buffer=numpy_buffer()[0])
    assert impl.kv_format == FMT and dsv32_nvfp4_write._serving


def test_cpu_cache_write_is_the_codecs_bytes(serving):
    """do_kv_cache_update on CPU (vLLM's generic deepseek_v2 path) writes encode()'s bytes
    at the slots, skips -1, ignores k_scale (no per-tensor scale), and is counted."""
    impl = make_impl(FMT, buffer=numpy_buffer()[0])
    gen = torch.Generator().manual_seed(0)
    kv_c = torch.randn(5, 512, generator=gen).bfloat16()
    k_pe = torch.randn(5, 1, 64, generator=gen).bfloat16()
    cache = torch.full((2, 64, 352), 0x5A, dtype=torch.uint8)
    slots = torch.tensor([70, -1, 3, 127, 64])
    telemetry.reset()
    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, FMT, torch.tensor(3.0))
    want = torch.full_like(cache, 0x5A).view(-1, 352)
    keep = slots >= 0
    want[slots[keep]] = nvfp4_record.encode(kv_c, k_pe[:, 0])[keep]
    assert torch.equal(cache.view(-1, 352), want)
    assert telemetry.snapshot()["sparse"] == {f"kv_write:{FMT}": 1}


def test_b12x_declines_nvfp4_by_name_and_triton_serves():
    reason = impl_mod.b12x_format_declined(FMT)
    assert reason is not None and FMT in reason and "Triton" in reason
    assert impl_mod.b12x_format_declined("fp8_ds_mla") is None  # control: GLM_NSA's bytes
    assert impl_mod.serving_impl("b12x", kv_format=FMT) == "triton"
    assert impl_mod.serving_impl("b12x", kv_format="fp8_ds_mla") == "b12x"
    assert impl_mod.serving_impl("reference", kv_format=FMT) == "reference"


# -- the DSv3.2 fused write (CUDA model path), with a stand-in original --------------------
def stand_in():
    """An original that records its arguments and fills kv_c_out / k_pe_out as the real
    one does (normed / RoPE'd latents: here a fixed transform of the inputs)."""
    calls = []

    def original(positions, q_c, *rest, **kwargs):
        calls.append(dict(kwargs))
        kwargs["kv_c_out"].copy_(kwargs["kv_c_in"] * 2)
        kwargs["k_pe_out"].copy_(kwargs["k_pe_in"] - 1)
        return q_c + 1

    return original, calls


def call(fused, dtype=FMT, cache=True):
    gen = torch.Generator().manual_seed(1)
    kv_c = torch.randn(4, 512, generator=gen).bfloat16()
    k_pe = torch.randn(4, 64, generator=gen).bfloat16()
    mla = torch.zeros(2, 64, 352, dtype=torch.uint8) if cache else None
    slots = torch.tensor([5, 64, -1, 0])
    kwargs = dict(
        kv_c_in=kv_c,
        k_pe_in=k_pe,
        slot_mapping=slots,
        mla_kv_cache=mla,
        mla_kv_cache_dtype=dtype,
        mla_k_scale=torch.ones(()),
        kv_c_out=torch.empty_like(kv_c),
        k_pe_out=torch.empty_like(k_pe),
    )
    q = fused(torch.arange(4), torch.zeros(4, 8), **kwargs)
    return q, kwargs, mla


def test_fused_write_is_ours_while_nvfp4_is_served(serving):
    original, calls = stand_in()
    fused = dsv32_nvfp4_write.make_fused_norm_rope(original)
    dsv32_nvfp4_write.serve()
    telemetry.reset()
    q, kwargs, cache = call(fused)
    assert torch.equal(q, torch.ones(4, 8))  # the original's result, unchanged
    # the original ran without the cache: no nvfp4 code of vLLM's traced
    assert calls[-1]["mla_kv_cache"] is None and calls[-1]["mla_kv_cache_dtype"] == "auto"
    want = torch.zeros_like(cache)
    write_records(kwargs["kv_c_out"], kwargs["k_pe_out"], want, kwargs["slot_mapping"], FMT)
    assert torch.equal(cache, want) and (cache != 0).any()
    assert telemetry.snapshot()["sparse"] == {f"kv_write:{FMT}:fused_norm_rope": 1}


@pytest.mark.parametrize(
    ("serve", "dtype", "cache"),
    [(False, FMT, True), (True, "fp8_ds_mla", True), (True, FMT, False)],
)
def test_fused_write_is_vllms_otherwise(serving, serve, dtype, cache):
    """Not serving nvfp4 here (FLASHMLA_SPARSE's own SM100 path), another dtype, or no
    cache (profiling, PCP): the original gets every argument as given."""
    original, calls = stand_in()
    fused = dsv32_nvfp4_write.make_fused_norm_rope(original)
    dsv32_nvfp4_write.serve(serve)
    _, _, mla = call(fused, dtype, cache)
    assert calls[-1]["mla_kv_cache"] is mla and calls[-1]["mla_kv_cache_dtype"] == dtype


def test_the_patch_targets_vllms_fused_norm_rope():
    """The registry entry names the function DeepseekV32Attention.forward calls, with the
    installed vLLM's parameters (what the registry test checks for every patch), and it is
    applied when vLLM imports the module."""
    patch = next(p for p in PATCHES if p.name == "dsv32_nvfp4_write")
    try:
        from vllm.models.deepseek_v32 import attention
    except ImportError as exc:  # a vLLM build whose DSv3.2 CUDA model cannot import here
        pytest.skip(f"vllm.models.deepseek_v32.attention: {exc}")
    import inspect

    plugin.register()
    target = attention.fused_norm_rope
    original = getattr(target, "__wrapped__", target)
    params = patch.params_for(installed_minor())
    assert tuple(inspect.signature(original).parameters) == params
    assert getattr(target, "__wrapped__", None) is not None, "not applied on import"


def _config(backend: str | None):
    from vllm.config import AttentionConfig, CacheConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        cache_config=CacheConfig(cache_dtype=FMT),
        parallel_config=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
        attention_config=AttentionConfig(backend=backend),
    )


def test_vllm_034_accepts_nvfp4_with_dcp_for_this_backend_only():
    """vLLM 0.34 refuses nvfp4_ds_mla at DCP > 1 in a pydantic validator (a chunked prefill
    gather only FLASHMLA_SPARSE has); the patch lets B12X_MLA_SPARSE through and keeps the
    refusal for every other backend; reverting restores it."""
    from vllm_mla.vllm import patches

    patch = next(p for p in PATCHES if p.name == "nvfp4_dcp_validator")
    plugin.register()
    if patch.upstream_in(installed_minor()) is not None:  # 0.32, 0.33: no such refusal
        _config("B12X_MLA_SPARSE")
        _config("FLASHMLA_SPARSE")
        return
    _config("B12X_MLA_SPARSE")  # accepted
    with pytest.raises(ValueError, match="nvfp4_ds_mla KV cache is not supported with decode"):
        _config("FLASHMLA_SPARSE")
    patches.revert()
    try:
        with pytest.raises(ValueError, match="not supported with decode context parallelism"):
            _config("B12X_MLA_SPARSE")  # control: vLLM's own refusal without the patch
    finally:
        plugin.reset()
        plugin.register()
