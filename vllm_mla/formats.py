"""The number formats and record geometry every part of vllm-mla shares, defined once.

float8_e4m3fn (OCP FP8 E4M3, torch ``float8_e4m3fn``): 4 exponent bits (bias 7), 3
mantissa bits, no infinities, one NaN code per sign; the largest finite value is 448.
E8M0 (OCP MX scale): an unsigned power-of-two exponent byte, bias 127, 255 = NaN.
MXFP8 (OCP MX v1.0): e4m3 elements, one E8M0 scale per 32. DeepSeek block FP8: e4m3
weights, one fp32 scale per 128 x 128 block. MLA's latent query / KV row: 512 latent
(kv_lora_rank) + 64 rotary = 576 for every model served here. Imports nothing.
"""

from __future__ import annotations

# float8_e4m3fn
E4M3_MAX = 448.0  # largest finite value
E4M3_EMAX = 8  # exponent of E4M3_MAX: floor(log2(448))
E4M3_NAN_CODE = 0x7F  # NaN bit pattern, S.1111.111 with S = 0

# E8M0 scales and MXFP8 blocks
E8M0_BIAS = 127  # exponent bias
E8M0_NAN = 255  # NaN code: the whole block is NaN
E8M0_MAX = 254  # largest finite code, 2**127
MX_BLOCK = 32  # elements sharing one E8M0 scale (OCP MX v1.0 block size k)

# DeepSeek block FP8
FP8_BLOCK = 128  # scale granularity, rows and columns

# MLA latent geometry and the sparse KV records (FlashMLA's fp8_ds_mla, or bf16 rows)
LATENT = 512  # kv_lora_rank: kv_c, also the value / output width
ROPE = 64  # qk_rope_head_dim
HEAD_DIM = LATENT + ROPE  # 576: one latent query / KV row
DS_MLA_SCALE_GROUP = 128  # fp8_ds_mla: one fp32 scale per 128 latent values
FP8_DS_MLA_RECORD = LATENT + 4 * (LATENT // DS_MLA_SCALE_GROUP) + 2 * ROPE  # 656 bytes
# nvfp4_ds_mla (vLLM's NVFP4 NoPE + FP8 RoPE record): 512 e2m1 (two per byte), 64 e4m3
# RoPE values, one e4m3 scale per NVFP4_BLOCK latent values
E2M1_MAX = 6.0  # largest e2m1 value (OCP FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
NVFP4_BLOCK = 16  # latent values sharing one e4m3 scale
NVFP4_SCALE_FLOOR = 2.0**-9  # smallest scale (e4m3's smallest subnormal): zeros stay zero
NVFP4_DS_MLA_RECORD = LATENT // 2 + ROPE + LATENT // NVFP4_BLOCK  # 352 bytes
PAGE_ROWS = 64  # KV rows per page for DSA models (vLLM's FlashMLA-sparse block size)
# A kpool indexer's (GLM-5.3-Flash) top-k buffer: index_topk + index_kpool - 1 columns
# rounded up to this (vLLM glm5next's get_sparse_topk_buffer_width)
TOPK_BUFFER_ALIGN = 128

# DeepSeek-V4's attention records (vLLM's fp8_ds_mla for head 512): per token 448 e4m3
# NoPE values, 64 bf16 RoPE values, 7 UE8M0 exponents (one per 64 NoPE values) and a pad
# byte; a page holds its tokens' 576-byte data rows, then their 8-byte scale rows
DSV4_HEAD = 512  # head_dim: one latent, K and V
DSV4_NOPE = DSV4_HEAD - ROPE  # 448
DSV4_QUANT_BLOCK = 64  # NoPE values sharing one UE8M0 scale
DSV4_DATA_BYTES = DSV4_NOPE + 2 * ROPE  # 576
DSV4_SCALE_BYTES = DSV4_NOPE // DSV4_QUANT_BLOCK + 1  # 8: seven exponents, a zero pad
DSV4_RECORD = DSV4_DATA_BYTES + DSV4_SCALE_BYTES  # 584
# vLLM's writers of these records differ for small values: its Triton writers floor a
# block's amax at DSV4_FLOOR (scale >= 2**-22) and keep e4m3 subnormals; vLLM CPU's _C
# writers floor amax / 448 at DSV4_FLOOR (scale >= 2**-13) and store 0 for a scaled value
# under e4m3's smallest normal, 2**-6 (flush to zero)
DSV4_FLOOR = 1e-4
DSV4_WRITERS = ("cpu", "triton")
E4M3_MIN_NORMAL = 2.0**-6

# The DSA lightning indexer's key cache (DeepSeek-V3.2 / GLM-5)
INDEX_HEAD_DIM = 128  # index_head_dim
INDEX_RECORD_BYTES = INDEX_HEAD_DIM + 4  # 132: e4m3 key + one fp32 scale

# The sparse attention backend's registered name
SPARSE_BACKEND = "B12X_MLA_SPARSE"
