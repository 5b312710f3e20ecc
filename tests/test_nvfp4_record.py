"""nvfp4_ds_mla records: both writers (torch, Triton) byte-identical to an encoder written
here from the rule alone, the reader exact in the Triton kernel, and the writer kernel
lowered for every GPU target from SM80."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from aot import assert_fits, compile_report

from vllm_mla.ops.sparse_mla import (
    SparseMLAError,
    SparseMLATypeError,
    nvfp4_record,
    sparse_mla_forward,
    sparse_mla_reference,
    unpack_rows,
    write_records,
)

FMT = "nvfp4_ds_mla"


# ------------------------------------------------ the oracle: the rule, value by value
def _e4m3_table() -> np.ndarray:
    """Magnitudes of e4m3 codes 0..126 (0x7F is NaN), from the bit layout."""
    code = np.arange(127)
    e, m = code >> 3, code & 7
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7.0))


E4M3 = _e4m3_table()
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nearest_even(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Code of the nearest table value to each magnitude (float64: the distances between
    fp32 values and these short table values are exact), a tie to the even code; past the
    largest value the largest code (saturation)."""
    mag = np.minimum(mag, table[-1])
    dist = np.abs(mag[..., None] - table)
    best = dist.min(axis=-1, keepdims=True)
    tied = dist == best
    odd = tied & (np.arange(len(table)) % 2 == 1)
    pick = np.where(tied.sum(-1) > 1, np.argmax(tied & ~odd, axis=-1), np.argmax(tied, axis=-1))
    return pick


def _signed(codes: np.ndarray, x: np.ndarray, bit: int) -> np.ndarray:
    return codes | (np.signbit(x).astype(np.int64) << bit)


def oracle(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The record by the rule: per block of 16, ``sf = e4m3(max(amax / 6, 2**-9))`` (fp32
    division, nearest-even, saturating), ``q = x / sf`` (fp32 division) to the nearest
    e2m1 (ties to even, saturating, sign kept); RoPE to e4m3; block s's scale at byte
    ``320 + 8 (s & 3) + (s >> 2)``; the even element in the low nibble."""
    x = kv_c.float().numpy().reshape(-1, 32, 16)
    amax = np.abs(x).max(axis=-1)
    sf_in = np.maximum(amax / np.float32(6.0), np.float32(2.0**-9)).astype(np.float32)
    sf_code = _nearest_even(sf_in.astype(np.float64), E4M3)
    sf = E4M3[sf_code].astype(np.float32)
    q = (x / sf[..., None]).astype(np.float32)
    codes = _signed(_nearest_even(np.abs(q).astype(np.float64), E2M1), q, 3).reshape(-1, 512)
    n = codes.shape[0]
    out = np.zeros((n, 352), dtype=np.int64)
    out[:, :256] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if k_pe.shape[-1]:
        pe = k_pe.float().numpy().reshape(n, -1)
        out[:, 256:320] = _signed(_nearest_even(np.abs(pe).astype(np.float64), E4M3), pe, 7)
    for s in range(32):
        out[:, 320 + 8 * (s & 3) + (s >> 2)] = sf_code[:, s]
    return torch.from_numpy(out.astype(np.uint8))


# ------------------------------------------------ inputs: random, ties, zeros, saturating
def _rows() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    cases = {}
    scale = torch.tensor([1e-4, 1e-2, 1.0, 30.0, 1e3])[torch.arange(20) % 5, None]
    cases["random"] = (
        torch.randn(20, 512, generator=gen) * scale,
        torch.randn(20, 64, generator=gen) * scale,
    )
    # ties: x = sf * (an e2m1 midpoint) exactly, the block amax pinning sf (amax = 6 sf)
    sf = E4M3[torch.randint(1, 120, (16, 32), generator=gen).numpy()]
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    q = mids[torch.randint(0, 7, (16, 32, 16), generator=gen).numpy()]
    q[..., 0] = 6.0
    sign = np.where(torch.rand(16, 32, 16, generator=gen).numpy() < 0.5, -1.0, 1.0)
    tie_c = torch.from_numpy((q * sign * sf[..., None]).reshape(16, 512)).float()
    # the scale itself at an e4m3 tie: amax / 6 = 1.0625 (between 1 and 1.125), 2.5 * 2**-9
    tie_c[0, :16] = 6.375
    tie_c[1, :16] = 6 * 2.5 * 2.0**-9
    pe_mid = (E4M3[:-1] + E4M3[1:]) / 2  # every e4m3 midpoint below 448
    tie_pe = torch.from_numpy(np.resize(pe_mid, (16, 64))).float()
    tie_pe[::2] *= -1
    cases["ties"] = (tie_c, tie_pe)
    zeros = torch.zeros(4, 512)
    zeros[1] = -0.0  # the sign of zero is kept: code 8
    zeros[2, 100] = 1e-30  # a block whose scale is the 2**-9 floor
    pe0 = torch.zeros(4, 64)
    pe0[1] = -0.0
    cases["zeros"] = (zeros, pe0)
    big = torch.randn(6, 512, generator=gen) * 1e4  # sf saturates at 448, q at 6
    big[0, :16] = float("inf")
    big[1, :16] = -3e38
    big_pe = torch.randn(6, 64, generator=gen) * 1e3  # RoPE saturates at +-448
    big_pe[0] = float("-inf")
    cases["saturating"] = (big, big_pe)
    cases["bf16"] = (
        torch.randn(8, 512, generator=gen).bfloat16(),
        torch.randn(8, 64, generator=gen).bfloat16(),
    )
    cases["rope0"] = (torch.randn(3, 512, generator=gen), torch.zeros(3, 0))
    return cases


ROWS = _rows()


@pytest.mark.parametrize("case", sorted(ROWS))
def test_encoder_equals_the_rule(case):
    kv_c, k_pe = ROWS[case]
    assert torch.equal(nvfp4_record.encode(kv_c, k_pe), oracle(kv_c, k_pe))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("case", sorted(ROWS))
def test_writers_write_the_rules_bytes_at_their_slots(case, impl):
    """Records land at their slots (a slot < 0 writes nothing, every other byte of the
    cache keeps its poison), byte-identical to the oracle; k_pe as vLLM passes it
    ([T, 1, rope])."""
    kv_c, k_pe = ROWS[case]
    n = kv_c.shape[0]
    cache = torch.full((n + 3, 2, 352), 0xA5, dtype=torch.uint8)
    slots = torch.randperm(2 * (n + 3), generator=torch.Generator().manual_seed(n))[:n]
    slots[1] = -1
    write_records(kv_c, k_pe.unsqueeze(1), cache, slots, FMT, impl=impl)
    want = torch.full_like(cache, 0xA5).view(-1, 352)
    keep = slots >= 0
    want[slots[keep]] = oracle(kv_c, k_pe)[keep]
    assert torch.equal(cache.view(-1, 352), want)


def test_the_tie_cases_are_ties():
    """The 'ties' inputs do sit on e2m1 midpoints (so the test above exercises ties)."""
    kv_c, _ = ROWS["ties"]
    sf = nvfp4_record.block_scales(kv_c)
    q = (kv_c.reshape(-1, 32, 16) / sf[..., None]).abs()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert torch.isin(q, mids).float().mean() > 0.8


def test_decode_is_exact_and_within_half_a_step():
    """decode(encode(x)): each value is an e2m1 code times its e4m3 scale (so bf16-exact),
    within half an e2m1 step of x, |x - x^| <= sf / 4 for |x / sf| < 2, sf / 2 in [2, 4),
    sf in [4, 6] (e2m1's steps are 0.5, 1, 2), plus what saturation clips: |x / sf| - 6
    when the scale rounded down (by <= 2**-4 relative for a normal e4m3 scale, so
    |x / sf| <= 6.375; up to 33% for a subnormal one, amax below ~0.09) or hit 448."""
    kv_c, k_pe = ROWS["random"]
    got_c, got_pe = nvfp4_record.decode(nvfp4_record.encode(kv_c, k_pe))
    assert torch.equal(got_c.bfloat16().float(), got_c)
    sf = nvfp4_record.block_scales(kv_c).repeat_interleave(16, dim=1)
    mag = (kv_c / sf).abs()
    half_step = torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))
    bound = (half_step + (mag - 6).clamp(min=0)) * sf
    assert ((got_c - kv_c).abs() <= bound).all()
    normal = (sf >= 2.0**-6) & (sf < 448)
    assert (mag[normal] <= 6.375).all()
    # RoPE: e4m3 saturating at 448 (a plain cast past 464 is NaN on some torch versions)
    assert torch.equal(got_pe, k_pe.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_kernel_reads_every_code_and_scale_exactly():
    """One index per token: out is that record's decoded row, exactly (e2m1 x e4m3 is a
    bf16 value), for all 16 e2m1 codes against scales spanning e4m3 (subnormal to 448),
    in the Triton loader and the reference."""
    gen = torch.Generator().manual_seed(1)
    rec = torch.randint(0, 256, (8, 352), generator=gen, dtype=torch.uint8)
    rec[:, 320:] = torch.randint(1, 127, (8, 32), generator=gen, dtype=torch.uint8)
    rec[0, 320:] = torch.arange(1, 127, 4, dtype=torch.uint8)  # subnormal scales included
    rec[1, :256] = torch.arange(256, dtype=torch.uint8)  # every (lo, hi) code pair
    rec[:, 256:320] = torch.randint(0, 127, (8, 64), generator=gen, dtype=torch.uint8)
    cache = rec.view(4, 2, 352)
    idx = torch.arange(8, dtype=torch.int32)[:, None]
    q = torch.zeros(8, 2, 576, dtype=torch.bfloat16)
    want = unpack_rows(cache, torch.arange(8), FMT)[0]
    for impl in ("triton", "reference"):
        if impl == "triton":
            out, _ = sparse_mla_forward(q, cache, idx, 1.0, kv_format=FMT, impl="triton")
        else:
            out, _ = sparse_mla_reference(q, cache, idx, 1.0, kv_format=FMT)
        assert torch.equal(out.float(), want[:, None].expand(8, 2, 512)), impl


def test_write_records_names_what_is_wrong():
    cache = torch.zeros(2, 2, 352, dtype=torch.uint8)
    kv_c, k_pe, slots = torch.zeros(3, 512), torch.zeros(3, 64), torch.tensor([0, 1, 2])
    with pytest.raises(SparseMLAError, match=r"kv_c: expected \[>= T=3, 512\]"):
        write_records(kv_c[:2], k_pe, cache, slots, FMT)
    with pytest.raises(SparseMLAError, match="k_pe: expected"):
        write_records(kv_c, torch.zeros(3, 32), cache, slots, FMT)
    with pytest.raises(SparseMLATypeError, match="slot_mapping: expected an int32/int64"):
        write_records(kv_c, k_pe, cache, slots.float(), FMT)
    with pytest.raises(SparseMLAError, match="kv_cache: format nvfp4_ds_mla expects"):
        write_records(kv_c, k_pe, torch.zeros(2, 2, 656, dtype=torch.uint8), slots, FMT)
    with pytest.raises(NotImplementedError, match="impl='triton' writes"):
        write_records(kv_c, k_pe, torch.zeros(2, 2, 576).bfloat16(), slots, "bf16", "triton")


def test_custom_op_schema_and_fake():
    """The op vLLM's graphs see: registered, mutating the cache, with a fake."""
    from torch.library import opcheck

    kv_c, k_pe = ROWS["random"][0][:4], ROWS["random"][1][:4]
    cache = torch.zeros(4, 2, 352, dtype=torch.uint8)
    args = (kv_c, k_pe, cache, torch.tensor([0, 3, -1, 5]), FMT, "reference")
    opcheck(
        torch.ops.vllm_mla.write_kv_records.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


AOT_WRITER = r"""
import json, sys
from aot import cubin_usage
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_mla.ops.sparse_mla import record_write_kernel as k

report = []
for arch, dtype, rope in json.loads(sys.argv[1]):
    sig = {"kvc_ptr": f"*{dtype}", "kpe_ptr": f"*{dtype}", "cache_ptr": "*u8",
           "slot_ptr": "*i64", "s_kvc": "i32", "s_kpe": "i32", "s_cb": "i32", "s_ct": "i32",
           "block_size": "i32", "ROPE": "constexpr", "BLOCKS": "constexpr"}
    ck = triton.compile(ASTSource(k._nvfp4_write_kernel, sig, dict(ROPE=rope, BLOCKS=32)),
                        target=GPUTarget("cuda", arch, 32), options=dict(num_warps=1))
    ptx = ck.asm["ptx"]
    usage = cubin_usage(ck)
    report.append({"arch": arch, "shared": ck.metadata.shared, "usage": usage,
                   "fp4_or_fp8_ptx": any(s in ptx for s in ("e2m1", "e4m3", "e5m2")),
                   "div_rn": "div.rn.f32" in ptx})
print(json.dumps(report))
"""


def test_writer_compiles_for_gpu_targets_without_fp4_or_fp8_instructions():
    """Lowered for sm80/89/90/120 (bf16 and fp32 latents, rope 64 and 0) with Triton's
    bundled ptxas: fits, no spills, no cvt to e2m1/e4m3 in the PTX (SM100a/SM120a-only or
    SM89+ instructions), and the divisions are IEEE ``div.rn.f32``."""
    pytest.importorskip("triton.backends.nvidia")
    cases = [[80, "bf16", 64], [89, "fp32", 64], [90, "bf16", 0], [120, "bf16", 64]]
    report = compile_report(AOT_WRITER, cases)
    assert_fits(report)
    assert not any(r["fp4_or_fp8_ptx"] for r in report)
    assert all(r["div_rn"] for r in report)


def _element_bound(x: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """What e2m1 x sf can be off by at each value, from the step alone: half a step (0.5,
    1, 2 times sf below 2, 4, 6 sf) plus what saturation at 6 sf clips."""
    mag = (x / sf).abs()
    half = torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))
    return (half + (mag - 6).clamp(min=0)) * sf


def test_attention_output_error_within_the_bound_from_e2m1s_step():
    """Sparse attention over nvfp4 records (fp32 reference, exact decode) against fp32
    attention over the unquantized rows. Worst case per output element, from the step:
    the values move by <= E_v (``_element_bound``), every logit by <= D = scale * sum |q|
    x (E_kv, and e4m3's half ulp 2**-4 |k_pe| or 2**-10 for the RoPE), so every softmax
    weight by a factor within e^(+-2D): ``|out' - out| <= max_j E_v[j] + (e^(2D) - 1)
    sum_j w_j |v_j|`` (plus fp32's own 1e-5 relative). The measured error must sit inside,
    and the bound must not be vacuous (the worst measured / bound ratio is reported)."""
    gen = torch.Generator().manual_seed(3)
    t, h, k, n = 3, 4, 40, 64
    kv_c, k_pe = torch.randn(n, 512, generator=gen), torch.randn(n, 64, generator=gen)
    cache = nvfp4_record.encode(kv_c, k_pe).view(4, 16, 352)
    q = torch.randn(t, h, 576, generator=gen) * 0.3
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(t)]).int()
    scale = 576**-0.5
    out_q, _ = sparse_mla_reference(q, cache, idx, scale, kv_format=FMT)
    rows_c, rows_pe = kv_c[idx.long()], k_pe[idx.long()]  # [t, k, *]
    s = torch.einsum("thd,tkd->thk", q.double(), torch.cat([rows_c, rows_pe], -1).double())
    w = torch.softmax(s * scale, -1)
    out = torch.einsum("thk,tkd->thd", w, rows_c.double())
    sf = nvfp4_record.block_scales(kv_c).repeat_interleave(16, dim=1)
    e_kv = _element_bound(kv_c, sf)[idx.long()].double()  # [t, k, 512]
    e_pe = torch.maximum(k_pe.abs() * 2.0**-4, torch.tensor(2.0**-10))[idx.long()].double()
    d = scale * (
        torch.einsum("thd,tkd->thk", q[..., :512].double().abs(), e_kv)
        + torch.einsum("thd,tkd->thk", q[..., 512:].double().abs(), e_pe)
    ).amax(-1)  # [t, h]
    grow = torch.expm1(2 * d)[..., None]
    bound = e_kv.amax(1)[:, None, :] + grow * torch.einsum("thk,tkd->thd", w, rows_c.abs().double())
    bound = bound + 1e-5 * out.abs() + 1e-6
    err = (out_q.double() - out).abs()
    assert (err <= bound).all()
    ratio = (err / bound).max().item()
    rel = (err.norm() / out.norm()).item()
    print(f"\nnvfp4 attention: worst error / bound {ratio:.3f}, relative error {rel:.3e}")
    assert ratio > 1e-3  # the bound is not vacuous at this size
