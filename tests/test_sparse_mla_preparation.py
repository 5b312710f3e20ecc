"""Preparation ownership: plan allocates nothing, probes die, freeze, bind, run, release.

The kernel is a small torch stand-in with the kernel module's API (the real module is
``vllm_mla.ops.sparse_mla``); ownership, not arithmetic, is under test here.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from vllm_mla.memory import AllocationTrace
from vllm_mla.ops.sparse_mla import (
    HEAD_DIM,
    LATENT,
    PlanReleased,
    PreparationFrozen,
    PreparationSession,
    ProbeRetained,
    SparseMLACaps,
    SparseMLANotPrepared,
    plan,
)


def reference(q, kv_cache, indices, scale, *, kv_format, lengths=None, return_lse=False):
    """Plain-torch sparse MLA over physical rows (-1 empty); bf16 or fp8_ds_mla cache."""
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    block = kv_cache.shape[1]
    rows = indices.long().clamp(min=0)
    rec = kv_cache[rows // block, rows % block]
    if kv_format == "bf16":
        kv = rec.float()
    else:
        e4m3 = rec[..., :512].contiguous().view(torch.float8_e4m3fn).float()
        scales = rec[..., 512:528].contiguous().view(torch.float32)
        kv_c = (e4m3.unflatten(-1, (4, 128)) * scales[..., None]).flatten(-2)
        kv = torch.cat([kv_c, rec[..., 528:].contiguous().view(torch.bfloat16).float()], -1)
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * scale
    mask = indices < 0
    if lengths is not None:
        mask |= torch.arange(indices.shape[1]) >= lengths[:, None]
    scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    out = torch.einsum("thk,tkd->thd", probs, kv[..., :LATENT]).to(q.dtype)
    return out, (lse if return_lse else None)


class StandIn:
    """The kernel module's API over ``reference``; records launches; may stash inputs."""

    def __init__(self, stash: bool = False) -> None:
        self.launches: list[int] = []
        self.stash = stash
        self.kept: list[torch.Tensor] = []

    @staticmethod
    def select_impl(device):
        return "standin"  # an implementation that compiles (probes are launched)

    @staticmethod
    def scratch_bytes(num_tokens, num_heads, topk, *, kv_format):
        return num_tokens * num_heads * (LATENT * 2 + 4)

    def sparse_mla_forward(
        self,
        q,
        kv_cache,
        indices,
        softmax_scale,
        *,
        kv_format,
        lengths=None,
        out=None,
        scratch=None,
        return_lse=False,
        impl="auto",
        sink=None,
    ):
        assert sink is None  # sink plans run the real kernel (tests/test_sparse_mla_sink.py)
        self.launches.append(indices.shape[0])
        if self.stash:  # the defect the session must catch: a cache keeping its inputs
            self.kept.append(q[0] if isinstance(q, tuple) else q)
        result, lse = reference(
            q,
            kv_cache,
            indices,
            softmax_scale,
            kv_format=kv_format,
            lengths=lengths,
            return_lse=return_lse,
        )
        if out is not None:
            out.copy_(result)
            result = out
        return result, lse


CAPS = SparseMLACaps(max_tokens=6, num_heads=3, topk=8, kv_format="bf16", split_query=True)


def cache(blocks: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, 64, HEAD_DIM, generator=gen).bfloat16()


def query(tokens: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(tokens, CAPS.num_heads, HEAD_DIM, generator=gen).bfloat16()
    return full[..., :LATENT], full[..., LATENT:]


def indices(tokens: int, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 128, (tokens, CAPS.topk), generator=gen, dtype=torch.int32)


def tensors_in(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable through dataclass fields, tuples and lists."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def test_caps_buckets_and_typed_errors():
    assert CAPS.buckets() == (1, 2, 4, 6) and CAPS.bucket(3) == 4 and CAPS.bucket(6) == 6
    with pytest.raises(ValueError, match="exceed"):
        CAPS.bucket(7)
    with pytest.raises(ValueError, match="expected a multiple of 64, got 32"):
        SparseMLACaps(4, 2, 8, block_size=32)
    with pytest.raises(ValueError, match="expected one of"):
        SparseMLACaps(4, 2, 8, kv_format="fp8")
    with pytest.raises(TypeError, match="the op's"):  # the op takes bf16 and fp32 queries
        SparseMLACaps(4, 2, 8, q_dtype=torch.float16)
    assert SparseMLACaps(4, 2, 8, q_dtype=torch.float32).q_dtype == torch.float32  # CPU models


def test_plan_allocates_nothing_and_holds_no_tensor():
    with AllocationTrace("cpu") as trace:
        p = plan(CAPS, kernel=StandIn())
    assert trace.allocations() == []
    assert tensors_in(p) == []
    assert p.scratch_bytes == StandIn.scratch_bytes(6, 3, 8, kv_format="bf16")
    assert len(p.variants) == len(CAPS.buckets())


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_prepare_frees_every_probe(kv_format):
    seen: list[weakref.ref] = []
    kernel = StandIn()
    session = PreparationSession(
        kernel=kernel, probe_observer=lambda n, t: seen.append(weakref.ref(t))
    )
    caps = dataclasses.replace(CAPS, kv_format=kv_format, with_lengths=True)
    p = session.plan(caps)
    with AllocationTrace("cpu") as trace:
        session.prepare(p)
    assert kernel.launches == list(caps.buckets())
    assert len(seen) == 5 * len(caps.buckets())  # q, kv_cache, indices, scratch, lengths
    assert all(ref() is None for ref in seen)
    assert trace.persistent_bytes() == 0  # the allocator agrees: nothing outlived prepare
    assert tensors_in(p) == [] and all(session.is_prepared(p, t) for t in caps.buckets())


def test_control_a_retained_probe_is_caught():
    seen: list[weakref.ref] = []
    kernel = StandIn(stash=True)
    session = PreparationSession(
        kernel=kernel, probe_observer=lambda n, t: seen.append(weakref.ref(t))
    )
    with pytest.raises(ProbeRetained, match=r"q\[T=1\]"):
        session.prepare(session.plan(CAPS))
    assert any(ref() is not None for ref in seen)  # the weakref check sees it too
    kernel.kept.clear()
    gc.collect()
    assert all(ref() is None for ref in seen)


def test_freeze_turns_an_unprepared_variant_into_an_error():
    session = PreparationSession(kernel=StandIn())
    prepared_plan, skipped_plan = session.plan(CAPS), session.plan(CAPS)
    session.prepare(prepared_plan)  # the second launch site was never prepared
    kv = cache()
    unprepared = session.bind(
        skipped_plan, scratch=None, q=query(1), kv_cache=kv, indices=indices(1)
    )
    prepared = session.bind(
        prepared_plan, scratch=None, q=query(1), kv_cache=kv, indices=indices(1)
    )
    session.run(unprepared)  # control: before freeze a new variant may still compile
    session.freeze()
    session.run(prepared)
    with pytest.raises(SparseMLANotPrepared, match="not prepared"):
        session.run(unprepared)
    with pytest.raises(PreparationFrozen):
        session.prepare(skipped_plan)


def test_binding_holds_only_caller_inputs_and_replays_with_changed_inputs():
    kernel = StandIn()
    session = PreparationSession(kernel=kernel)
    p = session.plan(CAPS)
    session.prepare(p)
    session.freeze()
    kv, q, scratch = cache(), query(4), torch.empty(p.scratch_bytes, dtype=torch.uint8)
    out = torch.empty(4, CAPS.num_heads, LATENT, dtype=torch.bfloat16)
    for seed in (2, 3):  # same binding shape, changed live indices (graph replay on GPU)
        idx = indices(4, seed)
        b = session.bind(p, scratch=scratch, q=q, kv_cache=kv, indices=idx, out=out)
        assert {id(t) for t in tensors_in(b)} == {id(x) for x in (*q, kv, idx, scratch, out)}
        result, lse = session.run(b)
        expected, _ = reference(q, kv, idx, HEAD_DIM**-0.5, kv_format="bf16")
        assert result is out and torch.equal(result, expected)
        assert lse is None


def test_bind_rejects_inputs_outside_the_plan():
    session = PreparationSession(kernel=StandIn())
    p = session.plan(CAPS)
    kv = cache()
    with pytest.raises(ValueError, match=r"expected at most 6 tokens, got 7"):
        session.bind(p, scratch=None, q=query(7), kv_cache=kv, indices=indices(7))
    with pytest.raises(ValueError, match=r"indices: expected int32 \[2, 8\]"):
        session.bind(p, scratch=None, q=query(2), kv_cache=kv, indices=indices(2).long())
    with pytest.raises(ValueError, match=r"kv_cache: expected torch\.bfloat16"):
        session.bind(p, scratch=None, q=query(2), kv_cache=kv.float(), indices=indices(2))
    with pytest.raises(TypeError, match="tuple"):
        session.bind(p, scratch=None, q=torch.cat(query(2), -1), kv_cache=kv, indices=indices(2))
    with pytest.raises(ValueError, match="scratch: expected at least"):
        session.bind(
            p,
            scratch=torch.empty(1, dtype=torch.uint8),
            q=query(2),
            kv_cache=kv,
            indices=indices(2),
        )


def test_release_invalidates_bindings_and_the_plan():
    session = PreparationSession(kernel=StandIn())
    p = session.plan(CAPS)
    session.prepare(p)
    binding = session.bind(p, scratch=None, q=query(1), kv_cache=cache(), indices=indices(1))
    session.run(binding)  # control: served before release
    session.release(p)
    with pytest.raises(PlanReleased):
        session.run(binding)
    with pytest.raises(PlanReleased):
        session.bind(p, scratch=None, q=query(1), kv_cache=cache(), indices=indices(1))


def test_a_compile_after_freeze_seen_by_the_kernels_tracking_raises():
    class Tracking(StandIn):
        """Compiles (records a variant) per distinct q stride, like Triton's specialisation."""

        def __init__(self):
            super().__init__()
            self.variants = set()

        def compiled_variants(self):
            return frozenset(self.variants)

        def sparse_mla_forward(self, q, *args, **kwargs):
            self.variants.add((q[0].stride(0) % 16 == 0,))
            return super().sparse_mla_forward(q, *args, **kwargs)

    session = PreparationSession(kernel=Tracking())
    p = session.plan(CAPS)
    session.prepare(p)
    session.freeze()
    kv = cache()
    q_nope, q_pe = query(2)
    session.run(
        session.bind(p, scratch=None, q=(q_nope, q_pe), kv_cache=kv, indices=indices(2))
    )  # control: same specialisation
    odd = torch.empty(2, CAPS.num_heads, 577, dtype=torch.bfloat16)[..., :HEAD_DIM]
    odd.copy_(torch.cat([q_nope, q_pe], -1))  # row stride 3*577: not a multiple of 16
    with pytest.raises(SparseMLANotPrepared, match="1 new variant"):
        session.run(
            session.bind(
                p,
                scratch=None,
                q=(odd[..., :LATENT], odd[..., LATENT:]),
                kv_cache=kv,
                indices=indices(2),
            )
        )


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_with_the_real_kernel_module(impl):
    sparse_mla = pytest.importorskip("vllm_mla.ops.sparse_mla")
    if impl == "triton" and not (
        torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1"
    ):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    caps = SparseMLACaps(max_tokens=2, num_heads=2, topk=64, kv_format="fp8_ds_mla")
    seen: list[weakref.ref] = []
    session = PreparationSession(probe_observer=lambda n, t: seen.append(weakref.ref(t)))
    p = session.plan(caps, impl=impl)
    before = sparse_mla.compiled_variants()
    session.prepare(p)
    assert all(ref() is None for ref in seen)
    assert bool(seen) == (impl == "triton")  # plain torch has nothing to compile
    if impl == "triton":
        assert sparse_mla.compiled_variants() > before  # preparation compiled
    session.freeze()
    gen = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(128, 512, generator=gen), torch.randn(128, 64, generator=gen)
    kv = sparse_mla.pack_fp8_ds_mla(kv_c, k_pe).view(2, 64, 656)
    for seed in (1, 2):  # changed live inputs after the probes are gone
        full = torch.randn(2, 2, HEAD_DIM, generator=gen).bfloat16()
        q = (full[..., :LATENT], full[..., LATENT:])
        idx = torch.randint(-1, 128, (2, 64), generator=gen, dtype=torch.int32)
        out, _ = session.run(
            session.bind(
                p,
                scratch=torch.empty(p.scratch_bytes, dtype=torch.uint8),
                q=q,
                kv_cache=kv,
                indices=idx,
            )
        )
        ref, _ = sparse_mla.sparse_mla_reference(q, kv, idx, HEAD_DIM**-0.5, kv_format="fp8_ds_mla")
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < sparse_mla.OUT_REL_ERR, (seed, err)


def test_reference_impl_is_prepared_without_probes():
    class Reference(StandIn):
        select_impl = staticmethod(lambda device: "reference")

    kernel = Reference()
    session = PreparationSession(kernel=kernel)
    p = session.plan(CAPS)
    session.prepare(p)
    session.freeze()
    assert kernel.launches == []  # nothing to compile: no probe was launched
    session.run(session.bind(p, scratch=None, q=query(3), kv_cache=cache(), indices=indices(3)))


def test_not_prepared_is_one_error_family():
    from vllm_mla.ops import sparse_mla
    from vllm_mla.ops.sparse_mla import preparation

    assert issubclass(preparation.SparseMLANotPrepared, sparse_mla.SparseMLANotPrepared)
