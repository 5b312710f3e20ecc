"""The b12x surface ``b12x_runner`` declares, checked against the INSTALLED b12x (on CPU:
b12x imports and plans without a GPU; no kernel runs).

``b12x_runner.B12X_FUNCTIONS``/``B12X_CAPS_FIELDS``/``B12X_MODEL_TYPES``/
``B12X_PLAN_SCRATCH`` are what the runner calls (tests/test_sparse_mla_b12x_runner.py
builds its fake b12x from them, so the runner cannot call anything else); here each
name must exist in b12x with a compatible signature, and every parameter b12x requires
must be one the runner passes. A rename on either side fails this file.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import types

import pytest
import torch

from vllm_mla.ops.sparse_mla import b12x_runner
from vllm_mla.ops.sparse_mla.formats import record_bytes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("b12x") is None, reason="b12x is not installed"
)
P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
KEYWORD = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)


@pytest.fixture(scope="module")
def b12x() -> types.ModuleType:
    return importlib.import_module(b12x_runner.B12X_MODULE)


def test_the_b12x_checked_here_is_the_declared_release_or_flashinfers_copy():
    """``scripts/setup.sh`` installs the release the runner declares into the vLLM 0.34
    environment. FlashInfer (0.7.x, a vLLM dependency) also embeds b12x
    (``flashinfer/experimental/b12x``) and aliases it as ``b12x`` where no b12x release is
    installed, as in the vLLM 0.33 environment: that copy has no release version, and the
    signatures below are checked against it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("b12x")
    except PackageNotFoundError:
        module = importlib.import_module(b12x_runner.B12X_MODULE)
        assert "/flashinfer/experimental/b12x/" in module.__file__.replace("\\", "/")
        return
    assert installed == b12x_runner.B12X_VERSION


@pytest.mark.parametrize("name", sorted(b12x_runner.B12X_FUNCTIONS))
def test_each_called_function_takes_the_declared_parameters(b12x, name):
    positional, keywords = b12x_runner.B12X_FUNCTIONS[name]
    params = inspect.signature(getattr(b12x, name)).parameters
    lead = list(params.values())[: len(positional)]
    assert [p.name for p in lead] == list(positional)
    assert all(p.kind in POSITIONAL for p in lead), name
    for keyword in keywords:
        assert keyword in params and params[keyword].kind in KEYWORD, (name, keyword)
    required = {
        n
        for n, p in params.items()
        if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
    }
    assert required <= {*positional, *keywords}, f"{name} requires {required}"


def test_caps_has_every_declared_field_and_requires_no_other(b12x):
    assert dataclasses.is_dataclass(b12x.Caps)
    fields = {f.name: f for f in dataclasses.fields(b12x.Caps) if f.init}
    assert set(b12x_runner.B12X_CAPS_FIELDS) <= set(fields)
    missing = dataclasses.MISSING
    required = {
        n for n, f in fields.items() if f.default is missing and f.default_factory is missing
    }
    assert required <= set(b12x_runner.B12X_CAPS_FIELDS)


def test_model_type_has_every_declared_member(b12x):
    for name in b12x_runner.B12X_MODEL_TYPES:
        assert isinstance(int(getattr(b12x.ModelType, name)), int), name


def plan_key(kv_format="fp8_ds_mla", *, rows=8, return_lse=True):
    return b12x_runner.PlanKey(
        torch.device("cpu"), kv_format, 16, 128, rows, 64, 576**-0.5, return_lse
    )


@pytest.mark.parametrize("kv_format", sorted(b12x_runner.B12X_RECIPE))
@pytest.mark.parametrize("return_lse", [False, True])
def test_the_runners_caps_and_plan_are_accepted(b12x, kv_format, return_lse):
    """Real ``Caps`` validation (recipe vs record bytes, lse scale) and ``plan``."""
    caps = b12x.Caps(**b12x_runner.caps_fields(b12x, plan_key(kv_format, return_lse=return_lse)))
    recipe = b12x_runner.B12X_RECIPE[kv_format]
    assert caps.model_type == int(getattr(b12x.ModelType, recipe))
    assert caps.cache_record_bytes == record_bytes(kv_format)
    assert (caps.lse_scale, caps.return_lse, caps.max_q_rows) == ("natural", return_lse, 8)
    plan = b12x.plan(caps)
    method, field = b12x_runner.B12X_PLAN_SCRATCH
    nbytes = getattr(getattr(plan, method)(), field)
    assert isinstance(nbytes, int) and nbytes > 0


def test_what_the_runner_binds_passes_b12x_binding_validation(b12x, monkeypatch):
    """run_b12x end to end on CPU with b12x's real Caps/plan and its real binding checks
    (``_scratch.plan_sparse_mla_scratch(caps).bind``, the validation ``bind`` runs after
    resolving the prepared plan, which needs a GPU); ``run`` only returns b12x's output
    views. Covers priming, a fused q view, copied q/indices/lengths and a rounded T."""
    scratch_module = importlib.import_module(f"{b12x_runner.B12X_MODULE}._scratch")
    caps_of: dict[int, object] = {}

    def plan(caps):
        planned = b12x.plan(caps)
        caps_of[id(planned)] = caps
        return planned

    def bind(plan, *, scratch, q, kv_cache, selected_indices, cache_lengths, selected_lengths):
        return scratch_module.plan_sparse_mla_scratch(caps_of[id(plan)]).bind(
            scratch=scratch,
            q=q,
            selected_indices=selected_indices,
            cache_seqlens_int32=cache_lengths,
            nsa_cache_seqlens_int32=selected_lengths,
            kv_cache=kv_cache,
        )

    def run(binding):
        rows, heads = binding.q.shape[:2]
        output = binding.scratch.output_buffer[:rows]
        lse = binding.scratch.final_lse[:rows, :heads]
        return output, lse  # every call below passes lse

    proxy = types.SimpleNamespace(Caps=b12x.Caps, ModelType=b12x.ModelType, plan=plan)
    proxy.bind, proxy.run = bind, run
    monkeypatch.setattr(b12x_runner, "b12x_module", lambda: proxy)
    b12x_runner.reset()
    try:
        h, k, page = 16, 128, 64
        pool = torch.zeros(4, 2, page, record_bytes("fp8_ds_mla"), dtype=torch.uint8)
        cache = pool[:, 1]  # pages interleaved with another layer's
        for t, fused, spaced in ((8, True, False), (8, False, True), (5, True, True)):
            if t == 5:
                b12x_runner.freeze()  # T=5 served by the T=8 plan
            full = torch.zeros(t, h, 576, dtype=torch.bfloat16)
            q_nope, q_pe = full[..., :512], full[..., 512:]
            if not fused:
                q_nope, q_pe = q_nope.clone(), q_pe.clone()
            wide = torch.full((t, k + 8), -1, dtype=torch.int32)
            lengths = torch.full((2 * t,), k, dtype=torch.int32)[::2] if spaced else None
            out = torch.empty(t, h, 512, dtype=torch.bfloat16)
            lse = torch.empty(t, h)
            assert b12x_runner.run_b12x(
                q_nope, q_pe, cache, wide[:, :k], lengths, out, lse, None,
                softmax_scale=576**-0.5, kv_format="fp8_ds_mla",
            )  # fmt: skip
        assert [key.rows for key in b12x_runner._plans] == [8]
    finally:
        b12x_runner.reset()
