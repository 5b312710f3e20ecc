"""Features ``sparse`` and ``sparse-cpu`` on vLLM's real config and platform code (CPU).

Each blocker a DSA model meets on vLLM CPU, with B12X_MLA_SPARSE selected, is shown
handled through vLLM's own entry points (``EngineArgs.create_engine_config``, the CPU
platform's classmethods, the DeepSeek model's quantization alias, the indexer metadata
builder), and shown unhandled with the plugin off (each fix has a failing control).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_mla.ops import sparse_indexer
from vllm_mla.vllm import plugin
from vllm_mla.vllm.sparse import cpu as sparse_cpu
from vllm_mla.vllm.sparse.registration import CLASS_PATH

DSA_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 1,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_topk": 32,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsa-config")
    (folder / "config.json").write_text(json.dumps(DSA_CONFIG))
    return folder


def engine_config(model, backend: str, kv: str = "bfloat16"):
    """vLLM's own config pipeline: EngineArgs -> VllmConfig (platform hooks included)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model),
        dtype="bfloat16",  # vLLM 0.33 itself refuses a bf16 cache on an fp32 model
        skip_tokenizer_init=True,
        max_model_len=256,
        kv_cache_dtype=kv,
        attention_config={"backend": backend},
        enforce_eager=True,
    )
    return args.create_engine_config()


@pytest.fixture
def off(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_FEATURES", "lifecycle")
    plugin.reset()
    plugin.register()
    yield
    plugin.reset()


def test_a_dsa_config_with_our_backend_gets_64_row_pages_and_keeps_bf16(registered, dsa_dir):
    config = engine_config(dsa_dir, "B12X_MLA_SPARSE", kv="bfloat16")
    assert config.cache_config.block_size == 64
    assert config.cache_config.cache_dtype == "bfloat16"  # not auto
    # carried as CUSTOM: a process that unpickles the config before plugins load resolves it
    assert config.attention_config.backend.name == "CUSTOM"


def test_controls_without_the_plugin_or_with_another_backend(registered, dsa_dir):
    other = engine_config(dsa_dir, "CPU_MLA", kv="bfloat16")
    assert other.cache_config.cache_dtype == "auto"  # upstream's remap, untouched
    # the CPU MLA decode kernel's: vLLM forces 16 for an explicit CPU_MLA on every host, AMX
    # too (only an unselected backend gets AMX MLA's 128, see the test below)
    assert other.cache_config.block_size == 16


def test_without_sparse_cpu_the_block_size_is_not_ours(off, dsa_dir):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if "B12X_MLA_SPARSE" not in AttentionBackendEnum.__members__:
        register_backend("B12X_MLA_SPARSE", CLASS_PATH)
    config = engine_config(dsa_dir, "B12X_MLA_SPARSE", kv="bfloat16")
    assert config.cache_config.block_size in (16, 128)  # CPU MLA's 16, or AMX hosts' 128
    assert config.cache_config.cache_dtype == "auto"  # dsv32_bf16_cache is feature sparse


def selector(sparse: bool = True):
    return SimpleNamespace(use_sparse=sparse, use_mla=True)


def test_the_cpu_platform_lets_our_sparse_backend_through(registered):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_mla.vllm.sparse import registration

    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector())  # unclaimed
    registration.claim_custom()
    for member in (AttentionBackendEnum["B12X_MLA_SPARSE"], AttentionBackendEnum.CUSTOM):
        assert CpuPlatform.get_attn_backend_cls(member, selector()) == CLASS_PATH
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.FLASHMLA_SPARSE, selector())


def test_control_the_cpu_platform_refuses_it_without_the_patch(off):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, selector())


def test_the_indexer_query_quantization_runs_on_cpu(registered):
    from vllm.model_executor.models import deepseek_v2

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 256, generator=gen)
    values, scales = deepseek_v2.per_token_group_quant_fp8(q, 128, use_ue8m0=True)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (5, 2)
    want_v, want_s = sparse_indexer.quantize_rows(q.view(5, 2, 128), ue8m0=True, floor=1e-10)
    assert torch.equal(scales, want_s) and torch.equal(values.view(5, 2, 128), want_v)
    assert bool((scales.view(torch.int32) & 0x007FFFFF == 0).all())  # powers of two


def test_control_vllms_own_query_quantization_needs_triton(off):
    from vllm.model_executor.models import deepseek_v2
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("Triton runs here")
    with pytest.raises((AttributeError, TypeError, RuntimeError)):
        deepseek_v2.per_token_group_quant_fp8(torch.randn(2, 128), 128, use_ue8m0=True)


def two_requests_chunk(build, **extra):
    """vLLM's prefill chunk metadata for two requests: 3 new tokens after 2 cached, then 4
    new tokens from scratch (one chunk, no compression)."""
    query_start_loc = torch.tensor([0, 3, 7], dtype=torch.int32)
    seq_lens = torch.tensor([5, 4], dtype=torch.int32)
    lens = (seq_lens, seq_lens, seq_lens)
    table = torch.zeros(2, 4, dtype=torch.int32)
    return build(0, 2, query_start_loc, query_start_loc, *lens, table, compress_ratio=1, **extra)


def test_vllms_prefill_chunk_metadata_builds_through_our_kernel(registered):
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.attention.backends.mla.indexer import build_prefill_chunk_metadata

    if HAS_TRITON:
        pytest.skip("Triton runs here: vLLM's own kernel serves")
    chunk = two_requests_chunk(build_prefill_chunk_metadata)
    assert chunk.cu_seq_lens.tolist() == [0, 5, 9]
    assert chunk.cu_seqlen_ks.tolist() == [0, 0, 0, 5, 5, 5, 5]
    assert chunk.cu_seqlen_ke.tolist() == [3, 4, 5, 6, 7, 8, 9]  # row start + causal length
    assert chunk.token_to_seq.tolist() == [0] * 5 + [1] * 4


def test_vllms_shardq_positions_decide_each_tokens_context(registered):
    """vLLM 0.34 passes each token's position (ShardQ: a request's tokens need not be its
    last ones); the stand-in's causal lengths follow the positions, not the token order."""
    import inspect

    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.attention.backends.mla.indexer import build_prefill_chunk_metadata

    if HAS_TRITON:
        pytest.skip("Triton runs here: vLLM's own kernel serves")
    if "positions" not in inspect.signature(build_prefill_chunk_metadata).parameters:
        pytest.skip("this vLLM passes no positions (before 0.34)")
    positions = torch.tensor([4, 2, 3, 1, 3, 0, 2], dtype=torch.int64)  # out of order
    chunk = two_requests_chunk(build_prefill_chunk_metadata, positions=positions)
    assert chunk.cu_seqlen_ks.tolist() == [0, 0, 0, 5, 5, 5, 5]
    assert chunk.cu_seqlen_ke.tolist() == [5, 3, 4, 7, 9, 6, 8]  # row start + position + 1


def test_our_indexer_is_what_vllm_instantiates(registered):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm_layers import vllm_config

    with set_current_vllm_config(vllm_config()):
        made = SparseAttnIndexer(
            SimpleNamespace(prefix="k_cache"),
            128,
            "ue8m0",
            32,
            128,
            256,
            4096,
            torch.full((8, 32), -1, dtype=torch.int32),
        )
    assert type(made).__name__ == "PortableSparseAttnIndexer"
    assert isinstance(made, SparseAttnIndexer) and not made.vllm_mla_ours  # CPU: forward_cpu
    assert "register_oot" in sparse_cpu.register()  # once per process, said so


def test_step_contexts_read_vllms_indexer_metadata():
    from vllm_mla.vllm.sparse.indexer import step_contexts

    decode = SimpleNamespace(
        requires_padding=False,
        seq_lens=torch.tensor([[7], [3]]),
        block_table=torch.tensor([[5, 6], [7, 8]], dtype=torch.int32),
    )
    chunk = SimpleNamespace(
        token_start=2,
        token_end=5,
        cu_seq_lens=torch.tensor([0, 4]),
        cu_seqlen_ks=torch.tensor([0, 0, 0]),
        cu_seqlen_ke=torch.tensor([2, 3, 4]),
        block_table=torch.tensor([[9, 10]], dtype=torch.int32),
    )
    chunk.max_seqlen_k = 4
    meta = SimpleNamespace(
        num_decodes=2,
        num_decode_tokens=2,
        decode=decode,
        num_prefills=1,
        prefill=SimpleNamespace(chunks=[chunk]),
        max_seq_len=7,
    )
    groups = step_contexts(meta)
    assert [g[0].tolist() for g in groups] == [[0, 1], [2, 3, 4]]  # decode, then the chunk
    assert [g[2].tolist() for g in groups] == [[7, 3], [2, 3, 4]]
    assert [g[1].tolist() for g in groups] == [[[5, 6], [7, 8]], [[9, 10]] * 3]
    assert [g[3] for g in groups] == [7, 4]  # host bounds: no sync
    # native MTP: seq_lens [B, next_n] -> one row per draft position, its table repeated
    decode.seq_lens = torch.tensor([[6, 7], [2, 3]])
    meta.num_prefills = 0
    ((rows, tables, lengths, _),) = step_contexts(meta)
    assert rows.tolist() == [0, 1, 2, 3] and lengths.tolist() == [6, 7, 2, 3]
    assert tables.tolist() == [[5, 6], [5, 6], [7, 8], [7, 8]]
    del chunk.max_seqlen_k  # vLLM 0.32's chunks: the step's max_seq_len bounds them
    meta.num_prefills = 1
    assert step_contexts(meta)[-1][3] == 7
    # ragged drafts (requires_padding): decode_lens [2, 1], packed rows, last column = L_b
    decode.requires_padding = True
    decode.seq_lens = torch.tensor([[6, 7], [2, 3]])
    decode.decode_lens = torch.tensor([2, 1], dtype=torch.int32)
    meta.num_prefills, meta.num_decode_tokens = 0, 3
    ((rows, tables, lengths, _),) = step_contexts(meta)
    assert rows.tolist() == [0, 1, 2] and lengths.tolist() == [6, 7, 3]
    assert tables.tolist() == [[5, 6], [5, 6], [7, 8]]
