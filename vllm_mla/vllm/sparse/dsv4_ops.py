"""vLLM CPU's DeepSeek-V4 kernels in torch, for the hosts whose kernel library lacks them.

vLLM CPU's V4 path calls 16 ops of its ``_C`` library (``torch.ops._C.<name>``), which
only the AVX-512 BF16 build has; ``_C_AVX2`` and ``_C_AVX512`` have none. ``OPS`` is one
row per op: vLLM's schema and a torch implementation of the same contract (``None``:
not written, the op then missing). ``register()`` defines, in the ``_C`` namespace, each
op the loaded library lacks and this table implements (with a fake for
``torch.compile``), so vLLM's own V4 code runs unchanged on any host. Where the library
has an op, vLLM's runs; ``tests_vllm`` compares every implementation with vLLM's on an
AVX-512 BF16 host.

``convert_weight_packed`` / ``bmm_cpu`` go together: vLLM packs ``wo_a`` once with the
first and multiplies with the second, so the stand-ins keep the weight as it is and
multiply it as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_mla.formats import INDEX_RECORD_BYTES
from vllm_mla.ops.dsv4 import attention, compressor, indexer, record, rope, routing
from vllm_mla.ops.sparse_indexer import reference as index_reference


@dataclass(frozen=True)
class V4Op:
    """One ``_C`` op of vLLM CPU's V4 path: its schema, ours (None: not yet), its fake."""

    schema: str
    impl: Callable | None
    fake: Callable | None = None  # None: the op returns nothing

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


def _flash_mla(out, q, window, w_slots, w_block, compressed, c_slots, c_block, sink, scale):
    got = attention.attend(q, window, w_slots, w_block, compressed, c_slots, c_block, sink, scale)
    out.copy_(got.to(out.dtype))


def _qnorm_rope_kv_insert(q, kv, positions, cache, slots, cos_sin, padded, eps, block_size):
    """Queries: RMSNorm without weight per head, then RoPE, as bf16, heads padded with
    zeros to ``padded``; KV rows: RoPE, then stored as records at ``slots``."""
    x = q.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    out = q.new_zeros(q.shape[0], padded, q.shape[-1])
    out[:, : q.shape[1]] = rope.rotate(normed, positions, cos_sin).to(q.dtype)
    record.write(cache, rope.rotate(kv, positions, cos_sin), slots, block_size)
    return out


def _qnorm_rope_kv_insert_fake(q, kv, positions, cache, slots, cos_sin, padded, eps, block):
    return q.new_empty(q.shape[0], padded, q.shape[-1])


def _inverse_rope(o, positions, cos_sin, rope_dim):
    return rope.rotate(o, positions, cos_sin, inverse=True)


def _bmm(out, mat1, mat2, is_vnni, scale):
    """``out[g] = mat1[g] @ mat2[g]^T`` (``mat2`` as our ``convert_weight_packed`` left it:
    unpacked). A scale (an FP8 ``wo_a``, which vLLM CPU loads on AMX hosts only) is not
    served: refused, named."""
    if scale is not None:
        raise NotImplementedError("bmm_cpu with a weight scale (FP8 wo_a) is not served in torch")
    out.copy_(torch.bmm(mat1.float(), mat2.float().transpose(1, 2)).to(out.dtype))


def _hc_pre(x, fn, scale, base, hc_mult, iters, rms_eps, hc_eps):
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    post, comb, layer_input = mhc_pre_torch(x, fn, scale, base, rms_eps, hc_eps, hc_eps, 2.0, iters)
    return layer_input, post.view(x.shape[0], hc_mult), comb


def _hc_pre_fake(x, fn, scale, base, hc_mult, iters, rms_eps, hc_eps):
    t = x.shape[0]
    return (
        x.new_empty(t, x.shape[-1]),
        x.new_empty(t, hc_mult, dtype=torch.float32),
        x.new_empty(t, hc_mult, hc_mult, dtype=torch.float32),
    )


def _hc_post(x, residual, post, comb):
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    return mhc_post_torch(x, residual, post.unsqueeze(-1), comb)


def _hc_head(x, fn, scale, base, hc_eps, norm_eps):
    """The streams' sum weighted by ``sigmoid(mix * scale + base) + hc_eps``, the mixes
    from the RMS-normalized flattened streams."""
    flat = x.float().reshape(x.shape[0], -1)
    mixes = flat @ fn.float().t() * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    gates = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (gates.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)


def _hash_topk(logits, experts, k, scoring, shared, num_experts, scale):
    return routing.hash_topk(logits, experts, scale)


def _biased_topk(hidden, logits, bias, k, renormalize, scoring, shared, scale, on_output):
    return routing.biased_topk(logits, bias, k, scale if on_output and scale else 1.0)


def _routed(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (weights, ids) of a router's outputs: the fakes'."""
    t = logits.shape[0]
    return logits.new_empty(t, k, dtype=torch.float32), logits.new_empty(t, k, dtype=torch.int32)


def _index_query(positions, q, cos_sin, q_fp8, weights, softmax_scale, head_scale, weights_out):
    values, folded = indexer.quantize_queries(
        q, positions, cos_sin, weights, softmax_scale, head_scale
    )
    q_fp8.copy_(values)
    weights_out.copy_(folded)


# fp32 per-head dots held at once (128 MiB): a prefill's queries run in chunks under it. All
# at once, V4-Flash's 64 indexer heads over 2048 entries for 8192 tokens are 4.3 GB.
MAX_SCORES = 1 << 25


def _paged_logits(q_fp8, cache, weight, seq_lens, page_table, block_size, max_seq_len):
    """Each query's indexer logits over its request's keys, -inf past its length (vLLM's
    kernel leaves those columns unspecified). Queries sharing a page table (a request's
    tokens) read its keys once."""
    keys = cache.view(cache.shape[0], block_size, INDEX_RECORD_BYTES)
    out = torch.full((q_fp8.shape[0], max_seq_len), float("-inf"), device=q_fp8.device)
    tables, group = torch.unique(page_table, dim=0, return_inverse=True)
    for g in range(tables.shape[0]):
        members = (group == g).nonzero().flatten()
        longest = int(seq_lens[members].max())
        rows = index_reference.request_rows(tables[g], longest, block_size)
        k, k_scale = index_reference.read_keys(keys, rows)
        step = max(1, MAX_SCORES // max(1, q_fp8.shape[1] * longest))
        for part in members.split(step):  # [tokens, heads, keys] dots under MAX_SCORES
            scores = index_reference.logits(q_fp8[part], weight[part], k, k_scale)
            inside = torch.arange(longest) < seq_lens[part, None]
            out[part, :longest] = scores.masked_fill(~inside, float("-inf"))
    return out


def _paged_logits_fake(q_fp8, cache, weight, seq_lens, page_table, block_size, max_seq_len):
    return q_fp8.new_empty(q_fp8.shape[0], max_seq_len, dtype=torch.float32)


def _topk_512(scores, seq_lens, page_tables, out_page, page_size, out_raw):
    """The 512 best positions of each row within its length (-1 past it), as cache slots
    through the row's page table, and raw."""
    k = out_page.shape[-1]
    picked = index_reference.select_topk(scores, seq_lens, k).long()
    table = page_tables.long()
    page = table.gather(1, (picked.clamp_min(0) // page_size).clamp_max(table.shape[1] - 1))
    out_page.copy_(torch.where(picked >= 0, page * page_size + picked % page_size, -1))
    if out_raw is not None:
        out_raw[:, :k].copy_(picked)


OPS: tuple[V4Op, ...] = (
    V4Op(
        "flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
        "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
        "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, float scale)"
        " -> ()",
        _flash_mla,
    ),
    V4Op(
        "fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
        "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
        "int q_head_padded, float eps, int cache_block_size) -> Tensor",
        _qnorm_rope_kv_insert,
        _qnorm_rope_kv_insert_fake,
    ),
    V4Op(
        "inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
        "int rope_dim) -> Tensor",
        _inverse_rope,
        lambda o, *_: o.new_empty(o.shape, dtype=torch.float32),
    ),
    V4Op(
        "bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
        _bmm,
    ),
    V4Op(
        "convert_weight_packed(Tensor(a!) weight) -> Tensor",
        lambda weight: weight.clone(),
        lambda weight: torch.empty_like(weight),
    ),
    V4Op(
        "hc_pre_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, "
        "int hc_mult, int sinkhorn_iters, float rms_eps, float hc_eps) -> "
        "(Tensor, Tensor, Tensor)",
        _hc_pre,
        _hc_pre_fake,
    ),
    V4Op(
        "hc_post_fused_cpu(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
        _hc_post,
        lambda x, residual, post, comb: torch.empty_like(residual),
    ),
    V4Op(
        "hc_head_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, "
        "float hc_eps, float norm_eps) -> Tensor",
        _hc_head,
        lambda x, *_: x.new_empty(x.shape[0], x.shape[-1]),
    ),
    V4Op(
        "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
        "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) -> "
        "(Tensor, Tensor)",
        _hash_topk,
        lambda logits, experts, k, *_: _routed(logits, k),
    ),
    V4Op(
        "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, "
        "int topk, bool renormalize, str scoring_func, int num_fused_shared_experts, "
        "float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output) -> "
        "(Tensor, Tensor)",
        _biased_topk,
        lambda hidden, logits, bias, k, *_: _routed(logits, k),
    ),
    V4Op(
        "save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
        "Tensor(a!) state_cache, Tensor slot_mapping) -> ()",
        compressor.save_states,
    ),
    V4Op(
        "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps,"
        " Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
        "int compress_ratio) -> ()",
        compressor.store_entries,
    ),
    V4Op(
        "compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps,"
        " Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
        "int compress_ratio) -> ()",
        compressor.store_index_keys,
    ),
    V4Op(
        "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
        "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
        "float index_weights_softmax_scale, float index_weights_head_scale, "
        "Tensor(b!) index_weights_out) -> ()",
        _index_query,
    ),
    V4Op(
        "fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, "
        "Tensor seq_lens, Tensor page_table, int block_size, int max_seq_len) -> Tensor",
        _paged_logits,
        _paged_logits_fake,
    ),
    V4Op(
        "topk_transform_512_cpu(Tensor scores, Tensor seq_lens, Tensor page_tables, "
        "Tensor(a!) out_page_indices, int page_size, Tensor(b!)? out_raw_indices) -> ()",
        _topk_512,
    ),
)

_library: torch.library.Library | None = None
_defined: list[str] = []


def vllms(name: str) -> bool:
    """Whether ``torch.ops._C.<name>`` is vLLM's own kernel (not absent, not ours)."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, name) and name not in _defined


def missing() -> list[str]:
    """The V4 ops neither the loaded kernel library nor this module provides."""
    return [op.name for op in OPS if not hasattr(torch.ops._C, op.name)]


def register() -> list[str]:
    """Define, in ``_C``, every op of ``OPS`` the loaded library lacks and this module
    implements (once per process); the names defined here so far."""
    global _library
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the library first: its ops are never shadowed
    for op in OPS:
        if op.impl is None or op.name in _defined or hasattr(torch.ops._C, op.name):
            continue
        if _library is None:
            _library = torch.library.Library("_C", "FRAGMENT")  # kept: it owns the ops
        _library.define(op.schema)
        _library.impl(op.name, op.impl, "CPU")
        fake = op.fake or (lambda *args, **kwargs: None)
        torch.library.register_fake(f"_C::{op.name}", fake, lib=_library)
        _defined.append(op.name)
    return list(_defined)
