"""The b12x runner against a fake b12x 1.5.1 (CPU; the real kernels need SM120/121).

The fake ``b12x.attention.sparse_mla`` keeps b12x's API (``plan``/``bind``/``run``/
``Caps``/``ModelType``/``is_supported``) and its conventions: q ``[T,H,576]`` contiguous,
``selected_indices`` physical slots addressed page ``s // page_size`` at the cache's page
stride, ``selected_lengths`` masking, base-2 lse unless ``lse_scale="natural"``, output a
view into the caller's scratch, launchers resolved from the first binding. It computes
with our ``sparse_mla_reference`` after translating those conventions back, so a wrong
mapping in the runner changes the result or raises.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import inspect
import math
import sys
import types

import pytest
import torch

from vllm_mla.ops.sparse_mla import b12x_runner, dispatch, sparse_mla_forward, sparse_mla_reference
from vllm_mla.ops.sparse_mla.kv_format import pack_rows

kernels = importlib.import_module("vllm_mla.ops.triton.sparse_mla")

# The b12x 1.5.1 signatures the runner relies on (copied from the wheel):
# b12x/attention/sparse_mla/api.py:53 plan, :63 bind, :121 run, :165 is_supported;
# b12x/attention/sparse_mla/_scratch.py:47 B12XSparseMLAScratchCaps (exported as Caps);
# b12x/preparation/types.py:541 Plan.memory_requirements -> MemoryRequirements whose
# scratch_nbytes (types.py:182) is a property.
B12X_SIGNATURES = {
    "plan": "(caps, *, invocation, override)",
    "bind": (
        "(plan, *, scratch, q, kv_cache, selected_indices, cache_lengths, selected_lengths, "
        "attention_sink)"
    ),
    "run": "(binding)",
    "is_supported": "(device)",
}
B12X_CAPS_FIELDS_USED = (
    "device",
    "num_q_heads",
    "max_q_rows",
    "max_width",
    "softmax_scale",
    "dtype",
    "kv_dtype",
    "head_dim",
    "v_head_dim",
    "model_type",
    "cache_record_bytes",
    "mode",
    "max_batch",
    "max_chunks_per_row",
    "page_size",
    "return_lse",
    "lse_scale",
)
LN2 = math.log(2.0)
GLM_NSA_RECORD = 656


# -- the fake b12x -----------------------------------------------------------------------
class ModelType:
    DSV4 = 0
    GLM_NSA = 1
    GLM_NEXT = 2
    DSV41 = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Caps:
    device: torch.device | str
    num_q_heads: int
    max_q_rows: int
    max_width: int
    softmax_scale: float
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    head_dim: int = 576
    v_head_dim: int = 512
    model_type: int | None = None
    scale_format: int | None = None
    cache_record_bytes: int | None = None
    fp8_rope: bool | None = None
    latent_scale_per_token: bool = False
    mode: str = "decode"
    max_batch: int | None = None
    max_kv_rows: int = 0
    max_page_table_width: int | None = None
    max_chunks_per_row: int = 64
    max_q_chunks: int | None = None
    page_size: int = 64
    head_major_output: bool = False
    latent_scale: float = 1.0
    return_lse: bool = False
    lse_scale: str = "base2"
    has_attention_sink: bool = False

    def __post_init__(self) -> None:
        # b12x infers GLM_NSA (656-byte ARBITRARY_FP32 record) from head_dim 576.
        if self.model_type not in (None, ModelType.GLM_NSA) or self.head_dim != 576:
            raise ValueError(f"fake b12x serves GLM_NSA only, got {self.model_type}")
        if self.cache_record_bytes not in (None, GLM_NSA_RECORD):
            raise ValueError("sparse MLA cache_record_bytes does not match its planned recipe")
        if not (math.isfinite(self.softmax_scale) and self.softmax_scale > 0):
            raise ValueError("softmax_scale must be finite and positive")
        if self.lse_scale not in ("base2", "natural"):
            raise ValueError("lse_scale must be 'base2' or 'natural'")
        if self.max_batch is None:
            object.__setattr__(self, "max_batch", self.max_q_rows)

    def layout(self) -> tuple[int, int]:
        out_bytes = self.max_q_rows * self.num_q_heads * self.v_head_dim * 2
        return out_bytes, out_bytes + self.max_q_rows * self.num_q_heads * 4


class FakePlan:
    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self.prepared_rows: int | None = None
        self.prepared_topk: int | None = None

    def memory_requirements(self):
        return types.SimpleNamespace(scratch_nbytes=self.caps.layout()[1])


def fake_plan(caps, *, invocation=None, override=None):
    return FakePlan(caps)


def fake_bind(
    plan,
    *,
    scratch,
    q,
    kv_cache,
    selected_indices,
    cache_lengths,
    selected_lengths,
    attention_sink=None,
):
    caps = plan.caps
    assert attention_sink is None
    assert q.ndim == 3 and q.dtype == caps.dtype and q.is_contiguous(), "q"
    assert q.shape[0] <= caps.max_q_rows and q.shape[1:] == (caps.num_q_heads, 576), "q"
    rows = q.shape[0]
    assert selected_indices.dtype == torch.int32 and selected_indices.is_contiguous()
    assert selected_indices.shape[0] == rows and selected_indices.shape[1] <= caps.max_width
    for name, v, ok in (
        ("cache_lengths", cache_lengths, cache_lengths.shape[0] <= caps.max_batch),
        ("selected_lengths", selected_lengths, selected_lengths.shape[0] == rows),
    ):
        assert v.ndim == 1 and v.dtype == torch.int32 and v.is_contiguous() and ok, name
    assert kv_cache.ndim == 3 and kv_cache.dtype == caps.kv_dtype
    assert kv_cache.shape[-1] == caps.cache_record_bytes
    if not kv_cache.is_contiguous():
        assert kv_cache.shape[1] == caps.page_size, "kv_cache page size does not match"
    assert scratch.dtype == torch.uint8 and scratch.is_contiguous()
    assert scratch.numel() >= caps.layout()[1]
    return types.SimpleNamespace(
        plan=plan,
        scratch=scratch,
        q=q,
        kv_cache=kv_cache,
        selected_indices=selected_indices,
        selected_lengths=selected_lengths,
    )


def _gather_records(kv_cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """b12x addressing (kernel.py _cache_base_tensor/_cache_block_stride_bytes, GLM)."""
    if kv_cache.is_contiguous():
        base, page_stride = kv_cache.reshape(-1), page_size * GLM_NSA_RECORD
    else:
        span = 1 + sum((n - 1) * s for n, s in zip(kv_cache.shape, kv_cache.stride(), strict=True))
        base, page_stride = torch.as_strided(kv_cache, (span,), (1,)), kv_cache.stride(0)
    start = (slots // page_size) * page_stride + (slots % page_size) * GLM_NSA_RECORD
    return base[start[:, None] + torch.arange(GLM_NSA_RECORD)]


def fake_run(binding):
    plan, caps = binding.plan, binding.plan.caps
    q, sel, lens = binding.q, binding.selected_indices, binding.selected_lengths
    rows, width = sel.shape
    # Launchers resolve from the first binding; later ones must fit it (kernel.py).
    if plan.prepared_rows is None:
        plan.prepared_rows, plan.prepared_topk = rows, width
    if rows > plan.prepared_rows or width != plan.prepared_topk:
        raise ValueError("runtime unified decode metadata differs from its prepared launch")
    # b12x's masks (reference.py): j < selected_lengths[t], slot >= 0.
    active = torch.arange(width)[None, :] < lens.long().clamp(0, width)[:, None]
    valid = active & (sel >= 0)
    slots = torch.where(valid, sel, 0).long().reshape(-1)
    records = _gather_records(binding.kv_cache, slots, caps.page_size)
    ours = torch.where(valid, torch.arange(rows * width).view(rows, width), -1)
    out_ref, lse_ref = sparse_mla_reference(
        (q[..., :512], q[..., 512:]),
        records.view(rows * width, 1, GLM_NSA_RECORD),
        ours.to(torch.int32),
        caps.softmax_scale,
        kv_format="fp8_ds_mla",  # what GLM_NSA's 656-byte record is
    )
    out_bytes, _ = caps.layout()
    shape = (caps.max_q_rows, caps.num_q_heads)
    output = binding.scratch[:out_bytes].view(torch.bfloat16).view(*shape, 512)[:rows]
    output.copy_(out_ref)
    if not caps.return_lse:
        return output
    lse = binding.scratch[out_bytes : caps.layout()[1]].view(torch.float32).view(shape)[:rows]
    lse.copy_(lse_ref if caps.lse_scale == "natural" else lse_ref / LN2)
    return output, lse


def fake_is_supported(device=None):
    return True


def fake_b12x_modules() -> dict[str, types.ModuleType]:
    mods = {}
    for name in ("b12x", "b12x.attention", "b12x.attention.sparse_mla"):
        mods[name] = types.ModuleType(name)
        mods[name].__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    api = mods["b12x.attention.sparse_mla"]
    api.ModelType, api.Caps, api.plan, api.bind = ModelType, Caps, fake_plan, fake_bind
    api.run, api.is_supported = fake_run, fake_is_supported
    mods["b12x"].attention = mods["b12x.attention"]
    mods["b12x.attention"].sparse_mla = api
    return mods


@pytest.fixture
def clean(monkeypatch):
    """Runner unregistered, b12x probe uncached, no plans; all restored afterwards."""
    monkeypatch.setattr(dispatch, "_b12x_runner", None)
    dispatch._b12x_module.cache_clear()
    b12x_runner.reset()
    yield monkeypatch
    dispatch._b12x_module.cache_clear()
    b12x_runner.reset()


@pytest.fixture
def fake_b12x(clean):
    for name, module in fake_b12x_modules().items():
        clean.setitem(sys.modules, name, module)
    assert b12x_runner.install()
    # _resolve insists on a CUDA SM120 device; the fake runs the same path on CPU.
    clean.setattr(dispatch, "_resolve", lambda impl, device: "b12x")
    return sys.modules["b12x.attention.sparse_mla"]


# -- cases -------------------------------------------------------------------------------
PAGE = 16


def make_case(kv_format, t, h, k, *, ragged, seed=0):
    """Interleaved (strided) cache pages, split strided q, -1 padding, ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 4
    n = blocks * PAGE
    records = pack_rows(
        torch.randn(n, 512, generator=gen), torch.randn(n, 64, generator=gen), kv_format
    )
    pool = torch.zeros(blocks, 2, PAGE, records.shape[-1], dtype=records.dtype)
    pool[:, 1] = records.view(blocks, PAGE, -1)  # another layer's pages sit in between
    cache = pool[:, 1]
    q = torch.randn(t, h, 576, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, n, (t, k), generator=gen, dtype=torch.int32)
    idx[torch.rand(t, k, generator=gen) < 0.3] = -1
    idx[0] = -1  # a row with no valid index
    lengths = None
    if ragged:
        lengths = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32)
        lengths[-1] = 1
        if t > 2:
            lengths[1] = 0
    return (q[..., :512], q[..., 512:]), cache, idx, lengths


SCALE = 576**-0.5


@pytest.mark.parametrize("h", [1, 16])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_fp8_ds_mla_through_b12x_equals_reference(fake_b12x, h, ragged, return_lse):
    for t in (3, 4, 1):  # bucket 4: created and primed by T=3, reused by T=4 and T=1
        q, cache, idx, lengths = make_case("fp8_ds_mla", t, h, 24, ragged=ragged, seed=t)
        out, lse = sparse_mla_forward(
            q, cache, idx, SCALE, kv_format="fp8_ds_mla", lengths=lengths, return_lse=return_lse
        )
        ref, ref_lse = sparse_mla_reference(
            q, cache, idx, SCALE, kv_format="fp8_ds_mla", lengths=lengths
        )
        assert torch.equal(out, ref)
        if return_lse:
            torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)
            assert torch.isneginf(lse[0]).all()
        assert (out[0] == 0).all()
    assert len(b12x_runner._plans) == 2  # buckets 4 and 1
    (key, state), *_ = b12x_runner._plans.items()
    assert (key.rows, key.page_size, key.topk) == (4, PAGE, 24)
    assert state.plan.prepared_rows == 4  # primed at full capacity


def test_bf16_cache_and_fp32_q_go_to_triton(fake_b12x, monkeypatch):
    calls = []

    def launch(args, kv_cache, indices, lengths, out, lse, scratch, scale, kv_format):
        calls.append(kv_format)
        ref, ref_lse = sparse_mla_reference(
            (args.q_nope, args.q_pe), kv_cache, indices, scale, kv_format=kv_format, lengths=lengths
        )
        out.copy_(ref)
        if lse is not None:
            lse.copy_(ref_lse)

    monkeypatch.setattr(kernels, "launch", launch)
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp8_ds_mla", torch.float32)):
        for h in (1, 16):
            q, cache, idx, lengths = make_case(fmt, 3, h, 24, ragged=True)
            q = (q[0].to(dtype), q[1].to(dtype))
            out, lse = sparse_mla_forward(
                q, cache, idx, SCALE, kv_format=fmt, lengths=lengths, return_lse=True
            )
            ref, ref_lse = sparse_mla_reference(
                q, cache, idx, SCALE, kv_format=fmt, lengths=lengths
            )
            assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert calls == ["bf16", "bf16", "fp8_ds_mla", "fp8_ds_mla"]
    assert b12x_runner._plans == {}


def test_install_is_a_noop_without_b12x(clean):
    clean.setitem(sys.modules, "b12x", None)  # find_spec -> None: not installed
    sentinel = object()
    dispatch.register_b12x_runner(sentinel)
    assert b12x_runner.install() is False
    assert dispatch._b12x_runner is sentinel


def test_importing_the_runner_imports_no_b12x():
    assert not any(name.split(".")[0] == "b12x" for name in sys.modules if sys.modules[name])


@pytest.mark.parametrize(("capability", "want"), [((12, 0), "b12x"), ((9, 0), "triton")])
def test_select_impl_with_the_fake_installed(clean, capability, want):
    for name, module in fake_b12x_modules().items():
        clean.setitem(sys.modules, name, module)
    clean.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    clean.setattr(dispatch, "TRITON_AVAILABLE", True)
    assert b12x_runner.install()
    assert dispatch.select_impl("cuda") == want


def _signature(fn) -> str:
    params = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(p.name)
    return "(" + ", ".join(params) + ")"


def test_fake_keeps_b12x_1_5_1_signatures():
    fakes = {"plan": fake_plan, "bind": fake_bind, "run": fake_run}
    fakes["is_supported"] = fake_is_supported
    assert {name: _signature(fn) for name, fn in fakes.items()} == B12X_SIGNATURES
    assert set(B12X_CAPS_FIELDS_USED) <= {f.name for f in dataclasses.fields(Caps)}
