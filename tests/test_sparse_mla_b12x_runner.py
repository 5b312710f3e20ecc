"""The b12x runner against a fake b12x 1.5.1 (CPU; the real kernels need SM120/121).

The fake ``b12x.attention.sparse_mla`` is generated from the surface the runner declares
(``b12x_runner.B12X_FUNCTIONS``/``B12X_CAPS_FIELDS``/``B12X_MODEL_TYPES``/
``B12X_PLAN_SCRATCH``; tests_vllm/test_b12x_signatures.py checks that declaration
against the installed b12x): every function takes exactly the declared parameters, all
required, and ``Caps`` exactly the declared fields, so the runner calling anything else
fails here. It keeps b12x's conventions: q ``[T,H,576]`` contiguous, 16-byte q loads
fixed by the priming q, ``selected_indices`` physical slots addressed page
``s // page_size`` at the cache's page stride, ``selected_lengths`` masking, base-2 lse
unless ``lse_scale="natural"``, output a view into the caller's scratch, launchers
resolved from the first binding. It computes with our ``sparse_mla_reference`` after
translating those conventions back, so a wrong mapping in the runner changes the
result or raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.machinery
import inspect
import math
import sys
import types

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_mla.ops.sparse_mla import b12x_runner, dispatch, sparse_mla_forward, sparse_mla_reference
from vllm_mla.ops.sparse_mla.formats import SparseMLANotPrepared, pack_rows

kernels = importlib.import_module("vllm_mla.ops.sparse_mla.triton_kernels")

LN2 = math.log(2.0)
GLM_NSA_RECORD = 656
# b12x's ModelType values (b12x/attention/_shared/mla/traits.py) for the members the
# runner declares; a newly declared member needs its value here.
MODEL_TYPE_VALUES = {"DSV4": 0, "GLM_NSA": 1, "GLM_NEXT": 2, "DSV41": 3}


# -- allocation guard ----------------------------------------------------------------------
class AllocationGuard(TorchDispatchMode):
    """Records every op that returns a tensor on storage none of its inputs has."""

    active: AllocationGuard | None = None

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[str] = []
        self.paused = 0

    def __enter__(self):
        AllocationGuard.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        AllocationGuard.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.paused:
            leaves = pytree.tree_leaves((args, kwargs))
            owned = {x.untyped_storage().data_ptr() for x in leaves if isinstance(x, torch.Tensor)}
            for x in pytree.tree_leaves(result):
                if (
                    isinstance(x, torch.Tensor)
                    and x.numel()
                    and x.untyped_storage().data_ptr() not in owned
                ):
                    self.allocated.append(str(func))
        return result


@contextlib.contextmanager
def unguarded():
    """The fake's own computation (b12x's kernels) is not the runner's allocation."""
    guard = AllocationGuard.active
    if guard is not None:
        guard.paused += 1
    try:
        yield
    finally:
        if guard is not None:
            guard.paused -= 1


# -- the fake b12x, generated from the runner's declared surface ----------------------------
def _caps_post_init(self) -> None:
    # b12x infers GLM_NSA (656-byte ARBITRARY_FP32 record) from head_dim 576.
    if self.model_type != MODEL_TYPE_VALUES["GLM_NSA"] or self.head_dim != 576:
        raise ValueError(f"fake b12x serves GLM_NSA only, got {self.model_type}")
    if self.cache_record_bytes != GLM_NSA_RECORD:
        raise ValueError("sparse MLA cache_record_bytes does not match its planned recipe")
    if (self.dtype, self.kv_dtype, self.v_head_dim) != (torch.bfloat16, torch.uint8, 512):
        raise ValueError("fake b12x: bf16 q, uint8 cache, v_head_dim 512")
    if not (math.isfinite(self.softmax_scale) and self.softmax_scale > 0):
        raise ValueError("softmax_scale must be finite and positive")
    if self.lse_scale not in ("base2", "natural"):
        raise ValueError("lse_scale must be 'base2' or 'natural'")


Caps = dataclasses.make_dataclass(
    "Caps",
    list(b12x_runner.B12X_CAPS_FIELDS),  # exactly the declared fields, all required
    frozen=True,
    kw_only=True,
    namespace={"__post_init__": _caps_post_init},
)
ModelType = type(
    "ModelType", (), {name: MODEL_TYPE_VALUES[name] for name in b12x_runner.B12X_MODEL_TYPES}
)


def caps_layout(caps) -> tuple[int, int]:
    out_bytes = caps.max_q_rows * caps.num_q_heads * caps.v_head_dim * 2
    return out_bytes, out_bytes + caps.max_q_rows * caps.num_q_heads * 4


class FakePlan:
    def __init__(self, caps) -> None:
        self.caps = caps
        self.prepared_rows: int | None = None
        self.prepared_topk: int | None = None
        self.vector_q: bool | None = None


_METHOD, _FIELD = b12x_runner.B12X_PLAN_SCRATCH
setattr(
    FakePlan,
    _METHOD,
    lambda self: types.SimpleNamespace(**{_FIELD: caps_layout(self.caps)[1]}),
)


def _plan(caps):
    assert isinstance(caps, Caps)
    return FakePlan(caps)


def _bind(plan, scratch, q, kv_cache, selected_indices, cache_lengths, selected_lengths):
    caps = plan.caps
    assert q.ndim == 3 and q.dtype == caps.dtype and q.is_contiguous(), "q"
    assert q.shape[0] <= caps.max_q_rows and q.shape[1:] == (caps.num_q_heads, 576), "q"
    rows = q.shape[0]
    assert selected_indices.dtype == torch.int32 and selected_indices.is_contiguous()
    assert selected_indices.shape == (rows, caps.max_width)  # GLM: exactly the planned K
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
    assert scratch.numel() >= caps_layout(caps)[1]
    binding = types.SimpleNamespace(
        plan=plan,
        scratch=scratch,
        q=q,
        kv_cache=kv_cache,
        selected_indices=selected_indices,
        selected_lengths=selected_lengths,
    )
    sys.modules[b12x_runner.B12X_MODULE].binds.append(binding)
    return binding


def _gather_records(kv_cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """b12x addressing (kernel.py _cache_base_tensor/_cache_block_stride_bytes, GLM)."""
    if kv_cache.is_contiguous():
        base, page_stride = kv_cache.reshape(-1), page_size * GLM_NSA_RECORD
    else:
        span = 1 + sum((n - 1) * s for n, s in zip(kv_cache.shape, kv_cache.stride(), strict=True))
        base, page_stride = torch.as_strided(kv_cache, (span,), (1,)), kv_cache.stride(0)
    start = (slots // page_size) * page_stride + (slots % page_size) * GLM_NSA_RECORD
    return base[start[:, None] + torch.arange(GLM_NSA_RECORD)]


def _run(binding):
    plan, caps = binding.plan, binding.plan.caps
    q, sel, lens = binding.q, binding.selected_indices, binding.selected_lengths
    rows, width = sel.shape
    # Launchers resolve from the first binding; later ones must fit it (kernel.py), and
    # its q alignment fixes 16-byte q loads (kernel.py vector_q), never rechecked.
    if plan.prepared_rows is None:
        plan.prepared_rows, plan.prepared_topk = rows, width
        plan.vector_q = q.data_ptr() % 16 == 0
    if rows > plan.prepared_rows or width != plan.prepared_topk:
        raise ValueError("runtime unified decode metadata differs from its prepared launch")
    if plan.vector_q and q.data_ptr() % 16:
        raise ValueError("misaligned q for a launch prepared with 16-byte q loads")
    with unguarded():
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
    out_bytes, end = caps_layout(caps)
    shape = (caps.max_q_rows, caps.num_q_heads)
    output = binding.scratch[:out_bytes].view(torch.bfloat16).view(*shape, 512)[:rows]
    output.copy_(out_ref)
    if not caps.return_lse:
        return output
    lse = binding.scratch[out_bytes:end].view(torch.float32).view(shape)[:rows]
    lse.copy_(lse_ref if caps.lse_scale == "natural" else lse_ref / LN2)
    return output, lse


def _is_supported(device):
    return True


FAKE_IMPLS = {"plan": _plan, "bind": _bind, "run": _run, "is_supported": _is_supported}


def declared_function(name: str):
    """b12x function ``name`` taking exactly its declared parameters (all required)."""
    positional, keywords = b12x_runner.B12X_FUNCTIONS[name]
    signature = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in positional]
        + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in keywords]
    )
    impl = FAKE_IMPLS[name]

    def fn(*args, **kwargs):
        return impl(**signature.bind(*args, **kwargs).arguments)  # TypeError if undeclared

    fn.__name__ = fn.__qualname__ = name
    fn.__signature__ = signature
    return fn


def fake_b12x_modules() -> dict[str, types.ModuleType]:
    mods = {}
    for name in ("b12x", "b12x.attention", "b12x.attention.sparse_mla"):
        mods[name] = types.ModuleType(name)
        mods[name].__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    api = mods[b12x_runner.B12X_MODULE]
    api.ModelType, api.Caps, api.binds = ModelType, Caps, []
    for name in b12x_runner.B12X_FUNCTIONS:
        setattr(api, name, declared_function(name))
    mods["b12x"].attention = mods["b12x.attention"]
    mods["b12x.attention"].sparse_mla = api
    return mods


@pytest.fixture
def clean(monkeypatch):
    """Runner unregistered, b12x probe uncached, no plans, no freeze; restored afterwards."""
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
    # resolve insists on a CUDA SM120 device; the fake runs the same path on CPU.
    clean.setattr(dispatch, "resolve", lambda impl, device: "b12x")
    return sys.modules[b12x_runner.B12X_MODULE]


# -- cases -------------------------------------------------------------------------------
PAGE = 16
SCALE = 576**-0.5
K = 24


def make_case(kv_format, t, h, k, *, ragged, seed=0, fused=True):
    """Interleaved (strided) cache pages, split q (halves of one tensor when ``fused``,
    else two tensors), -1 padding, ragged lengths."""
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
    halves = (q[..., :512], q[..., 512:])
    if not fused:
        halves = (halves[0].clone(), halves[1].clone())
    return halves, cache, idx, lengths


def forward_and_check(t, *, h=2, ragged=False, return_lse=True, seed=None, **case):
    q, cache, idx, lengths = make_case("fp8_ds_mla", t, h, K, ragged=ragged, seed=seed or t, **case)
    return check(q, cache, idx, lengths, return_lse=return_lse)


def check(q, cache, idx, lengths, *, return_lse=True):
    out, lse = sparse_mla_forward(
        q, cache, idx, SCALE, kv_format="fp8_ds_mla", lengths=lengths, return_lse=return_lse
    )
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, SCALE, kv_format="fp8_ds_mla", lengths=lengths
    )
    # The fake runs sparse_mla_reference on the same rows, bf16 q upcast to the same
    # contiguous fp32 operands, natural-log lse copied: the same ops, so bit-exact.
    assert torch.equal(out, ref)
    if return_lse:
        assert torch.equal(lse, ref_lse)
    return out, lse


def plan_of(t, h=2):
    (state,) = [s for key, s in b12x_runner._plans.items() if (key.rows, key.num_heads) == (t, h)]
    return state


# -- results -----------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("h", [1, 16])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_fp8_ds_mla_through_b12x_equals_reference(fake_b12x, h, ragged, return_lse, fused):
    for t in (3, 4, 1, 3):  # one plan per exact token count, reused by the second T=3
        q, cache, idx, lengths = make_case(
            "fp8_ds_mla", t, h, K, ragged=ragged, seed=t, fused=fused
        )
        out, lse = check(q, cache, idx, lengths, return_lse=return_lse)
        if return_lse:
            assert torch.isneginf(lse[0]).all()
        assert (out[0] == 0).all()
    assert sorted(key.rows for key in b12x_runner._plans) == [1, 3, 4]
    (key, state), *_ = b12x_runner._plans.items()
    assert (key.rows, key.page_size, key.topk) == (3, PAGE, K)
    for key, state in b12x_runner._plans.items():
        assert state.plan.prepared_rows == key.rows  # primed at full capacity


def test_bf16_cache_and_fp32_q_go_to_triton(fake_b12x, monkeypatch):
    calls = []

    class Site:  # the Triton launch site dispatch.run falls back to, run as the reference
        def __init__(self, kv_cache, heads, topk, kv_format, scale, q_dtype, rope=64):
            self.kv_format, self.scale = kv_format, scale

        def launch(self, q_nope, q_pe, kv_cache, indices, out, scratch, lengths, lse, *rest, **kw):
            calls.append(self.kv_format)
            ref, ref_lse = sparse_mla_reference(
                (q_nope, q_pe),
                kv_cache,
                indices,
                self.scale,
                kv_format=self.kv_format,
                lengths=lengths,
            )
            out.copy_(ref)
            if lse is not None:
                lse.copy_(ref_lse)
            return False

    monkeypatch.setattr(kernels, "site_for", Site)
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp8_ds_mla", torch.float32)):
        for h in (1, 16):
            q, cache, idx, lengths = make_case(fmt, 3, h, K, ragged=True)
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


def test_an_invalid_counter_is_not_served_by_b12x(fake_b12x):
    (q_nope, q_pe), cache, idx, _ = make_case("fp8_ds_mla", 3, 2, K, ragged=False)
    out = torch.full((3, 2, 512), 7.0, dtype=torch.bfloat16)
    invalid = torch.zeros(1, dtype=torch.int32)
    served = b12x_runner.run_b12x(
        q_nope, q_pe, cache, idx, None, out, None, None,
        softmax_scale=SCALE, kv_format="fp8_ds_mla", invalid=invalid,
    )  # fmt: skip
    assert served is False and (out == 7).all() and b12x_runner._plans == {}


# -- copies: only where b12x needs its own contiguous buffer ------------------------------
def test_a_fused_aligned_q_is_passed_without_a_copy(fake_b12x):
    q, cache, idx, _ = make_case("fp8_ds_mla", 3, 2, K, ragged=False, fused=True)
    check(q, cache, idx, None)
    bound = fake_b12x.binds[-1].q
    assert bound.data_ptr() == q[0].data_ptr() and bound.shape == (3, 2, 576)
    assert plan_of(3).q.data_ptr() != bound.data_ptr()


def test_split_or_misaligned_q_is_copied_into_the_plan(fake_b12x):
    q, cache, idx, _ = make_case("fp8_ds_mla", 3, 2, K, ragged=False, fused=False)
    check(q, cache, idx, None)
    assert fake_b12x.binds[-1].q.data_ptr() == plan_of(3).q.data_ptr()
    # halves of one tensor, but 2 bytes off 16-byte alignment: a copy (the plan was
    # primed with 16-byte q loads; the fake raises on a misaligned q)
    storage = torch.randn(3 * 2 * 576 + 1).to(torch.bfloat16)
    full = storage[1:].view(3, 2, 576)
    assert full.data_ptr() % 16
    check((full[..., :512], full[..., 512:]), cache, idx, None)
    assert fake_b12x.binds[-1].q.data_ptr() == plan_of(3).q.data_ptr()


def test_out_of_pool_indices_reach_b12x_as_empty_slots(fake_b12x):
    """INDEX_RULE: an index >= the cache's rows is an empty slot; b12x does not bound-check
    the top, so the runner masks it (the fake b12x reads any index it is given)."""
    q, cache, idx, _ = make_case("fp8_ds_mla", 3, 2, K, ragged=False)
    rows = cache.shape[0] * cache.shape[1]
    bad = idx.clone()
    bad[0, :3] = torch.tensor([rows, rows + 5, 2**30], dtype=torch.int32)
    out, _ = sparse_mla_forward(q, cache, bad, SCALE, kv_format="fp8_ds_mla")
    bound = fake_b12x.binds[-1].selected_indices
    assert int(bound.max()) < rows and (bound[0, :3] == -1).all()
    assert torch.equal(bound[1:], idx[1:])  # the rest untouched
    emptied = bad.clone()
    emptied[0, :3] = -1
    ref, _ = sparse_mla_reference(q, cache, emptied, SCALE, kv_format="fp8_ds_mla")
    assert torch.equal(out, ref)
    assert int(bad[0, 0]) == rows  # the caller's tensor is not modified


def test_indices_and_non_contiguous_lengths_are_copied_into_the_plan(fake_b12x):
    q, cache, idx, lengths = make_case("fp8_ds_mla", 3, 2, K, ragged=True)
    wide = torch.full((3, K + 8), -1, dtype=torch.int32)
    wide[:, :K] = idx
    spaced = torch.zeros(6, dtype=torch.int32)
    spaced[::2] = lengths
    assert not wide[:, :K].is_contiguous() and not spaced[::2].is_contiguous()
    check(q, cache, wide[:, :K], spaced[::2])
    state, bound = plan_of(3), fake_b12x.binds[-1]
    assert bound.selected_indices.data_ptr() == state.indices.data_ptr()
    assert bound.selected_lengths.data_ptr() == state.lengths.data_ptr()
    check(q, cache, idx, lengths)  # contiguous lengths are passed as they are
    bound = fake_b12x.binds[-1]
    assert bound.selected_indices.data_ptr() == state.indices.data_ptr()  # always masked
    assert bound.selected_lengths.data_ptr() == lengths.data_ptr()


def test_all_k_lengths_are_rewritten_on_every_call(fake_b12x):
    """lengths=None: the plan's vector is filled with K by each call that uses it, so
    garbage there (vLLM sleep level 2 discards it; another call's lengths) is harmless."""
    q, cache, idx, lengths = make_case("fp8_ds_mla", 3, 2, K, ragged=True)
    first, _ = check(q, cache, idx, None)
    state = plan_of(3)
    assert (state.lengths == K).all()
    state.lengths.fill_(-7)  # what a discarded-and-remapped buffer may hold
    again, _ = check(q, cache, idx, None)
    assert torch.equal(again, first) and (state.lengths == K).all()
    spaced = torch.zeros(6, dtype=torch.int32)
    spaced[::2] = lengths
    check(q, cache, idx, spaced[::2])  # copied into the same vector
    assert torch.equal(state.lengths, lengths)
    assert torch.equal(check(q, cache, idx, None)[0], first)


# -- plans: exact sizes before freeze; rounding, refusal after it and during capture -------
def test_plans_are_exact_token_counts_before_freeze(fake_b12x):
    for t in (5, 3, 8, 3):
        forward_and_check(t)
    assert sorted(key.rows for key in b12x_runner._plans) == [3, 5, 8]
    assert {state.key.rows for state in b12x_runner._plans.values()} == {3, 5, 8}


def test_after_freeze_a_token_count_is_served_by_the_smallest_planned_size(fake_b12x, monkeypatch):
    for t in (1, 3, 8):
        forward_and_check(t)
    b12x_runner.freeze()
    planned = dict(b12x_runner._plans)
    monkeypatch.setattr(b12x_runner, "_new_plan", lambda *a: pytest.fail("planned after freeze"))
    for t, served_by in ((2, 3), (3, 3), (4, 8), (7, 8), (1, 1), (8, 8)):
        forward_and_check(t, ragged=t % 2 == 0, seed=10 + t)
        bound = fake_b12x.binds[-1]
        assert bound.plan is planned[dataclasses.replace(next(iter(planned)), rows=served_by)].plan
        assert bound.q.shape[0] == bound.selected_indices.shape[0] == t  # rows beyond T unused
    assert b12x_runner._plans == planned


def test_after_freeze_a_token_count_above_every_plan_raises(fake_b12x):
    for t in (1, 4):
        forward_and_check(t)
    b12x_runner.freeze()
    with pytest.raises(SparseMLANotPrepared, match=r"T=5 after freeze.*planned: \(1, 4\)"):
        forward_and_check(5)
    with pytest.raises(SparseMLANotPrepared, match="no planned size"):
        forward_and_check(2, h=4)  # another head count: nothing planned for that key
    assert sorted(key.rows for key in b12x_runner._plans) == [1, 4]


def test_capture_serves_only_exactly_planned_token_counts(fake_b12x, monkeypatch):
    forward_and_check(4)
    monkeypatch.setattr(b12x_runner, "capturing", lambda device: True)
    forward_and_check(4)  # planned exactly: served during capture
    for frozen in (False, True):
        if frozen:
            b12x_runner.freeze()
        with pytest.raises(SparseMLANotPrepared, match="T=3 during CUDA-graph capture"):
            forward_and_check(3)  # a larger plan exists, but capture never rounds
        with pytest.raises(SparseMLANotPrepared, match="T=6 during CUDA-graph capture"):
            forward_and_check(6)  # nor plans
    assert [key.rows for key in b12x_runner._plans] == [4]


def test_freeze_is_per_device_and_reset_lifts_it(fake_b12x):
    b12x_runner.freeze("cuda")  # every CUDA device, not the CPU
    assert b12x_runner.is_frozen(torch.device("cuda", 1))
    assert not b12x_runner.is_frozen(torch.device("cpu"))
    forward_and_check(3)  # the CPU still plans
    b12x_runner.freeze(torch.device("cuda", 0))
    b12x_runner.reset()
    b12x_runner.freeze(torch.device("cuda", 0))
    assert not b12x_runner.is_frozen(torch.device("cuda", 1))
    b12x_runner.freeze(torch.device("cpu"))
    with pytest.raises(SparseMLANotPrepared):
        forward_and_check(3)
    b12x_runner.reset()  # drops plans and freeze
    forward_and_check(3)
    b12x_runner.freeze()  # None: every device
    assert b12x_runner.is_frozen(torch.device("cuda", 3))
    with pytest.raises(SparseMLANotPrepared):
        forward_and_check(4)


def test_a_preparation_session_freeze_freezes_the_runner_on_its_device(fake_b12x):
    from vllm_mla.ops.sparse_mla import PreparationSession

    assert not b12x_runner.is_frozen(torch.device("cpu"))
    PreparationSession("cpu").freeze()
    assert b12x_runner.is_frozen(torch.device("cpu"))
    assert not b12x_runner.is_frozen(torch.device("cuda", 0))


def test_nothing_is_allocated_after_freeze(fake_b12x):
    for t in (4, 8):
        forward_and_check(t)
    b12x_runner.freeze()

    def call(t, *, fused=True, spaced=False, wide=False, lengths=True):
        q, cache, idx, lens = make_case("fp8_ds_mla", t, 2, K, ragged=lengths, fused=fused)
        if wide:
            buf = torch.full((t, K + 8), -1, dtype=torch.int32)
            buf[:, :K] = idx
            idx = buf[:, :K]
        if spaced:
            buf = torch.zeros(2 * t, dtype=torch.int32)
            buf[::2] = lens
            lens = buf[::2]
        out = torch.empty(t, 2, 512, dtype=torch.bfloat16)
        lse = torch.empty(t, 2)
        with AllocationGuard() as guard:
            assert b12x_runner.run_b12x(
                *q, cache, idx, lens, out, lse, None, softmax_scale=SCALE, kv_format="fp8_ds_mla"
            )
        ref, ref_lse = sparse_mla_reference(
            q, cache, idx, SCALE, kv_format="fp8_ds_mla", lengths=lens
        )
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)  # as in check()
        return guard.allocated

    assert call(4, lengths=False) == []
    assert call(3, fused=False, spaced=True, wide=True) == []  # copies, into the plan
    assert call(6, lengths=False, wide=True) == []  # served by the T=8 plan
    b12x_runner.reset()  # the guard sees a plan's allocations (so it would see any)
    assert call(2)


# -- the declared b12x surface -------------------------------------------------------------
def test_the_fake_has_exactly_the_declared_surface(fake_b12x):
    for name, (positional, keywords) in b12x_runner.B12X_FUNCTIONS.items():
        params = inspect.signature(getattr(fake_b12x, name)).parameters.values()
        assert [p.name for p in params] == [*positional, *keywords]
    assert tuple(f.name for f in dataclasses.fields(Caps)) == b12x_runner.B12X_CAPS_FIELDS
    members = tuple(name for name in vars(ModelType) if not name.startswith("_"))
    assert members == b12x_runner.B12X_MODEL_TYPES == ("GLM_NSA",)


def test_the_runner_builds_caps_from_exactly_the_declared_fields(fake_b12x):
    key = b12x_runner.PlanKey(torch.device("cpu"), "fp8_ds_mla", 2, K, 3, PAGE, SCALE, True)
    fields = b12x_runner.caps_fields(fake_b12x, key)
    assert tuple(fields) == b12x_runner.B12X_CAPS_FIELDS
    assert fields["model_type"] == ModelType.GLM_NSA and fields["max_q_rows"] == 3
    with pytest.raises(TypeError):  # the fake's functions take nothing undeclared
        fake_b12x.bind(None, scratch=None, attention_sink=None)


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
