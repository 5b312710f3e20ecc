"""Every decode layout vLLM's own DSA indexer metadata builder produces, read by ours.

vLLM's ``DeepseekV32IndexerMetadataBuilder`` (built here from vLLM's classes with a
speculative config of k draft tokens) lays the decode tokens out natively (``seq_lens [B,
next_n]``) for next_n <= 2 off DeepGEMM, flattened to one row per token otherwise (through
its ``PrepareUniformDecodeKernel``, Triton: on vLLM CPU our torch stand-in, checked here
against vLLM's kernel in Triton's interpreter), and marks a native batch with requests of
fewer tokens ``requires_padding``. For each, the portable indexer's ``step_contexts`` must
give every decode token its request's block-table row and its exact causal length: token
``i`` of a request with ``d`` tokens and ``L`` keys in all attends to ``L - d + 1 + i``.
"""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace

import interpreted
import pytest
import torch

from vllm_mla.vllm.sparse import cpu as sparse_cpu
from vllm_mla.vllm.sparse.indexer import step_contexts

WIDTH = 4  # block-table columns
SEQ = (100, 70, 9)  # keys per request after this step


def builder_for(k: int):
    """vLLM's indexer metadata builder under a config speculating ``k`` tokens."""
    import vllm_layers
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    config = copy.copy(vllm_layers.vllm_config())
    spec = SimpleNamespace(
        num_speculative_tokens=k, enable_adaptive_verification=False, parallel_drafting=False
    )
    object.__setattr__(config, "speculative_config", spec)
    kv_spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    with set_current_vllm_config(config):
        builder = DeepseekV32IndexerMetadataBuilder(
            kv_spec, ["indexer"], config, torch.device("cpu"), block_table_width=WIDTH
        )
    return builder, config


def batch(lens: list[int]):
    """vLLM's CommonAttentionMetadata of requests with ``lens`` query tokens each."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq = torch.tensor(SEQ[: len(lens)], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(lens)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        seq_lens_cpu_upper_bound=seq,
        num_reqs=len(lens),
        num_actual_tokens=tokens,
        max_query_len=max(lens),
        max_seq_len=int(seq.max()),
        block_table_tensor=torch.arange(len(lens) * WIDTH, dtype=torch.int32).view(-1, WIDTH),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
    )


def truth(lens: list[int]) -> tuple[list[int], list[int]]:
    """(each decode token's causal length, its request's first block id)."""
    lengths, first_block = [], []
    for b, d in enumerate(lens):
        lengths += [SEQ[b] - d + 1 + i for i in range(d)]
        first_block += [b * WIDTH] * d
    return lengths, first_block


def needs_the_torch_stand_in():
    """vLLM CPU runs the builder's Triton kernel through our register_kernels stand-in; a
    CUDA vLLM on CPU would launch the real kernel without a GPU."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("this vLLM launches PrepareUniformDecodeKernel in Triton (needs a GPU)")
    sparse_cpu.register()


@pytest.mark.parametrize(
    ("k", "lens", "layout"),
    [
        (1, [2, 2, 2], "native"),  # MTP 1: next_n 2 natively, seq_lens [B, 2]
        (3, [4, 4, 4], "flat"),  # MTP 3: flattened through PrepareUniformDecodeKernel
        (3, [4, 2, 3], "flat"),  # ragged drafts flattened (torch in vLLM itself)
    ],
)
def test_every_decode_token_gets_its_exact_context(k, lens, layout):
    from vllm.config import set_current_vllm_config

    if lens == [4, 4, 4]:
        needs_the_torch_stand_in()
    builder, config = builder_for(k)
    with set_current_vllm_config(config):
        meta = builder.build(0, batch(lens))
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_prefills) == (3, sum(lens), 0)
    seq_lens = meta.decode.seq_lens  # native: [B, next_n]; flattened: one row per token
    per_row = seq_lens.shape[1] if seq_lens.dim() == 2 else 1
    assert (seq_lens.shape[0], per_row) == ((3, k + 1) if layout == "native" else (sum(lens), 1))
    ((rows, tables, lengths, _),) = step_contexts(meta)
    want_lengths, want_blocks = truth(lens)
    assert rows.tolist() == list(range(sum(lens)))
    assert lengths.tolist() == want_lengths
    assert tables[:, 0].tolist() == want_blocks


def padded_native_meta(builder, seq: list[int], localize: bool = False) -> SimpleNamespace:
    """vLLM's native decode preparation (its own method) of requests of 3, 1, 4 and 0
    tokens (the last a CUDA-graph padding request, vLLM's own example) with ``seq`` keys
    each: requires_padding, seq_lens [B, 4]; with ``localize`` then its per-token DCP
    localization (the builder's DCP fields set by the caller). The indexer metadata."""
    lens = torch.tensor([3, 1, 4, 0], dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    table = torch.arange(4 * WIDTH, dtype=torch.int32).view(4, WIDTH)
    seq_lens, block_table, decode_lens, _, padded = builder._prepare_decode_tensors(
        seq_lens=seq_t,
        block_table=table,
        decode_lens=lens,
        decode_lens_cpu=lens,
        query_start_loc=qsl,
        num_decodes=4,
        num_decode_tokens=8,
        use_native=True,
        next_n=4,
        max_decode_len=4,
    )
    assert padded and seq_lens.shape == (4, 4)
    if localize:
        seq_lens = builder._dcp_localize_decode_seq_lens(seq_lens, 4, True)
    decode = SimpleNamespace(
        seq_lens=seq_lens, block_table=block_table, decode_lens=decode_lens, requires_padding=True
    )
    return SimpleNamespace(
        num_decodes=4,
        num_decode_tokens=8,
        decode=decode,
        num_prefills=0,
        prefill=None,
        max_seq_len=max(seq),
    )


def test_padded_native_batches_count_each_requests_own_tokens():
    """Ours gives each real token of a padded native batch its exact context and the
    padding none."""
    builder, _ = builder_for(3)
    ((_, tables, lengths, _),) = step_contexts(padded_native_meta(builder, [10, 7, 12, 0]))
    assert lengths.tolist() == [8, 9, 10, 7, 9, 10, 11, 12]
    assert tables[:, 0].tolist() == [0, 0, 0, 4, 8, 8, 8, 8]


STAND_IN = r"""
import types
import torch
import triton
import triton.language as tl
from vllm.v1.attention.backends.mla.indexer import PrepareUniformDecodeKernel
from vllm_mla.vllm.sparse.cpu import prepare_uniform_decode

# Without a GPU driver vLLM's triton.jit is a placeholder that returns the plain function:
# jit that very function with the real Triton (interpreted), its `tl` the real one.
fn = PrepareUniformDecodeKernel.kernel
fn = getattr(fn, "fn", fn)
kernel = triton.jit(types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl}, fn.__name__))

seq = torch.tensor([100, 70, 9, 1], dtype=torch.int32)
table = torch.arange(4 * 5, dtype=torch.int32).view(4, 5)
for n in (1, 2, 4):
    outs = []
    for run in ("vllm", "ours"):
        lens = torch.full((32,), -7, dtype=torch.int32)
        expanded = torch.full((32, 5), -7, dtype=torch.int32)
        decode_lens = torch.full((32,), -7, dtype=torch.int32)
        if run == "vllm":
            kernel[(4 * n,)](seq, lens, table, 5, expanded, 5, decode_lens, n, BLOCK_SIZE=1024)
        else:
            prepare_uniform_decode(seq, lens, table, 5, expanded, 5, decode_lens, n, 1024)
        outs.append((lens, expanded, decode_lens))
    for a, b in zip(*outs):
        assert torch.equal(a, b), (n, a, b)
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_torch_stand_in_equals_vllms_triton_kernel():
    """Our ``prepare_uniform_decode`` against vLLM's own ``PrepareUniformDecodeKernel`` in
    Triton's CPU interpreter: the same three outputs, element for element, untouched rows
    left as they were."""
    interpreted.run(STAND_IN)


@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize(
    ("k", "lens"),
    [
        (1, [2, 2, 2]),  # MTP 1, native [B, 2]
        (3, [4, 4, 4]),  # MTP 3 flattened through PrepareUniformDecodeKernel
        (3, [4, 2, 3]),  # ragged drafts flattened
    ],
)
def test_under_dcp_every_decode_token_gets_its_shards_context(k, lens, interleave):
    """The same layouts on each rank of a DCP group of 2: vLLM's builder localizes every
    token's length to the rank's shard itself (per token, after expanding: its own
    ``_dcp_localize_decode_seq_lens``); ``dcp_contexts`` must hand each token exactly that,
    which is vLLM's ``get_dcp_local_seq_lens`` of the token's global causal length."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    from vllm_mla.ops.dcp import DCPShard
    from vllm_mla.vllm.sparse.indexer import dcp_contexts

    if lens == [4, 4, 4]:
        needs_the_torch_stand_in()
    want_global, want_blocks = truth(lens)
    for rank in range(2):
        builder, config = builder_for(k)
        builder.dcp_world_size, builder.dcp_rank = 2, rank  # what a DCP rank's builder holds
        builder.dcp_rank_tensor = torch.tensor(rank, dtype=torch.int32)
        builder.cp_kv_cache_interleave_size = interleave
        common = batch(lens)
        common.dcp_local_seq_lens = get_dcp_local_seq_lens(common.seq_lens, 2, rank, interleave)
        with set_current_vllm_config(config):
            meta = builder.build(0, common)
        assert not meta.decode.requires_padding  # a shorter request is a prefill here
        ((rows, tables, lengths, _),) = dcp_contexts(meta, DCPShard(2, rank, interleave))
        want = get_dcp_local_seq_lens(torch.tensor(want_global), 2, rank, interleave)
        assert rows.tolist() == list(range(sum(lens)))
        assert lengths.tolist() == want.tolist(), (rank, lengths.tolist(), want.tolist())
        assert tables[:, 0].tolist() == want_blocks


@pytest.mark.parametrize("interleave", [1, 16])
def test_under_dcp_padded_native_batches_count_each_requests_own_tokens(interleave):
    """vLLM's native preparation of requests of 3, 1, 4 and 0 tokens (requires_padding),
    then its own per-token DCP localization: each real token gets the local length of its
    global causal length on each rank, the padding none. A length computed from the last
    column (right without DCP) is wrong here: a rank's local lengths are not consecutive."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    from vllm_mla.ops.dcp import DCPShard
    from vllm_mla.vllm.sparse.indexer import dcp_contexts

    want_global = [38, 39, 40, 37, 39, 40, 41, 42]
    for rank in range(2):
        builder, _ = builder_for(3)
        builder.dcp_world_size, builder.dcp_rank = 2, rank
        builder.dcp_rank_tensor = torch.tensor(rank, dtype=torch.int32)
        builder.cp_kv_cache_interleave_size = interleave
        meta = padded_native_meta(builder, [40, 37, 42, 0], localize=True)
        ((_, tables, lengths, _),) = dcp_contexts(meta, DCPShard(2, rank, interleave))
        want = get_dcp_local_seq_lens(torch.tensor(want_global), 2, rank, interleave)
        assert lengths.tolist() == want.tolist(), (rank, lengths.tolist(), want.tolist())
        assert tables[:, 0].tolist() == [0, 0, 0, 4, 8, 8, 8, 8]
