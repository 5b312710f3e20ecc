"""What lets vLLM CPU's own DeepSeek-V4 path run a step (``vllm_mla.vllm.sparse.dsv4_cpu``
and the patches ``cpu_dsv4_*``): torch stand-ins for the V4 metadata builders' Triton
kernels, checked against vLLM's kernels in Triton's interpreter; the CPU builder's missing
tile schedulers; the refusal where vLLM's V4 kernels are absent."""

from __future__ import annotations

import importlib.util

import interpreted
import pytest
import torch

from vllm_mla.vllm import cpu_host
from vllm_mla.vllm.patches import cpu_dsv4_kernels, cpu_dsv4_tile_scheduler
from vllm_mla.vllm.sparse import dsv4_cpu, dsv4_ops, kernel_targets

cpu_mla = pytest.importorskip("vllm.models.deepseek_v4.cpu.cpu_mla")

INTERPRETED = r"""
import types
import torch
import triton
import triton.language as tl
from vllm.v1.attention.ops import metadata
from vllm.v1.attention.backends.mla import sparse_swa
from vllm.v1.attention.backends.mla.compressor_utils import CompressedSlotMappingKernel
from vllm_mla.vllm.sparse import dsv4_cpu, dsv4_ops, kernel_targets

def real(fn, **helpers):
    # without a GPU driver vLLM's triton.jit is a placeholder returning the function
    fn = getattr(fn, "fn", fn)
    g = {**fn.__globals__, "tl": tl, "triton": triton, **helpers}
    return triton.jit(types.FunctionType(fn.__code__, g, fn.__name__))

for path in (dsv4_cpu.TOKEN_REQUEST_KERNEL, dsv4_cpu.PREFILL_KERNEL):
    kernel_targets.remember(path)  # the stand-ins bind positional launches by name

# token -> request: an empty request, tokens past the last request, num_mapped < num_tokens
mapping = real(metadata._token_request_mapping_kernel, _token_request=real(metadata._token_request))
qsl = torch.tensor([0, 5, 5, 12, 300], dtype=torch.int32)
for mapped, tokens in ((300, 300), (200, 310), (12, 12), (0, 7)):
    outs = []
    for run in ("vllm", "ours"):
        out = torch.full((320,), 9, dtype=torch.int32)
        args = (qsl, out, 4, mapped, tokens)
        if run == "vllm":
            mapping[((tokens + 255) // 256,)](*args, num_warps=4)
        else:
            dsv4_cpu.token_request_mapping(*args, num_warps=4)  # as vLLM's launch passes it
        outs.append(out)
    assert torch.equal(*outs), (mapped, tokens)

# prefill window gather lengths: decodes first, replay starts, prefixes shorter and longer
prefill = real(sparse_swa.ComputePrefillMetadataKernel.kernel)
seq = torch.tensor([40, 9, 300, 130, 64, 5], dtype=torch.int32)
qsl = torch.tensor([0, 1, 2, 202, 212, 276, 281], dtype=torch.int32)
replay = torch.tensor([0, 0, 0, 50, 120, 0], dtype=torch.int32)
for decodes, prefills, window in ((2, 4, 128), (0, 6, 32), (3, 1, 1)):
    outs = []
    for run in ("vllm", "ours"):
        out = torch.full((8,), -7, dtype=torch.int32)
        args = (out, seq, qsl, replay, prefills, decodes, window)
        if run == "vllm":
            prefill[(1,)](*args, BLOCK_SIZE=8)
        else:
            dsv4_cpu.prefill_gather_lengths(*args, BLOCK_SIZE=8)
        outs.append(out)
    assert torch.equal(*outs), (decodes, prefills, window, outs)

# sliding-window indices and lengths: a permuted block table, padded tokens, replay
# starts, decode rows in a larger buffer (rows past num_tokens left as they are), prefill
# rows at a token offset, an image's widened window, index widths below and above the window
swa = real(sparse_swa._compute_swa_indices_and_lens_kernel)
gen = torch.Generator().manual_seed(0)
seq = torch.tensor([300, 41, 70], dtype=torch.int32)
qsl = torch.tensor([0, 1, 2, 72], dtype=torch.int32)  # two decodes, one 70-token prefill
to_req = torch.tensor([0, 1] + [2] * 70, dtype=torch.int32)
valid = torch.ones(72, dtype=torch.bool)
valid[[1, 40]] = False
table = torch.randperm(3 * 8, generator=gen).to(torch.int32).view(3, 8)
replay = torch.tensor([0, 0, 20], dtype=torch.int32)
left = torch.randint(0, 200, (72,), generator=gen, dtype=torch.int32)
right = torch.randint(0, 3, (72,), generator=gen, dtype=torch.int32)
cases = [  # (rows in the buffer, index width, window, num_tokens, token offset, image)
    (10, 128, 128, 2, 0, False),
    (70, 128, 128, 70, 2, False),
    (70, 96, 128, 70, 2, False),
    (70, 400, 128, 70, 2, True),
    (70, 40, 32, 70, 2, True),
]
for rows, width, window, tokens, offset, image in cases:
    outs = []
    for run in ("vllm", "ours"):
        indices = torch.full((rows, 1, width), 5, dtype=torch.int32)
        lens = torch.full((rows,), 9, dtype=torch.int32)
        args = (indices, lens, window, width, left if image else lens, right if image else lens,
                qsl, seq, to_req, valid, table, 64, replay)
        if run == "vllm":
            swa[(tokens,)](indices, indices.stride(0), lens, window, width,
                           left if image else lens, right if image else lens, qsl, seq,
                           to_req, valid, table, table.stride(0), 64, replay, offset,
                           HAS_IMAGE=image, TRITON_BLOCK_SIZE=128)
        else:
            dsv4_cpu.swa_indices_and_lens(*args, num_tokens=tokens, token_offset=offset,
                                          has_image=image)
        outs.append((indices, lens))
    for a, b in zip(*outs):
        assert torch.equal(a, b), (rows, width, window, tokens, offset, image,
                                   (a != b).nonzero()[:5].tolist())
    assert (outs[0][0] >= 0).sum() > tokens and (outs[0][1] == 0).any()

# compressed-state slots at V4's ratios (the kpool stand-in, registered for V4 too)
slot = real(CompressedSlotMappingKernel.kernel)
qsl = torch.tensor([0, 1, 130, 260], dtype=torch.int32)
seq = torch.tensor([300, 129, 500], dtype=torch.int32)
own = torch.arange(260, dtype=torch.int64)
own[77] = -1
for ratio, block in ((4, 64), (128, 2)):
    outs = []
    for run in ("vllm", "ours"):
        out = torch.full((260,), -1, dtype=torch.int64)
        args = (out, own, qsl, seq, table, 8, block, 1, 1)
        if run == "vllm":
            slot[(3,)](*args, COMPRESS_RATIO=ratio, PAD_ID=-1, TRITON_BLOCK_SIZE=256)
        else:
            dsv4_cpu.STAND_INS[2].impl(*args, COMPRESS_RATIO=ratio, PAD_ID=-1)
        outs.append(out)
    assert torch.equal(*outs), ratio
    assert (outs[0] >= 0).sum() >= 2
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_stand_ins_equal_vllms_triton_kernels_in_the_interpreter():
    """Token -> request mapping, prefill window lengths, sliding-window indices and
    compressed-state slots at ratios 4 and 128: every output element equal to vLLM's own
    kernels run by Triton's CPU interpreter (integer arithmetic only), rows past a launch
    left as they were."""
    interpreted.run(INTERPRETED)


def test_vllms_token_mapping_runs_through_the_stand_in_once_registered():
    """After ``register()`` (vLLM CPU: no Triton), vLLM's own ``compute_token_to_req_indices``
    launches our stand-in and maps every token to its request."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("vLLM's Triton runs here: nothing is registered")
    dsv4_cpu.register()
    for stand_in in dsv4_cpu.STAND_INS:
        assert kernel_targets.kernel_at(stand_in.kernel).func is stand_in.impl
    from vllm.v1.attention.ops.metadata import compute_token_to_req_indices

    qsl = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    out = compute_token_to_req_indices(qsl, torch.full((9,), 5, dtype=torch.int32), 7, 9)
    assert out.tolist() == [0, 0, 0, 2, 2, 2, 2, 0, 0]


def test_the_cpu_builder_schedules_every_layer_type_the_shared_builder_reads():
    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    original = getattr(builder.build_tile_scheduler, "__wrapped__", builder.build_tile_scheduler)
    kinds = set(cpu_dsv4_tile_scheduler.layer_types())
    assert {"swaonly", "c4a", "c128a", "c1a", "c2a"} <= kinds
    # vLLM's own leaves c1a / c2a out (the KeyError the patch is for)
    assert not {"c1a", "c2a"} & set(original(None, 4))
    patched = cpu_dsv4_tile_scheduler.make_build_tile_scheduler(original)(None, 4)
    assert set(patched) == kinds and all(v is None for v in patched.values())


def test_the_refusal_names_the_library_the_cap_and_the_kernels(monkeypatch):
    monkeypatch.setattr(dsv4_cpu, "missing_kernels", lambda: ["save_partial_states_cpu"])
    reason = dsv4_cpu.refusal()
    assert reason.startswith("DeepSeek-V4 is not served on this host: vLLM CPU's V4 kernels")
    assert "VLLM_MLA_CPU_ISA=" in reason
    assert reason.endswith(
        "of the 16 kernels torch serves 15 so far; missing: save_partial_states_cpu"
    )
    calls = []
    init = cpu_dsv4_kernels.make_init(lambda self, **kw: calls.append(kw))
    with pytest.raises(ValueError, match="not served on this host"):
        init(object(), vllm_config="config")
    assert not calls  # nothing built
    monkeypatch.setattr(dsv4_cpu, "missing_kernels", list)
    assert dsv4_cpu.refusal() is None
    init(object(), vllm_config="config")
    assert calls == [{"vllm_config": "config", "prefix": ""}]


def test_the_v4_kernels_are_missing_exactly_where_vllm_cpu_loads_no_c_library():
    """On vLLM CPU with ``_C`` (AVX-512 BF16, native here) every V4 kernel is there and
    none of ours is defined; under a lower ISA cap (``_C_AVX2`` / ``_C_AVX512``) and in the
    CUDA wheels' CPU mode ours are defined and only those we have not written are missing."""
    from vllm.platforms import current_platform

    has_c = current_platform.is_cpu() and cpu_host.expected_library() == "_C"
    has_c = has_c and importlib.util.find_spec("vllm._C") is not None
    missing = dsv4_cpu.missing_kernels()
    unwritten = [op.name for op in dsv4_ops.OPS if op.impl is None]
    assert missing == ([] if has_c else unwritten), cpu_host.describe()
    assert dsv4_ops.register() == ([] if has_c else [op.name for op in dsv4_ops.OPS if op.impl])
    if not has_c:  # vLLM's calls reach ours: the op answers as our function does
        o, positions = torch.randn(3, 2, 512), torch.tensor([0, 5, 9])
        cos_sin = torch.rand(10, 64)
        (op,) = [op for op in dsv4_ops.OPS if op.name == "inverse_gptj_rope_o_proj_cpu"]
        ours = op.impl(o, positions, cos_sin, 64)
        assert torch.equal(
            torch.ops._C.inverse_gptj_rope_o_proj_cpu(o, positions, cos_sin, 64), ours
        )


def test_indexer_logits_run_in_chunks_of_tokens(monkeypatch):
    """Past ``MAX_SCORES`` a request's queries run in chunks: the same logits (-inf past
    each length), and no chunk holds more per-head dots."""
    from vllm_mla.formats import INDEX_RECORD_BYTES
    from vllm_mla.ops.sparse_indexer import reference as index_reference

    gen = torch.Generator().manual_seed(4)
    tokens, heads, block = 7, 3, 8
    cache = torch.zeros(4, block * INDEX_RECORD_BYTES, dtype=torch.uint8)
    index_reference.insert_keys(
        cache.view(4, block, INDEX_RECORD_BYTES), torch.randn(32, 128, generator=gen),
        torch.arange(32),
    )  # fmt: skip
    q = torch.randn(tokens, heads, 128, generator=gen).to(torch.float8_e4m3fn)
    weight = torch.randn(tokens, heads, generator=gen)
    seq_lens = torch.tensor([5, 9, 13, 20, 20, 3, 11], dtype=torch.int32)
    tables = torch.tensor([[0, 1, 2]] * 5 + [[3, 2, 1]] * 2, dtype=torch.int32)
    args = (q, cache, weight, seq_lens, tables, block, 24)
    whole = dsv4_ops._paged_logits(*args)
    held = []
    logits = index_reference.logits
    monkeypatch.setattr(
        index_reference, "logits", lambda q, *a: held.append(q.shape[0]) or logits(q, *a)
    )
    monkeypatch.setattr(dsv4_ops, "MAX_SCORES", 2 * heads * 20)  # two tokens of 20 keys
    assert torch.equal(dsv4_ops._paged_logits(*args), whole)
    assert max(held) == 2 and sum(held) == tokens
