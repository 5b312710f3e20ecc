"""DeepSeek-V4's Triton record writer, compressor and attention
(``vllm_mla.ops.dsv4.triton_kernels``, through ``dispatch``) against the torch reference,
in Triton's interpreter here, and compiled for sm_80 / 89 / 90 / 120 with Triton's bundled
ptxas."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import dispatch, record

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
B = 16
# Error model of the attention: the kernel rounds each probability to bf16 before the PV
# dot (as vLLM's kernels do), a relative error of at most 2**-8 per weight, so the output
# moves by at most 2**-8 times the largest attended value; the scores, the record decode
# (exact in bf16) and the fp32 sums add orders less.
P_ROUNDING = 2.0**-8


def rows_of_every_size(n: int, seed: int) -> torch.Tensor:
    """bf16 rows from 1e-9 to 100 in magnitude, one all-zero NoPE block, one value far under
    the rest of its block (e4m3 subnormal or flushed), a value past 448 times a scale, a
    block whose amax / 448 is a power of two (its own scale, not the next)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, 512, generator=gen) * torch.logspace(-9, 2, n)[:, None]
    rows[3, :64] = 0
    rows[4, 5] = 1e-30
    rows[5, 70] = -3e4
    rows[6, 128] = 56.0  # 448 / 8
    return rows.to(torch.bfloat16)


@pytest.mark.parametrize("writer", ["cpu", "triton"])
def test_the_writer_stores_the_reference_bytes(writer):
    rows = rows_of_every_size(40, seed=1)
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(2))[:40]
    slots[7] = -1  # padded: nothing written
    ours = torch.full((3, B * DSV4_RECORD), 0xAB, dtype=torch.uint8)
    theirs = ours.clone()
    dispatch.write(ours, rows, slots, B, writer, impl="triton")
    record.write(theirs, rows, slots, B, writer)
    assert torch.equal(ours, theirs)
    assert ours.eq(0xAB).any()  # the skipped slot and the unused ones kept their bytes


def test_the_writer_rounds_an_fp32_row_to_bf16_first():
    rows = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
    ours = torch.zeros(1, B * DSV4_RECORD, dtype=torch.uint8)
    theirs = ours.clone()
    dispatch.write(ours, rows, torch.arange(4), B, impl="triton")
    record.write(theirs, rows.to(torch.bfloat16), torch.arange(4), B)
    assert torch.equal(ours, theirs)


def caches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    window = torch.zeros(4, B * DSV4_RECORD, dtype=torch.uint8)
    record.write(window, torch.randn(64, 512, generator=gen), torch.arange(64), B)
    compressed = torch.zeros(3, 4 * DSV4_RECORD, dtype=torch.uint8)
    record.write(compressed, torch.randn(12, 512, generator=gen) * 3, torch.arange(12), 4)
    return window, compressed


def bound(window, w_slots, compressed, c_slots) -> torch.Tensor:
    """Per token: ``P_ROUNDING`` times the largest value it attends to."""
    rows = torch.cat([record.read(window, w_slots, B), record.read(compressed, c_slots, 4)], 1)
    return P_ROUNDING * rows.abs().amax(dim=(1, 2)) + 1e-6


@pytest.mark.parametrize("heads", [3, 20])  # one tile of 16 heads, two (masked rows in each)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_the_reference(heads, out_dtype):
    window, compressed = caches(seed=4)
    gen = torch.Generator().manual_seed(5)
    tokens = 6
    q = (torch.randn(tokens, heads, 512, generator=gen) * 0.1).to(torch.bfloat16)
    # 37 window slots (two chunks and a partial one), 6 compressed; -1 scattered
    w = torch.randint(-1, 64, (tokens, 37), generator=gen)
    c = torch.randint(-1, 12, (tokens, 6), generator=gen)
    sink = torch.randn(heads, generator=gen)
    sink[0] = -math.inf
    ref = dispatch.attend(q, window, w, B, compressed, c, 4, sink, 0.05, impl="reference")
    out = torch.empty(q.shape, dtype=out_dtype)
    dispatch.attend(q, window, w, B, compressed, c, 4, sink, 0.05, out=out, impl="triton")
    err = (out.float() - ref).abs().amax(dim=(1, 2))
    tol = bound(window, w, compressed, c)
    if out_dtype is torch.bfloat16:
        tol = tol + P_ROUNDING * ref.abs().amax(dim=(1, 2))  # the output's own rounding
    assert (err <= tol).all(), (err, tol)


def test_the_sink_takes_weight_and_no_token_gives_zeros():
    """A token with no slot attends to its sink alone (zeros); a sink of -inf and no slot
    also gives zeros (not NaN); without the compressed source the window alone."""
    window, compressed = caches(seed=6)
    q = (torch.randn(2, 2, 512, generator=torch.Generator().manual_seed(7)) * 0.1).bfloat16()
    w = torch.tensor([[1, 2, 3], [-1, -1, -1]])
    sink = torch.tensor([2.0, -math.inf])
    out = dispatch.attend(q, window, w, B, None, None, 4, sink, 0.05, impl="triton")
    ref = dispatch.attend(q, window, w, B, None, None, 4, sink, 0.05, impl="reference")
    assert out[1].eq(0).all() and not out.isnan().any()
    assert (out - ref).abs().max() <= bound(window, w, compressed, w[:, :0]).max()
    # the sink's weight is there: without it the same rows weigh more
    no_sink = dispatch.attend(q, window, w, B, None, None, 4, sink * 0 - math.inf, 0.05)
    assert (no_sink[0, 0] - out[0, 0]).abs().max() > 10 * bound(window, w, compressed, w).max()


# fp32 throughout, in another order than torch's (exp, the window's sums, the norm's mean):
# a few fp32 roundings of each row's largest value.
COMPRESS_REL = 1e-5


@pytest.mark.parametrize(
    ("ratio", "coff", "width"),
    [(4, 2, 512), (128, 1, 512), (4, 2, 128)],  # C4 and C128 entries, C4 indexer keys
)
def test_compressed_rows_match_the_reference(ratio, coff, width):
    """Each window-ending token's window compressed (C4: the previous window's rows give
    their first half), normed and turned at the window's first position; slots before the
    sequence (-1) take no weight; the state's pages strided."""
    gen = torch.Generator().manual_seed(11)
    pages = torch.randn(6, 16, 2 * coff * width + 8, generator=gen)
    state = pages[..., : 2 * coff * width]  # strided pages, contiguous rows
    gather = torch.randint(0, 96, (5, coff * ratio), generator=gen, dtype=torch.int32)
    gather[0, : max(ratio * (coff - 1), 2)] = -1
    positions = torch.randint(0, 300, (5,), generator=gen)
    weight = torch.rand(width, generator=gen) + 0.5
    cos_sin = torch.randn(400, 64, generator=gen)
    args = (state, gather, positions, weight, 1e-6, cos_sin, ratio)
    ref = dispatch.compressed_rows(*args, impl="reference")
    out = dispatch.compressed_rows(*args, impl="triton")
    err = (out - ref).abs().amax(-1)
    assert (err <= COMPRESS_REL * ref.abs().amax(-1)).all(), err


def test_arguments_are_named():
    window, _ = caches(seed=8)
    q = torch.zeros(2, 2, 512, dtype=torch.bfloat16)
    w = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q: queries are \[T, H, 512\], got \(2, 2, 576\)"):
        dispatch.attend(torch.zeros(2, 2, 576), window, w, B, None, None, 4, torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match="window_slots: 3 rows for 2 query tokens"):
        dispatch.attend(q, window, w.repeat(2, 1)[:3], B, None, None, 4, torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match=r"sink: one logit per head, \[2\], got \(3,\)"):
        dispatch.attend(q, window, w, B, None, None, 4, torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="window_cache: a page of 8 DeepSeek-V4 records"):
        dispatch.attend(q, window, w, 8, None, None, 4, torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match="compressed_slots given without compressed_cache"):
        dispatch.attend(q, window, w, B, None, w, 4, torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.attend(q, window, w, B, None, None, 4, torch.zeros(2), 1.0, impl="cuda")
    with pytest.raises(ValueError, match=r"rows: a DeepSeek-V4 KV row is \[T, 512\]"):
        dispatch.write(window, torch.zeros(2, 448), torch.arange(2), B)
    with pytest.raises(ValueError, match="writer must be one of"):
        dispatch.write(window, torch.zeros(2, 512), torch.arange(2), B, writer="gpu")
    state, cos_sin, pos = torch.zeros(2, 4, 2048), torch.zeros(9, 64), torch.zeros(3)
    weight, gather = torch.ones(512), torch.zeros(3, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"gather_slots: \[T, ratio or 2 \* ratio\] for ratio 128"):
        dispatch.compressed_rows(state, gather, pos, weight, 1e-6, cos_sin, 128)
    with pytest.raises(ValueError, match="state_cache: rows of 2 \\* 2 \\* 128 contiguous"):
        dispatch.compressed_rows(state, gather, pos, torch.ones(128), 1e-6, cos_sin, 4)
    with pytest.raises(ValueError, match=r"state_cache: fp32 \[blocks, block_size"):
        dispatch.compressed_rows(state.bfloat16(), gather, pos, weight, 1e-6, cos_sin, 4)
    with pytest.raises(ValueError, match=r"positions: \[3\], got \(2,\)"):
        dispatch.compressed_rows(state, gather, pos[:2], weight, 1e-6, cos_sin, 4)
    with pytest.raises(ValueError, match=r"a power-of-two window .* got a window of 6 and 512"):
        six = (state[..., :1024], gather[:, :6], pos, weight, 1e-6, cos_sin, 6)
        dispatch.compressed_rows(*six, impl="triton")


def test_auto_is_the_reference_on_cpu():
    assert dispatch.resolve("auto", torch.device("cpu")) == "reference"


def test_kernels_compile_for_gpu_targets(tmp_path):
    """The three kernels lowered to cubin for sm_80 / 89 / 90 / 120 by ``essential_aot.py``
    (the cases the launchers use: both writer rules, the one head tile, C4 / C128 entries
    and C4 indexer keys): no fp8 instruction, so
    SM80 compiles the same code; within each target's shared memory, <= 255 registers and
    no spill (ptxas -v)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(ROOT / "benchmarks" / "essential_aot.py")]
    args += [f"--arch={arch}" for arch in (80, 89, 90, 120)]
    kernels = ("dsv4_write", "dsv4_attend", "dsv4_compress")
    args += [f"--kernel={k}" for k in kernels] + [f"--json={tmp_path / 'aot.json'}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "aot.json").read_text())["rows"]
    assert len(rows) == 4 * 6  # per arch: 2 writer rules, 1 attention, 3 compressors
    assert {(r["arch"], r["kernel"]) for r in rows} == {
        (arch, kernel) for arch in (80, 89, 90, 120) for kernel in kernels
    }
    for row in rows:
        assert row["ok"] and "warning" not in row, row  # no spill either


def test_the_custom_ops_compile_and_run_each_implementation():
    """``vllm_mla::dsv4_write_records`` then ``vllm_mla::dsv4_attend`` under torch.compile
    (fullgraph, the fakes traced) give what the dispatcher gives eagerly, for the reference
    and for Triton (interpreter)."""
    from vllm_mla.ops.dsv4 import custom_op  # noqa: F401  (registers the ops)

    window, compressed = caches(seed=9)
    gen = torch.Generator().manual_seed(10)
    q = (torch.randn(3, 2, 512, generator=gen) * 0.1).bfloat16()
    rows = torch.randn(3, 512, generator=gen).bfloat16()
    w = torch.randint(-1, 64, (3, 9), generator=gen)
    c = torch.randint(-1, 12, (3, 4), generator=gen)
    sink = torch.randn(2, generator=gen)

    def step(cache, out, impl):
        torch.ops.vllm_mla.dsv4_write_records(cache, rows, torch.arange(3) + 5, B, "cpu", impl)
        torch.ops.vllm_mla.dsv4_attend(q, cache, w, B, compressed, c, 4, sink, 0.05, out, impl)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for impl in ("reference", "triton"):
        eager_cache, eager_out = window.clone(), torch.empty(3, 2, 512)
        record.write(eager_cache, rows, torch.arange(3) + 5, B)
        dispatch.attend(q, eager_cache, w, B, compressed, c, 4, sink, 0.05, eager_out, impl)
        cache, out = window.clone(), torch.full((3, 2, 512), float("nan"))
        compiled(cache, out, impl)
        assert torch.equal(cache, eager_cache)
        assert torch.equal(out, eager_out)


def test_the_c4_indexer_runs_on_the_portable_indexer():
    """V4's C4 indexer on a GPU without DeepGEMM: the indexer compressor's keys from the
    Triton compressor, stored by the portable indexer's Triton key writer in the 132-byte
    pages V4's indexer cache uses, V4's e4m3 queries (``indexer.quantize_queries``),
    logits and top-k by the portable indexer's Triton kernels: the selection the torch
    chain makes (top 16 of up to 40 compressed entries, so the choice matters)."""
    from vllm_mla.ops.dsv4 import compressor, indexer
    from vllm_mla.ops.sparse_indexer import api
    from vllm_mla.ops.sparse_indexer import reference as oracle

    gen = torch.Generator().manual_seed(12)
    ratio, entries, block = 4, 40, 16
    state = torch.randn(12, 16, 2 * 2 * 128, generator=gen)
    positions = torch.arange(entries) * ratio + ratio - 1  # the window-ending tokens
    # token i's window: the previous window's 4 state rows, then its own (-1 before 0)
    gather = (positions[:, None] - 2 * ratio + 1 + torch.arange(2 * ratio)).to(torch.int32)
    gather = gather.masked_fill(gather < 0, -1)
    norm, cos_sin = torch.rand(128, generator=gen) + 0.5, torch.randn(256, 64, generator=gen)
    args = (state, gather, positions, norm, 1e-6, cos_sin, ratio)
    keys = {"reference": compressor.entries(*args)}
    keys["triton"] = dispatch.compressed_rows(*args, impl="triton")
    caches = {impl: torch.zeros(3, block, 132, dtype=torch.uint8) for impl in keys}
    oracle.insert_keys(caches["reference"], keys["reference"], torch.arange(entries))
    api.insert_keys(caches["triton"], keys["triton"], torch.arange(entries))

    tokens, heads = 3, 4
    q_pos = torch.tensor([159, 100, 63])  # 40, 25 and 16 entries ended by then
    q = torch.randn(tokens, heads, 128, generator=gen)
    q, weights = indexer.quantize_queries(
        q, q_pos, cos_sin, torch.randn(tokens, heads, generator=gen), 128**-0.5, heads**-0.5
    )
    lengths = ((q_pos + 1) // ratio).to(torch.int32)
    tables = torch.arange(3, dtype=torch.int32).expand(tokens, -1).contiguous()
    want = oracle.index_topk(q, weights, caches["reference"], tables, lengths, 16)
    got = api.index_topk(q, weights, caches["triton"], tables, lengths, 16, max_len=entries)
    assert torch.equal(got, want)
    assert (want[2] >= 0).sum() == 16 and (want[0] >= 0).sum() == 16
