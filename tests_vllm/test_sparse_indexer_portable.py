"""The portable DSA indexer (``vllm_mla.vllm.sparse.indexer``) against vLLM's own classes.

No GPU here: the CUDA path's selection logic (``select`` with the Triton kernels) runs in
Triton's CPU interpreter in a subprocess (the interpreter is chosen when Triton decorates
the kernels) and must equal the torch oracle's selection on the same vLLM-shaped step;
the choice rule (``VLLM_MLA_INDEXER``), the DeepGEMM guard we lift at construction and
the dispatch to vLLM's own methods are checked on vLLM's ``SparseAttnIndexer``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_mla.ops import sparse_indexer
from vllm_mla.vllm.sparse import indexer

ROOT = Path(__file__).resolve().parents[1]
BS = 64  # vLLM's index-cache block size


# decode layouts vLLM's indexer metadata builder hands over: (decode metadata fields, the
# (token, table row, causal length) of every decode token)
TABLES = ([3, 1, 0], [2, 0, 0])
DECODE_SHAPES = {
    # native speculative decoding: seq_lens [B, next_n]
    "native": (
        {"seq_lens": [[70, 71], [5, 6]], "tables": TABLES, "requires_padding": False},
        [(0, 70), (0, 71), (1, 5), (1, 6)],
    ),
    # ragged drafts, packed: decode_lens [2, 1]; the last column is each request's length
    "ragged": (
        {"seq_lens": [[70, 71], [5, 6]], "tables": TABLES, "requires_padding": True},
        [(0, 70), (0, 71), (1, 6)],
    ),
    # flattened per token (more drafts than the native path takes): 1-D, tables expanded
    "flat": (
        {"seq_lens": [70, 71, 5, 6], "tables": [TABLES[0]] * 2 + [TABLES[1]] * 2},
        [(0, 70), (0, 71), (1, 5), (1, 6)],
    ),
}


def step(seed: int = 0, topk: int = 16, shape: str = "native"):
    """One vLLM-shaped indexer step: 2 decode requests laid out as ``DECODE_SHAPES[shape]``
    and one prefill chunk of 3 tokens, their keys inserted into a 6-page cache."""
    fields, decode_rows = DECODE_SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(6, BS, sparse_indexer.RECORD_BYTES, dtype=torch.uint8)
    slots = torch.arange(6 * BS)
    k = torch.randn(slots.shape[0], 128, generator=gen)
    sparse_indexer.insert_keys(cache, k, slots)
    n = len(decode_rows)
    t = n + 3
    q = (torch.randn(t, 4, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    weights = torch.rand(t, 4, generator=gen)
    decode = SimpleNamespace(
        requires_padding=fields.get("requires_padding", False),
        seq_lens=torch.tensor(fields["seq_lens"]),
        decode_lens=torch.tensor([2, 1], dtype=torch.int32),
        block_table=torch.tensor(fields["tables"], dtype=torch.int32),
    )
    chunk = SimpleNamespace(
        token_start=n,
        token_end=t,
        cu_seq_lens=torch.tensor([0, 130]),
        cu_seqlen_ks=torch.tensor([0, 0, 0]),
        cu_seqlen_ke=torch.tensor([128, 129, 130]),
        block_table=torch.tensor([[5, 4, 0]], dtype=torch.int32),
        max_seqlen_k=130,
    )
    meta = SimpleNamespace(
        num_decodes=2,
        num_decode_tokens=n,
        decode=decode,
        num_prefills=1,
        prefill=SimpleNamespace(chunks=[chunk]),
        max_seq_len=130,
        slot_mapping=torch.full((t,), -1, dtype=torch.int64),  # keys already inserted
    )
    layer = SimpleNamespace(
        k_cache=SimpleNamespace(kv_cache=cache),
        scale_fmt="ue8m0",
        topk_tokens=topk,
        topk_indices_buffer=torch.full((16, topk), 7, dtype=torch.int32),
    )
    return layer, torch.zeros(t, 8), q, k[:t], weights, meta


@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("budget", [None, 28 * 130 * 2])
def test_select_with_the_oracle_matches_a_per_token_computation(budget, shape):
    layer, hidden, q, k, weights, meta = step(shape=shape)
    out = indexer.select(
        layer, hidden, q, k, weights, meta, indexer.ReferenceKernels, budget_bytes=budget
    ).clone()
    decode_rows = DECODE_SHAPES[shape][1]
    rows = [*decode_rows, (2, 128), (2, 129), (2, 130)]
    tables = torch.tensor([*TABLES, [5, 4, 0]], dtype=torch.int32)
    for token, (table, length) in enumerate(rows):
        expected = sparse_indexer.index_topk(
            q[token : token + 1].float(),
            weights[token : token + 1],
            layer.k_cache.kv_cache,
            tables[table : table + 1],
            torch.tensor([length], dtype=torch.int32),
            layer.topk_tokens,
        )
        assert torch.equal(out[token], expected[0]), token
    assert (out[len(rows) :] == 7).all()  # rows past the step are the buffer's own
    short = [i for i, (_, length) in enumerate(rows) if length == 5]
    assert all((out[i, 5:] == -1).all() for i in short)  # a 5-key context selects 5, then -1


SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_sparse_indexer_portable import step
from vllm_mla.ops.sparse_indexer.dispatch import kernels_for
from vllm_mla.vllm.sparse import indexer
triton = kernels_for(torch.device("cpu"), "triton")
for seed, shape in ((0, "native"), (1, "ragged"), (2, "flat")):
    layer, hidden, q, k, weights, meta = step(seed, shape=shape)
    ref = indexer.select(layer, hidden, q, k, weights, meta, indexer.ReferenceKernels).clone()
    layer2, hidden, q, k, weights, meta = step(seed, shape=shape)
    got = indexer.select(layer2, hidden, q, k, weights, meta, triton,
                         max_decode_len=256)  # a static decode width past every length
    assert torch.equal(got, ref), (seed, (got != ref).nonzero()[:8].tolist())
    layer3, hidden, q, k, weights, meta = step(seed, shape=shape)  # row blocks of one token
    blocked = indexer.select(layer3, hidden, q, k, weights, meta, triton,
                             max_decode_len=256, budget_bytes=28 * 256)
    assert torch.equal(blocked, ref), seed
    # the keys inserted by the Triton kernel equal the oracle's, byte for byte
    slots = torch.arange(3 * 64)
    c1 = torch.zeros(3, 64, 132, dtype=torch.uint8)
    c2 = torch.zeros_like(c1)
    keys = torch.randn(slots.shape[0], 128)
    indexer.ReferenceKernels.insert_keys(c1, keys, slots, ue8m0=True)
    triton.insert_keys(c2, keys, slots, ue8m0=True)
    assert torch.equal(c1, c2), seed
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_cuda_path_selection_in_the_triton_interpreter_equals_the_oracles():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# -- the choice and the construction ----------------------------------------------------
@pytest.mark.parametrize(
    ("choice", "runs", "ours"),
    [("auto", False, True), ("auto", True, False), ("ours", True, True), ("vllm", False, False)],
)
def test_the_choice_follows_vllm_mla_indexer(monkeypatch, choice, runs, ours):
    monkeypatch.setenv("VLLM_MLA_INDEXER", choice)
    monkeypatch.setattr(indexer, "vllm_indexer_runs", lambda device=None: (runs, "why"))
    assert indexer.ours_on_cuda()[0] is ours


def test_a_bad_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_INDEXER", "deepgemm")
    with pytest.raises(ValueError, match="VLLM_MLA_INDEXER must be one of"):
        indexer.ours_on_cuda()


def test_the_deepgemm_guard_we_lift_is_the_one_vllm_has():
    """The constructor guard is ``current_platform.is_cuda() and not has_deep_gemm()``
    reading the module's ``has_deep_gemm``: what ``_deep_gemm_guard_lifted`` replaces."""
    module = importlib.import_module(indexer.BASE_MODULE)
    source = inspect.getsource(module.SparseAttnIndexer.__init__)
    assert "if current_platform.is_cuda() and not has_deep_gemm():" in source
    assert source.count("has_deep_gemm") == 1  # nothing else in the constructor reads it
    original = module.has_deep_gemm
    with indexer._deep_gemm_guard_lifted(module):
        assert module.has_deep_gemm() is True
    assert module.has_deep_gemm is original


def construct(cls, config=None):
    from vllm.config import set_current_vllm_config
    from vllm_layers import vllm_config

    with set_current_vllm_config(config or vllm_config()):
        return cls(
            SimpleNamespace(prefix="k_cache"),
            128,
            "ue8m0",
            32,
            128,
            256,
            4096,
            torch.full((8, 32), -1, dtype=torch.int32),
        )


def test_on_cuda_without_deepgemm_ours_constructs_and_vllms_raises(monkeypatch):
    """CUDA stood in for by the platform's ``is_cuda`` (the only platform check in the
    constructor); DeepGEMM absent as on A100/L40S/RTX 4090/5090."""
    from vllm.platforms import current_platform
    from vllm_layers import vllm_config

    config = vllm_config()  # built on the real platform
    module = importlib.import_module(indexer.BASE_MODULE)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(module, "has_deep_gemm", lambda: False)
    monkeypatch.setenv("VLLM_MLA_INDEXER", "auto")
    monkeypatch.setattr(indexer, "vllm_indexer_runs", lambda device=None: (False, "no DeepGEMM"))
    from vllm.model_executor.custom_op import op_registry_oot

    made = construct(indexer.make_indexer(), config)
    assert made.vllm_mla_ours and made.topk_tokens == 32
    # control: vLLM's own (CustomOp builds a registered out-of-tree class instead: drop it)
    monkeypatch.delitem(op_registry_oot, module.SparseAttnIndexer.__name__, raising=False)
    with pytest.raises(RuntimeError, match="requires DeepGEMM"):
        construct(module.SparseAttnIndexer, config)
    monkeypatch.setenv("VLLM_MLA_INDEXER", "vllm")  # forced: vLLM's behaviour, its error
    with pytest.raises(RuntimeError, match="requires DeepGEMM"):
        construct(indexer.make_indexer(), config)


def test_forward_cuda_dispatches_ours_or_vllms(monkeypatch):
    module = importlib.import_module(indexer.BASE_MODULE)
    cls = indexer.make_indexer()
    made = construct(cls)
    calls = []
    monkeypatch.setattr(module.SparseAttnIndexer, "forward_cuda", lambda *a: calls.append("vllm"))
    monkeypatch.setattr(indexer, "_forward_context_metadata", lambda layer: "meta")
    monkeypatch.setattr(indexer, "select", lambda *a, **k: calls.append(("ours", k)))
    made.vllm_mla_ours = False
    made.forward_cuda(None, None, None, None)
    made.vllm_mla_ours = True
    made.forward_cuda(None, None, None, None)
    assert calls[0] == "vllm" and calls[1][0] == "ours"
    assert calls[1][1]["max_decode_len"] == 256  # static decode width: max_model_len
    assert calls[1][1]["budget_bytes"] == 512 << 20  # vLLM's indexer logits bound
    made.skip_k_cache_insert = True  # DeepSeek-V4's indexer: always vLLM's
    assert indexer._delegates(made)


def logits_case():
    """One cache of 4 pages (interleaved block tables), 3 decode tokens of 8 index heads:
    (q e4m3 [3, 8, 128], weights, cache, lengths, tables)."""
    gen = torch.Generator().manual_seed(3)
    nb, heads = 4, 8
    cache = torch.zeros(nb, BS, sparse_indexer.RECORD_BYTES, dtype=torch.uint8)
    sparse_indexer.insert_keys(
        cache, torch.randn(nb * BS, 128, generator=gen), torch.arange(nb * BS)
    )
    q = (torch.randn(3, heads, 128, generator=gen) * 2).to(torch.float8_e4m3fn)
    weights = torch.rand(3, heads, generator=gen)
    lengths = torch.tensor([200, 64, 5], dtype=torch.int32)
    table = torch.tensor([[2, 0, 3, 1], [1, 2, 0, 3], [3, 0, 0, 0]], dtype=torch.int32)
    return q, weights, cache, lengths, table


def assert_our_logits_equal(theirs: torch.Tensor, case) -> None:
    """Ours (the oracle the CPU engine runs) equal ``theirs [3, >= 200]`` position by
    position within tk.LOGIT_RTOL of the sum of absolute terms (the error model stated
    beside it: exact products, fp32 sums in another order)."""
    from vllm_mla.ops.sparse_indexer import triton_kernels as tk

    q, weights, cache, lengths, table = case
    for t in range(3):
        length = int(lengths[t])
        k, k_scale = sparse_indexer.read_keys(
            cache, sparse_indexer.request_rows(table[t], length, BS)
        )
        ours = sparse_indexer.logits(q[t : t + 1].float(), weights[t : t + 1], k, k_scale)[0]
        magnitude = sparse_indexer.logits(
            q[t : t + 1].float().abs(), weights[t : t + 1].abs(), k.float().abs(), k_scale
        )[0]
        err = (theirs[t, :length] - ours).abs()
        bound = tk.LOGIT_RTOL * magnitude + tk.LOGIT_ATOL
        assert bool((err <= bound).all()), f"token {t}: worst {float((err - bound).max()):.3e}"


def test_our_logits_equal_vllms_torch_reference_on_the_same_cache():
    """vLLM's own torch indexer reference (``fp8_paged_mqa_logits_torch``, taken from
    DeepGEMM's tests) reads the same index-key page layout; it runs on every CPU."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_paged_mqa_logits_torch

    case = logits_case()
    q, weights, cache, lengths, table = case
    theirs = fp8_paged_mqa_logits_torch(q[:, None], cache, weights, lengths, table, 200)
    assert_our_logits_equal(theirs, case)
    for t, length in enumerate(lengths.tolist()):  # -inf past the context, as ours
        assert bool(torch.isneginf(theirs[t, length:]).all())


def test_our_logits_equal_vllms_own_cpu_kernel_on_the_same_cache():
    """vLLM CPU's ``fp8_paged_mqa_logits_cpu`` (DeepSeek-V4's CPU indexer kernel) reads the
    same index-key page layout. Only its ``_C`` library (AVX-512 with BF16) has it:
    ``_C_AVX512`` and ``_C_AVX2`` do not, so this is skipped there, naming the feature."""
    from vllm.platforms import current_platform

    ops = pytest.importorskip("vllm._custom_ops")
    current_platform.import_kernels()
    from vllm_mla.vllm import cpu_host

    loaded = cpu_host.loaded_libraries()
    if not loaded:
        pytest.skip("this vLLM build ships no CPU kernel libraries (vLLM CPU has them)")
    if loaded != ["_C"]:
        pytest.skip(
            f"vLLM CPU loaded {loaded[0]}: no fp8_paged_mqa_logits_cpu without AVX-512 BF16 "
            "(only its _C library has it)"
        )
    case = logits_case()
    q, weights, cache, lengths, table = case
    theirs = ops.fp8_paged_mqa_logits_cpu(
        q, cache.view(cache.shape[0], -1), weights, lengths, table, BS, 200
    )
    assert_our_logits_equal(theirs, case)
