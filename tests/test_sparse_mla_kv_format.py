"""Sparse-MLA cache records: packers, the row reader, and the kernel's exact e4m3 decode."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    SparseMLAError,
    SparseMLATypeError,
    pack_bf16,
    pack_fp8_ds_mla,
    pack_rows,
    record_bytes,
    sparse_mla_forward,
    sparse_mla_reference,
    unpack_rows,
)


def test_record_bytes():
    assert record_bytes("fp8_ds_mla") == 656 and record_bytes("bf16") == 1152
    assert record_bytes("nvfp4_ds_mla") == 352  # vLLM's page size is keyed on it
    with pytest.raises(SparseMLAError, match="kv_format: expected one of"):
        record_bytes("fp8_e4m3")


def test_fp8_pack_layout_and_roundtrip():
    gen = torch.Generator().manual_seed(0)
    kv_c = torch.randn(6, 512, generator=gen) * torch.tensor([1e-3, 1, 30, 0, 5, 2])[:, None]
    kv_c[5, 128:256] = 0  # an all-zero group: scale guarded to 1, values stay 0
    k_pe = torch.randn(6, 64, generator=gen)
    rec = pack_fp8_ds_mla(kv_c, k_pe)
    assert rec.dtype == torch.uint8 and rec.shape == (6, 656)
    scales = rec[:, 512:528].contiguous().view(torch.float32)
    amax = kv_c.reshape(6, 4, 128).abs().amax(-1)
    # the same fp32 max (exact) and one correctly rounded division: bit-exact
    torch.testing.assert_close(scales, torch.where(amax > 0, amax / 448, 1.0), rtol=0, atol=0)
    assert torch.equal(rec[:, 528:].contiguous().view(torch.bfloat16), k_pe.bfloat16())
    cache = rec.view(2, 3, 656)
    got_c, got_pe = unpack_rows(cache, torch.arange(6).view(3, 2), "fp8_ds_mla")
    assert got_c.shape == (3, 2, 512) and got_pe.shape == (3, 2, 64)
    got_c = got_c.reshape(6, 512)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of each value, or half the
    # smallest subnormal step (2**-10 * scale) for tiny ones; the fp32 divide / multiply by
    # the scale add 2 x 2**-24 relative, inside the margin of the sum of both terms.
    err = (got_c - kv_c).abs()
    bound = kv_c.abs() * 2.0**-4 + scales.repeat_interleave(128, dim=1) * 2.0**-10
    assert (err <= bound).all()
    assert (got_c[3] == 0).all() and (got_c[5, 128:256] == 0).all()
    assert torch.equal(got_pe.reshape(6, 64), k_pe.bfloat16().float())


def test_bf16_pack_roundtrip_through_strided_cache():
    kv_c, k_pe = torch.randn(8, 512).bfloat16().float(), torch.randn(8, 64).bfloat16().float()
    big = torch.zeros(4, 2, 2, 576, dtype=torch.bfloat16)
    big[:, 0] = pack_bf16(kv_c, k_pe).view(4, 2, 576)
    cache = big[:, 0]
    got_c, got_pe = unpack_rows(cache, torch.tensor([7, 0, 3]), "bf16")
    assert torch.equal(got_c, kv_c[[7, 0, 3]]) and torch.equal(got_pe, k_pe[[7, 0, 3]])


@pytest.mark.parametrize(
    ("kv_c", "k_pe", "exc", "match"),
    [
        (torch.zeros(2, 511), torch.zeros(2, 64), SparseMLAError, "kv_c: expected \\[N, 512\\]"),
        (torch.zeros(2, 512), torch.zeros(3, 64), SparseMLAError, "k_pe: expected \\[N=2, 64\\]"),
        (torch.zeros(2, 512, dtype=torch.int32), torch.zeros(2, 64), SparseMLATypeError, "kv_c"),
    ],
)
def test_pack_rejects_bad_rows(kv_c, k_pe, exc, match):
    with pytest.raises(exc, match=match):
        pack_fp8_ds_mla(kv_c, k_pe)


def test_kernel_decodes_every_e4m3_code_exactly():
    """One index per token makes out == kv_c of that row, which is exact in bf16 for
    every e4m3 value (normals, subnormals, +-0); 0x7F / 0xFF decode to NaN."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    rows = torch.zeros(4, 656, dtype=torch.uint8)
    rows[0, :254], rows[1, :254] = codes, codes.flip(0)
    rows[2, 300] = 0x7F
    rows[:, 512:528] = torch.tensor([1.0, 2.0**-3, 4.0, 1.0]).repeat(4, 1).view(torch.uint8)
    cache = rows.view(2, 2, 656)
    idx = torch.tensor([[0], [1], [2], [3]], dtype=torch.int32)
    q = torch.zeros(4, 2, 576, dtype=torch.bfloat16)
    out, _ = sparse_mla_forward(q, cache, idx, 1.0, kv_format="fp8_ds_mla", impl="triton")
    ref, _ = sparse_mla_reference(q, cache, idx, 1.0, kv_format="fp8_ds_mla")
    want = unpack_rows(cache, torch.arange(4), "fp8_ds_mla")[0]
    assert want[0, 4:8].tolist() != [0, 0, 0, 0]  # subnormals (codes 4..7) present
    for t in (0, 1, 3):
        assert torch.equal(out[t].float(), want[t].expand(2, 512))
        assert torch.equal(ref[t].float(), want[t].expand(2, 512))
    assert out[2].float().isnan().all() and ref[2].float().isnan().all()


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_unpack_checks_the_cache(fmt):
    other = "fp8_ds_mla" if fmt == "bf16" else "bf16"  # a format of another cache dtype
    cache = pack_rows(torch.zeros(4, 512), torch.zeros(4, 64), fmt).view(2, 2, -1)
    unpack_rows(cache, torch.tensor([3]), fmt)
    with pytest.raises(SparseMLATypeError, match=f"kv_cache: format {other} expects dtype"):
        unpack_rows(cache, torch.tensor([3]), other)


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_records_decode_at_any_byte_offset(fmt):
    """A one-record view is contiguous at whatever offset it starts (a fuzzed strided
    cache gave offset 1, and odd strides on size-1 dims): the decoders make fresh dense
    copies before viewing bytes as wider types."""
    from vllm_mla.ops.sparse_mla.formats import unpack_records

    rec = pack_rows(torch.randn(2, 512), torch.randn(2, 64), fmt)
    if rec.dtype != torch.uint8:  # bf16 records: a 1-byte shift is no bf16 tensor at all
        return
    one = torch.zeros(rec.shape[1] + 1, dtype=torch.uint8)
    one[1:] = rec[0]
    rows = torch.zeros(2, rec.shape[1] + 1, dtype=torch.uint8)  # row stride 657 (odd)
    rows[:, 1:] = rec
    # one record of a [1, 1, W] cache whose size-1 dims keep odd strides (a plain clone
    # keeps them, and torch 2.11's dtype view checks them)
    single = torch.zeros(rec.shape[1] + 2, dtype=torch.uint8)
    single[1:-1] = rec[0]
    cell = single.as_strided((1, 1, rec.shape[1]), (rec.shape[1] + 1,) * 2 + (1,), 1)
    cases = ((one[1:].view(1, -1), rec[:1]), (rows[:, 1:], rec), (cell, rec[:1].view(1, 1, -1)))
    for shifted, want_rec in cases:
        got, want = unpack_records(shifted, fmt), unpack_records(want_rec, fmt)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
