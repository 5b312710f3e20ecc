"""MLA decode query projection ``out = [q_nope @ W_UK_T | q_pe]``, optionally FP8: the
public API and its contract.

Contract:

- ``q_nope [M, H, P]`` bf16 (a strided view of q is fine), ``q_pe [M, H, R]`` bf16,
  ``weight`` a bf16 ``[H, P, L]`` tensor or an MXFP8 pair (values e4m3 ``[H, P, L]``,
  scales uint8 ``[H, P, L/32]``), ``out [M, H, L + R]`` bf16 or float8_e4m3fn; every
  tensor needs a contiguous last dim, other strides are free; ``out`` must not overlap
  an input nor itself (no stride-0 dim), and every tensor (scales too) is on q_nope's
  device.
- ``out[..., :L] = bf16(q_nope @ W)`` with fp32 accumulation, ``out[..., L:] = q_pe``;
  for FP8 ``out`` each element is ``e4m3(clamp(bf16_value / q_scale, -448, 448))``.
- The fused Triton kernel matches ``staged_query_projection`` (bmm -> cat -> quant)
  within one BF16 ulp before quantization (summation order differs).
- ``can_fuse_query_projection`` admits H 1..128, P in {128, 192}, L = 512, R = 64,
  M 1..64 on CUDA with Triton; anything else runs the staged path.
- ``prewarm_query_projection`` compiles every graph-visible M before CUDA-graph capture; a compile
  requested during capture raises ``QueryProjectionNotPrewarmed`` instead of stalling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mla.formats import LATENT, ROPE
from vllm_mla.ops import overlap
from vllm_mla.ops.base import TRITON_AVAILABLE, KernelNotPrewarmed, MXFP8Weight, triton_runs_on
from vllm_mla.quant import mxfp8

FUSED_HEADS = range(1, 129)
FUSED_NOPE = (128, 192)
FUSED_LATENT = LATENT
FUSED_ROPE = ROPE
FUSED_MAX_M = 64
OUT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
QueryProjectionNotPrewarmed = KernelNotPrewarmed  # the name this op's callers know


Weight = torch.Tensor | MXFP8Weight | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Args:
    """Validated call: sizes and the normalised weight."""

    m: int
    h: int
    p: int
    latent: int
    rope: int
    weight: torch.Tensor | MXFP8Weight
    fp8_out: bool

    @property
    def weight_format(self) -> str:
        return "mxfp8" if isinstance(self.weight, MXFP8Weight) else "bf16"


def _need(cond: bool, exc: type[Exception], message: str) -> None:
    if not cond:
        raise exc(message)


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], dims: int) -> None:
    _need(isinstance(t, torch.Tensor), TypeError, f"{name}: expected a Tensor, got {type(t)}")
    _need(t.dtype in dtypes, TypeError, f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    _need(t.dim() == dims, ValueError, f"{name}: expected {dims}-D, got shape {tuple(t.shape)}")
    _need(
        t.stride(-1) == 1 or t.size(-1) == 1,
        ValueError,
        f"{name}: last dim must be contiguous (stride 1), got strides {tuple(t.stride())}",
    )


def validate(q_nope, weight, q_pe, out, q_scale) -> Args:
    """The call checked against the contract (an error names the argument at fault)."""
    _check_tensor("q_nope", q_nope, (torch.bfloat16,), 3)
    _check_tensor("q_pe", q_pe, (torch.bfloat16,), 3)
    _check_tensor("out", out, OUT_DTYPES, 3)
    m, h, p = q_nope.shape
    if isinstance(weight, tuple) and not isinstance(weight, torch.Tensor):
        _need(len(weight) == 2, ValueError, "weight: an MXFP8 pair is (values, scales)")
        weight = MXFP8Weight(*weight)
        _check_tensor("weight.values", weight.values, (torch.float8_e4m3fn,), 3)
        _check_tensor("weight.scales", weight.scales, (torch.uint8,), 3)
        values = weight.values
    else:
        _check_tensor("weight", weight, (torch.bfloat16,), 3)
        values = weight
    _need(
        tuple(values.shape[:2]) == (h, p),
        ValueError,
        f"weight: expected [H={h}, P={p}, L], got shape {tuple(values.shape)}",
    )
    latent = values.shape[2]
    if isinstance(weight, MXFP8Weight):
        want = (h, p, latent // mxfp8.BLOCK_SIZE)
        _need(
            latent % mxfp8.BLOCK_SIZE == 0 and tuple(weight.scales.shape) == want,
            ValueError,
            f"weight.scales: expected shape {want}, got {tuple(weight.scales.shape)}",
        )
    _need(
        tuple(q_pe.shape[:2]) == (m, h),
        ValueError,
        f"q_pe: expected [M={m}, H={h}, R], got shape {tuple(q_pe.shape)}",
    )
    rope = q_pe.shape[2]
    want = (m, h, latent + rope)
    _need(
        tuple(out.shape) == want, ValueError, f"out: expected shape {want}, got {tuple(out.shape)}"
    )
    fp8_out = out.dtype == torch.float8_e4m3fn
    if fp8_out:
        _need(q_scale is not None, ValueError, "q_scale: required when out is float8_e4m3fn")
    if q_scale is not None:
        _need(
            isinstance(q_scale, torch.Tensor) and q_scale.dtype == torch.float32,
            TypeError,
            f"q_scale: expected a float32 tensor, got {getattr(q_scale, 'dtype', type(q_scale))}",
        )
        _need(
            q_scale.numel() == 1, ValueError, f"q_scale: expected 1 element, got {q_scale.numel()}"
        )
    inputs = [("q_nope", q_nope), ("q_pe", q_pe), ("weight", values)]
    if isinstance(weight, MXFP8Weight):
        inputs.append(("weight.scales", weight.scales))
    if q_scale is not None:
        inputs.append(("q_scale", q_scale))
    for name, t in [*inputs[1:], ("out", out)]:
        _need(
            t.device == q_nope.device,
            ValueError,
            f"{name}: expected device {q_nope.device} (q_nope's), got {t.device}",
        )
    # The fused kernel writes the latent part before it reads q_pe: no in-place call.
    problem = overlap.out_problem(out, inputs)
    _need(problem is None, ValueError, problem)
    return Args(m, h, p, latent, rope, weight, fp8_out)


def can_fuse_query_projection(
    *,
    num_heads: int,
    max_m: int,
    nope_dim: int,
    latent_dim: int,
    out_dtype: torch.dtype,
    weight_format: str,
    device: torch.device | str,
) -> bool:
    """True when the fused kernel serves this shape on this device (else: staged path)."""
    device = torch.device(device)
    on_device = triton_runs_on(device)
    if not (TRITON_AVAILABLE and on_device):
        return False
    # Native e4m3 conversion (round to nearest even) needs SM89 or newer.
    fp8_on_cuda = out_dtype == torch.float8_e4m3fn and device.type == "cuda"
    if fp8_on_cuda and torch.cuda.get_device_capability(device) < (8, 9):
        return False
    return (
        num_heads in FUSED_HEADS
        and 1 <= max_m <= FUSED_MAX_M
        and nope_dim in FUSED_NOPE
        and latent_dim == FUSED_LATENT
        and out_dtype in OUT_DTYPES
        and weight_format in ("bf16", "mxfp8")
    )


def mla_query_projection(
    q_nope: torch.Tensor,
    weight: Weight,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    *,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the final ``[M, H, L + R]`` query into ``out``: fused when gated in, else staged.

    Runs as the custom op ``torch.ops.vllm_mla.mla_query_projection`` (fake impl
    registered), so torch.compile and CUDA graphs see one opaque op.
    """
    args = validate(q_nope, weight, q_pe, out, q_scale)
    w = args.weight
    values, scales = (w.values, w.scales) if isinstance(w, MXFP8Weight) else (w, None)
    torch.ops.vllm_mla.mla_query_projection(q_nope, values, scales, q_pe, out, q_scale)
    return out


def prewarm_query_projection(
    m_values: list[int] | range,
    *,
    num_heads: int,
    nope_dim: int,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
) -> int:
    """Compile the fused kernel for every M in ``m_values`` (call before graph capture).

    Returns how many M values take the fused path (the others run staged and need
    no compile).
    """
    warmed = 0
    for m in m_values:
        if not can_fuse_query_projection(
            num_heads=num_heads,
            max_m=m,
            nope_dim=nope_dim,
            latent_dim=FUSED_LATENT,
            out_dtype=out_dtype,
            weight_format=weight_format,
            device=device,
        ):
            continue
        q = torch.zeros(m, num_heads, nope_dim + FUSED_ROPE, dtype=torch.bfloat16, device=device)
        shape = (num_heads, nope_dim, FUSED_LATENT)
        if weight_format == "mxfp8":
            weight = MXFP8Weight(
                torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                torch.full((*shape[:2], FUSED_LATENT // 32), 127, dtype=torch.uint8, device=device),
            )
        else:
            weight = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        out = torch.empty(m, num_heads, FUSED_LATENT + FUSED_ROPE, dtype=out_dtype, device=device)
        scale = torch.ones((), dtype=torch.float32, device=device)
        mla_query_projection(q[..., :nope_dim], weight, q[..., nope_dim:], out, q_scale=scale)
        warmed += 1
    return warmed
