"""B12X_MLA_SPARSE refuses, never silently changes: every layer it does not serve fails at
start-up, naming the setting, the backend and what it serves (vLLM 0.33, CPU).

Two places, both at start-up: backend selection (``supports_combination``, which vLLM's
forced-backend check, ``CudaPlatform.get_attn_backend_cls``, turns into a ValueError),
and impl construction inside vLLM's own ``MLAAttention`` / HY-V4 attention module
(``refuse_layer``: what the selector is not shown, and vLLM CPU, whose selector the plugin
routes to this backend unvalidated).

GLM-5.3-Flash's latent-512 MLA without RoPE (head_size 512, qk_rope_head_dim 0) is served
(tests_vllm/test_sparse_rope0.py runs it); any other latent or RoPE width stays refused.

HY-V4's learnable attention sink is served (tests_vllm/test_sparse_sink.py runs it); what
stays refused about it: a ``sinks`` tensor that is not fp32 ``[heads]`` and a sink model's
layer built without its sinks (a sink under decode context parallelism is served).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_sparse_backend import TOPK
from test_sparse_dcp import dcp_config
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from vllm_mla.formats import HEAD_DIM, LATENT, ROPE, SPARSE_BACKEND
from vllm_mla.vllm.sparse.backend import B12XMLASparseBackend
from vllm_mla.vllm.sparse.impl import B12XMLASparseImpl
from vllm_mla.vllm.sparse.served import SERVES

SERVED = "it serves sparse MLA of a DSA model"  # the summary every refusal ends with
HY_V4 = {  # a one-layer HY-V4 (HYV4ForCausalLM) with its default learnable sink
    "hidden_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "index_topk": TOPK,
    "index_n_heads": 4,
    "layer_types": ["sparse_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


@pytest.fixture
def current(monkeypatch, registered, no_default_quant_scales):
    """The shared VllmConfig, current, with this backend forced (``--attention-backend``);
    ``current(hf)`` swaps in a model's hf config; default: the shared DeepSeek config, DSA
    (index_topk set) unless ``dsa=False``."""

    def use(hf=None, dsa=True, dcp=1):
        config = stack.enter_context(dcp_config(monkeypatch, dcp, 0))
        if hf is not None:
            monkeypatch.setattr(config.model_config, "hf_text_config", hf)
        elif dsa:
            monkeypatch.setattr(config.model_config.hf_text_config, "index_topk", TOPK, False)
        monkeypatch.setattr(config.compilation_config, "static_forward_context", {})
        monkeypatch.setattr(config.cache_config, "cache_dtype", "bfloat16")
        backend = AttentionBackendEnum[SPARSE_BACKEND]
        monkeypatch.setattr(config.attention_config, "backend", backend)
        return config

    with contextlib.ExitStack() as stack:
        yield use


def hy_v4(**change):
    from vllm.transformers_utils.configs.hy_v4 import HYV4Config

    return HYV4Config(**{**HY_V4, **change})


def glm_5_3_flash():
    """GLM-5.3-Flash's text config (transformers' defaults): latent 512, no RoPE, DSA."""
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig()


# -- backend selection: what vLLM's forced-backend check raises with ---------------------
def forced(head=HEAD_DIM, kv="bfloat16", mla=True, sparse=True, sink=False):
    """The reasons vLLM's forced-backend check gets (``get_attn_backend_cls`` with a
    selected backend: ``validate_configuration(device_capability=,
    **AttentionSelectorConfig._asdict())``, then ValueError listing them)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selector = AttentionSelectorConfig(
        head_size=head,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv,
        block_size=64,
        use_mla=mla,
        has_sink=sink,
        use_sparse=sparse,
    )
    reasons = B12XMLASparseBackend.validate_configuration(
        device_capability=DeviceCapability(12, 0), **selector._asdict()
    )
    ours = [r for r in reasons if r.startswith(SPARSE_BACKEND)]
    assert len(ours) <= 1 and all(SERVED in r for r in ours)
    return ours[0] if ours else None


def test_forced_selection_accepts_what_it_serves(current):
    current()
    assert forced() is None
    assert B12XMLASparseBackend.supports_sink()
    assert not B12XMLASparseBackend.supports_sliding_window()


def test_forced_selection_serves_hy_v4s_learnable_sink(current):
    """HY-V4 probes its sparse backend with has_sink=False (nvidia/attention.py:346), then
    binds the one the selector picks where it ``supports_sink`` (``_resolve_sink_backend``):
    ours, with the sink."""
    current(hy_v4())
    assert forced() is None and forced(sink=True) is None


def test_forced_selection_serves_a_sink_under_dcp(current):
    """Under DCP the impl counts the group's sinks once (``impl.dcp_sinks``): served, with
    its model and has_sink as the selector shows it; the no-sink model too."""
    current(hy_v4(), dcp=2)
    assert forced() is None and forced(sink=True) is None
    current(hy_v4(learnable_sink=False), dcp=2)
    assert forced() is None


def test_forced_selection_serves_glm_5_3_flash_without_rope(current):
    """head_size 512 = kv_lora_rank 512 + qk_rope_head_dim 0: served, with its model; other
    head sizes (a latent-256 layer) and a latent-256 NoPE model stay refused, named."""
    current(glm_5_3_flash())
    assert SERVES.head_sizes == (HEAD_DIM, LATENT)
    assert forced(head=LATENT) is None
    assert "head_size 256 (kv_lora_rank + qk_rope_head_dim)" in forced(head=256)
    from transformers import Glm5NextTextConfig

    current(Glm5NextTextConfig(kv_lora_rank=256))
    reason = forced(head=256)
    assert "hf config head_size 256 = kv_lora_rank 256 + qk_rope_head_dim 0" in reason


def test_forced_selection_refuses_a_dense_mla_model(current):
    current(dsa=False)  # DeepSeek-V2: MLA, no indexer
    assert "hf config has no index_topk" in forced()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"sparse": False}, "use_sparse=False"),
        ({"mla": False}, "use_mla=False"),
        ({"kv": "fp8_e5m2"}, "kv_cache_dtype=fp8_e5m2"),
    ],
)
def test_forced_selection_refuses_other_layers(current, change, named):
    current()
    assert named in forced(**change)


# -- start-up: the layer as vLLM builds it ------------------------------------------------
def mla_attention(**change):
    """vLLM's own MLAAttention with this backend bound (as HY-V4 binds its sink backend)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    kwargs = {
        "num_heads": 4,
        "scale": 1.0,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": 64,
        "q_lora_rank": None,
        "kv_lora_rank": SERVES.latent,
        "kv_b_proj": torch.nn.Linear(2, 2),
        "prefix": "model.layers.0.self_attn.attn",
        "attn_backend": B12XMLASparseBackend,
        "use_sparse": True,
        "topk_indices_buffer": torch.full((8, TOPK), -1, dtype=torch.int32),
    }
    return MLAAttention(**{**kwargs, **change})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({}, None),  # control: served
        ({"sinks": torch.zeros(4)}, None),  # served: HY-V4's fp32 [heads] sink
        ({"sliding_window": 128}, "sliding_window=128"),
        ({"sinks": torch.zeros(4, dtype=torch.bfloat16)}, "sinks torch.bfloat16 [4] (the kernel"),
        ({"sinks": torch.zeros(3)}, "sinks torch.float32 [3] (the kernel takes an fp32 [4]"),
        ({"qk_rope_head_dim": 0}, None),  # served: latent 512 without RoPE (GLM-5.3-Flash)
        ({"kv_lora_rank": 256}, "head_size 320 = kv_lora_rank 256 + qk_rope_head_dim 64"),
        (
            {"kv_lora_rank": 256, "qk_rope_head_dim": 0},
            "head_size 256 = kv_lora_rank 256 + qk_rope_head_dim 0",
        ),
        ({"qk_rope_head_dim": 32}, "head_size 544 = kv_lora_rank 512 + qk_rope_head_dim 32"),
    ],
)
def test_vllms_mla_attention_refuses_at_construction(current, change, named):
    current()
    if named is None:
        impl = mla_attention(**change).impl
        assert isinstance(impl, B12XMLASparseImpl)
        assert impl.sinks is change.get("sinks") and impl.caps.sink == ("sinks" in change)
        assert impl.caps.rope == change.get("qk_rope_head_dim", ROPE)
        return
    with pytest.raises(NotImplementedError, match="does not serve this attention layer") as e:
        mla_attention(**change)
    assert named in str(e.value) and SPARSE_BACKEND in str(e.value) and SERVED in str(e.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"alibi_slopes": [1.0]}, "alibi_slopes"),
        ({"logits_soft_cap": 30.0}, "logits_soft_cap=30.0"),
        ({"attn_type": "encoder"}, "attn_type=encoder"),
        ({"kv_sharing_target_layer_name": "l0"}, "kv_sharing_target_layer_name='l0'"),
        ({"num_kv_heads": 2}, "num_kv_heads=2"),
    ],
)
def test_the_impl_refuses_what_vllms_mla_layer_never_passes(current, change, named):
    """Settings vLLM's MLAAttention fixes (None, decoder, one KV head): refused if given."""
    current()
    kwargs = {
        "num_heads": 4,
        "head_size": HEAD_DIM,
        "scale": 1.0,
        "num_kv_heads": 1,
        "alibi_slopes": None,
        "sliding_window": None,
        "kv_cache_dtype": "bfloat16",
        "logits_soft_cap": None,
        "attn_type": "decoder",
        "kv_sharing_target_layer_name": None,
        "topk_indices_buffer": torch.full((8, TOPK), -1, dtype=torch.int32),
    }
    with pytest.raises(NotImplementedError, match=named):
        B12XMLASparseImpl(**{**kwargs, **change})


def hy_v4_attention(config):
    """HY-V4's own attention module (``HYV4MLAAttention``, layer 0) for ``config``'s model,
    as its decoder layer builds it."""
    from vllm.models.hy_v4.nvidia.attention import HYV4MLAAttention
    from vllm.utils.torch_utils import set_default_torch_dtype

    hf = config.model_config.hf_text_config
    with set_default_torch_dtype(torch.bfloat16):
        return HYV4MLAAttention(
            config,
            hf,
            hf.hidden_size,
            hf.num_attention_heads,
            hf.qk_nope_head_dim,
            hf.qk_rope_head_dim,
            hf.v_head_dim,
            hf.q_lora_rank,
            hf.kv_lora_rank,
            cache_config=config.cache_config,
            prefix="model.layers.0.self_attn",
            topk_indices_buffer=torch.full((8, TOPK), -1, dtype=torch.int32),
        )


@pytest.mark.parametrize("sink", [True, False])
def test_hy_v4s_attention_is_served_with_its_sink(current, sink):
    """HY-V4's own attention module, this backend forced: it binds ours (supports_sink)
    and hands the impl its fp32 [heads] sink Parameter, which the impl keeps (the weights
    load into it later) and declares in its plan's capacities; without a sink, none."""
    attention = hy_v4_attention(current(hy_v4(learnable_sink=sink)))
    impl = attention.mla_attn.impl
    assert isinstance(impl, B12XMLASparseImpl) and attention.mla_attn.attn_backend is not None
    assert impl.caps.sink == sink
    if sink:
        assert impl.sinks is attention.learnable_sink_param
        assert impl.sinks.dtype == torch.float32 and impl.sinks.shape == (4,)
    else:
        assert impl.sinks is None


def test_hy_v4s_sink_under_dcp_builds_with_its_sinks(current):
    """Under DCP (vLLM CPU routes the selection unvalidated) HY-V4's layer builds with its
    sink Parameter; the group's sinks are gathered at post-load (test_sparse_dcp)."""
    attention = hy_v4_attention(current(hy_v4(), dcp=2))
    impl = attention.mla_attn.impl
    assert impl.dcp.size == 2 and impl.sinks is attention.learnable_sink_param


def test_a_sink_models_layer_without_its_sinks_is_refused(current):
    """A layer of a sink model arriving without ``sinks`` (HY-V4 builds it so where it
    finds no sink-capable backend, warning only) would drop the sink: refused."""
    current(hy_v4())
    with pytest.raises(NotImplementedError, match="a layer without sinks in a model") as e:
        mla_attention()
    assert SPARSE_BACKEND in str(e.value) and SERVED in str(e.value)
