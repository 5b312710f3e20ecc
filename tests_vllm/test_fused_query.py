"""The fused query projection on vLLM's own decode path (``vllm_mla.vllm.fused_query``).

vLLM's real ``MLAAttention.forward_impl`` runs the decode step of a layer whose impl is one
of vLLM's own classes (FlashMLAImpl, FlashInferMLAImpl, TritonMLAImpl, CPUMLAImpl), built
without their constructors (which need a GPU) and with the attention kernel stubbed at the
call vLLM makes: the stub records the query the backend hands its kernel. For every impl:
fused, the kernel gets the one tensor our projection wrote (BF16, or FP8 through our
``_DecodeConcatQuantFP8``) and exactly one projection ran per layer-step; staged
(``VLLM_MLA_QUERY=staged``), vLLM's bmm + cat (+ quant) ran, and the two queries agree
within the contract (error models at each assertion). Every consumer is made to decline
once: vLLM's path then reads a complete bmm result (bit-identical to staged).

The Triton kernel runs in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before
Triton is first imported (its own ``tl`` functions are decorated then); in a session that
imported vLLM first, ``test_fused_kernel_runs_in_its_own_process`` runs the ``test_kernel_*``
tests in a fresh interpreter with it set.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm_layers
from torch import nn

from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops import query_fusion as qf
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.vllm import fused_query, telemetry

KERNEL_PROCESS = os.environ.get("TRITON_INTERPRET") == "1"  # set before Triton imported
needs_kernel = pytest.mark.skipif(
    not KERNEL_PROCESS, reason="runs in test_fused_kernel_runs_in_its_own_process"
)

H, P, R, L, V, B = 4, 128, 64, 512, 128, 3
MLA = "vllm.model_executor.layers.attention.mla_attention"
BACKENDS = "vllm.v1.attention.backends.mla"
# name -> (module, impl class, the kernel call(s) vLLM makes, takes an FP8 query)
IMPLS = {
    "FLASHMLA": ("flashmla", "FlashMLAImpl", ("flash_mla_with_kvcache",), True),
    "FLASHINFER_MLA": (
        "flashinfer_mla",
        "FlashInferMLAImpl",
        ("trtllm_batch_decode_with_kv_cache_mla",),
        True,
    ),
    "TRITON_MLA": ("triton_mla", "TritonMLAImpl", ("decode_attention_fwd",), False),
    "CPU_MLA": ("cpu_mla", "CPUMLAImpl", (), False),
}


def impl_module(backend: str):
    name = IMPLS[backend][0]
    try:
        return importlib.import_module(f"{BACKENDS}.{name}")
    except ImportError as exc:  # FlashInfer MLA needs the flashinfer package (not on CPU)
        pytest.skip(f"{name}: {exc}")


@pytest.fixture
def fused_env(monkeypatch):
    """The plugin registered (feature query: our _DecodeConcatQuantFP8) with a mode."""
    from vllm_mla.vllm import plugin

    def setup(mode: str, interpret: bool):
        monkeypatch.setenv("VLLM_MLA_QUERY", mode)
        if interpret:
            assert KERNEL_PROCESS
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        plugin.reset()
        return plugin.register()

    yield setup
    qf.disarm()


@contextmanager
def vllm_context():
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_layers.vllm_config()):
        yield


class Recorder:
    """The stubbed attention kernel: records the query, returns ``o = q[..., :L]`` (so the
    layer's output depends on every latent column of the query)."""

    def __init__(self):
        self.queries: list[torch.Tensor] = []

    def out_of(self, q: torch.Tensor) -> torch.Tensor:
        self.queries.append(q)
        return q[..., :L].to(torch.bfloat16)


def make_impl(backend: str, monkeypatch, recorder: Recorder, kv_cache_dtype: str):
    module = impl_module(backend)
    _, cls_name, kernels, _ = IMPLS[backend]
    cls = getattr(module, cls_name)
    impl = cls.__new__(cls)
    impl.__dict__.update(
        num_heads=H,
        kv_lora_rank=L,
        qk_nope_head_dim=P,
        qk_rope_head_dim=R,
        v_head_dim=V,
        scale=0.1,
        kv_cache_dtype=kv_cache_dtype,
        dcp_world_size=1,
        pcp_world_size=1,
        dcp_rank=0,
        need_to_return_lse_for_decode=False,
        supports_quant_query_input=IMPLS[backend][3],
        decode_sliding_window=None,  # vLLM 0.34's Triton MLA (no sliding window here)
    )
    impl.process_weights_after_loading = lambda act_dtype: None
    if backend == "FLASHMLA":
        for name in ("flash_mla_with_kvcache", "flash_mla_with_kvcache_fp8"):
            monkeypatch.setattr(
                module,
                name,
                lambda q, **kw: (recorder.out_of(q), torch.zeros(q.shape[0], H, q.shape[1])),
            )
    elif backend == "FLASHINFER_MLA":
        impl.__dict__.update(bmm1_scale=None, bmm2_scale=None, _mla_counter_bytes=None)
        monkeypatch.setattr(module, "_get_workspace_buffer", lambda return_lse: torch.empty(1))
        monkeypatch.setattr(module, "_select_mla_decode_backend", lambda num_heads: None)
        monkeypatch.setattr(module, kernels[0], lambda query, **kw: recorder.out_of(query))
    elif backend == "TRITON_MLA":
        impl.__dict__.update(_sm_count=4)
        # vLLM CPU's triton is a placeholder: the split count it would compute, stood in
        monkeypatch.setattr(module, "_compute_num_kv_splits", lambda max_seq_len, sm: 1)

        def decode_attention_fwd(q, kv, kv_c, o, lse, *args, **kwargs):
            o.copy_(recorder.out_of(q))

        monkeypatch.setattr(module, kernels[0], decode_attention_fwd)
    else:  # CPU_MLA: vLLM's CPU op, through the module's ops namespace

        def mla_decode_kvcache_cpu(out, q, *args):
            out.copy_(recorder.out_of(q))

        monkeypatch.setattr(module.ops, "mla_decode_kvcache_cpu", mla_decode_kvcache_cpu)
    return impl


def weights(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_uk_t = (torch.randn(H, P, L, generator=gen) * 0.05).to(dtype)
    w_uv = (torch.randn(H, L, V, generator=gen) * 0.05).to(dtype)
    return w_uk_t, w_uv


def make_layer(backend, impl, kv_cache_dtype, dtype=torch.bfloat16):
    """An MLAAttention holding what ``forward_impl``'s decode branch reads."""
    mla = importlib.import_module(MLA)
    layer = mla.MLAAttention.__new__(mla.MLAAttention)
    nn.Module.__init__(layer)
    layer.__dict__.update(
        num_heads=H,
        qk_nope_head_dim=P,
        qk_rope_head_dim=R,
        kv_lora_rank=L,
        v_head_dim=V,
        kv_cache_dtype=kv_cache_dtype,
        impl=impl,
        q_pad_num_heads=None,
        is_aiter_triton_fp4_bmm_enabled=False,
        is_aiter_triton_fp8_bmm_enabled=False,
        is_amx_bmm_enabled=False,
        use_pcp=False,
        use_direct_call=False,
        dcp_manager=None,
        W_UV_dcp=None,  # vLLM 0.34 (its DCP v-up-projection combine's gathered W_UV)
        prefill_backend=None,
        layer_name="model.layers.0.self_attn.attn",
        _q_scale_float=0.05,
        _k_scale_float=1.0,
    )
    layer.attn_backend = SimpleNamespace(get_name=lambda: backend)
    layer._q_scale = torch.tensor(0.05, dtype=torch.float32)
    layer._k_scale = torch.tensor(1.0, dtype=torch.float32)
    w_uk_t, w_uv = weights(dtype)
    layer.W_UK_T = nn.Parameter(w_uk_t, requires_grad=False)
    layer.W_UV = nn.Parameter(w_uv, requires_grad=False)
    with vllm_context():
        op = mla._DecodeConcatQuantFP8(
            static=True, group_shape=mla.GroupShape.PER_TENSOR, compile_native=True
        )
    op._forward_method = op.forward_native  # vLLM's eager native path (no Inductor here)
    layer._decode_concat_quant_fp8_op = op
    return layer


def metadata(backend):
    decode = SimpleNamespace(
        block_table=torch.zeros(B, 1, dtype=torch.int32),
        seq_lens=torch.full((B,), 4, dtype=torch.int32),
        scheduler_metadata=SimpleNamespace(tile_scheduler_metadata=None, num_splits=None),
        max_query_len=1,
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
        dcp_tot_seq_lens=None,
    )
    return SimpleNamespace(
        num_actual_tokens=B,
        num_decodes=B,
        num_prefills=0,
        num_decode_tokens=B,
        decode=decode,
        prefill=None,
        causal=True,
        max_seq_len=4,
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
    )


def step(layer, backend, dtype=torch.bfloat16, seed=1):
    """One decode layer-step through vLLM's forward_impl; (output, queries recorded)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, P + R, generator=gen).to(dtype)
    k_c = torch.randn(B, L, generator=gen).to(dtype)
    k_pe = torch.randn(B, 1, R, generator=gen).to(dtype)
    cache_dtype = torch.uint8 if "fp8" in layer.kv_cache_dtype else dtype
    kv_cache = torch.zeros(2, 16, L + R, dtype=cache_dtype)
    output = torch.empty(B, H * V, dtype=dtype)
    layer.forward_impl(q, k_c, k_pe, kv_cache, metadata(backend), output)
    return output, q


def run(backend, monkeypatch, fused_env, mode, kv="auto", interpret=True, dtype=torch.bfloat16):
    fused_env(mode, interpret)
    recorder = Recorder()
    impl = make_impl(backend, monkeypatch, recorder, kv)
    layer = make_layer(backend, impl, kv, dtype)
    decided = fused_query.bind(layer, "layer")
    telemetry.reset()
    output, q = step(layer, backend, dtype)
    return SimpleNamespace(
        layer=layer, plan=decided, output=output, q=q, recorder=recorder, calls=qf.calls()
    )


def bf16_ulp(x):
    _, exponent = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_within_contract(got, want, q, w_uk_t):
    """One BF16 ulp (two half-ulp roundings of the same value: the kernel's and torch's)
    plus P * 2**-23 * sum|q w| (two fp32 sums of P = 128 terms in other orders)."""
    terms = torch.bmm(q[..., :P].float().abs().transpose(0, 1), w_uk_t.float().abs())
    terms = terms.transpose(0, 1)
    tol = bf16_ulp(torch.maximum(got.float().abs(), want.float().abs())) + P * 2.0**-23 * terms
    assert ((got.float() - want.float()).abs() <= tol).all()


def e4m3_step(x):
    """Spacing of e4m3 values at |x| (normal: 3 mantissa bits; below 2**-6: 2**-9)."""
    _, exponent = torch.frexp(x.float().abs())
    return torch.where(
        x.float().abs() < 2.0**-6,
        torch.full_like(x, 2.0**-9, dtype=torch.float32),
        torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 4),
    )


@needs_kernel
@pytest.mark.parametrize("backend", list(IMPLS))
def test_kernel_impl_gets_the_one_tensor_the_projection_wrote(backend, monkeypatch, fused_env):
    staged = run(backend, monkeypatch, fused_env, "staged")
    assert staged.plan.consumer is None and staged.calls == {}
    (want,) = staged.recorder.queries
    spy = []
    real = qf.project_bf16
    monkeypatch.setattr(qf, "project_bf16", lambda *a: spy.append(real(*a)) or spy[-1])
    fused = run(backend, monkeypatch, fused_env, "fused")
    assert fused.plan.consumer == "forward_mqa" and fused.plan.kernel
    assert fused.calls == {"forward_mqa:triton": 1}  # one projection per layer-step
    assert ab.calls() == {}  # ... and no bmm ran: it was deferred into it
    (got,) = fused.recorder.queries
    assert len(spy) == 1 and got.data_ptr() == spy[0].data_ptr()  # what we wrote, no copy
    assert got.shape[-1] == L + R and torch.equal(fused.q, staged.q)
    assert torch.equal(got.reshape(B, H, L + R)[..., L:], staged.q[..., P:])
    want = want.reshape(B, H, L + R)
    assert_within_contract(
        got.reshape(B, H, L + R)[..., :L], want[..., :L], staged.q, weights(torch.bfloat16)[0]
    )


@needs_kernel
@pytest.mark.parametrize("backend", ["FLASHMLA", "FLASHINFER_MLA"])
def test_kernel_fp8_query_comes_from_the_projection(backend, monkeypatch, fused_env):
    staged = run(backend, monkeypatch, fused_env, "staged", kv="fp8")
    fused = run(backend, monkeypatch, fused_env, "fused", kv="fp8")
    assert fused.plan.consumer == "concat_quant_fp8"
    assert type(fused.layer._decode_concat_quant_fp8_op).__qualname__ == fused_query.OP_NAME
    assert fused.calls == {"concat_quant_fp8:triton": 1} and ab.calls() == {}
    (want,), (got,) = staged.recorder.queries, fused.recorder.queries
    assert got.dtype == want.dtype == torch.float8_e4m3fn
    got, want = got.reshape(B, H, L + R).float(), want.reshape(B, H, L + R).float()
    # vLLM quantizes x * (1 / s), the projection e4m3(x / s) (query_projection's rule):
    # the fp32 quotients differ by <= 1 fp32 ulp, and the bf16 inputs by <= 1 bf16 ulp
    # (test above); either moves a code by at most one e4m3 step, and only where the value
    # lies that close to a rounding point: a few in 1e3 of the codes (1% bound).
    assert ((got - want).abs() <= e4m3_step(torch.maximum(got.abs(), want.abs()))).all()
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("backend", ["CPU_MLA", "TRITON_MLA"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_equals_staged_bit_for_bit(backend, dtype, monkeypatch, fused_env):
    """Off the kernel (fp32 CPU engines, or TRITON_INTERPRET unset here) the projection runs
    the weight's own bmm into the query and copies q_pe: the staged values exactly."""
    staged = run(backend, monkeypatch, fused_env, "staged", interpret=False, dtype=dtype)
    fused = run(backend, monkeypatch, fused_env, "fused", interpret=False, dtype=dtype)
    assert fused.plan.consumer == "forward_mqa" and not fused.plan.kernel
    assert fused.calls == {"forward_mqa:torch": 1}
    assert torch.equal(fused.recorder.queries[0], staged.recorder.queries[0])
    assert torch.equal(fused.output, staged.output)
    assert isinstance(fused.layer.W_UK_T, AbsorbedWeight) and fused.layer.W_UK_T.path == "torch"


def decline(monkeypatch, consumer):
    """Make ``consumer`` decline every pending bmm (as a q_pe of another width would)."""
    real = qf._claim

    def claim(ql_nope, q_pe, scale_ub):
        p = qf.SLOT.pending
        if p is not None:
            qf.SLOT.pending = None
            qf._flush(p, "declined")
        return None

    monkeypatch.setattr(qf, "_claim", claim)
    return real


@pytest.mark.parametrize(
    ("backend", "kv"), [("CPU_MLA", "auto"), ("FLASHMLA", "auto"), ("FLASHMLA", "fp8")]
)
def test_every_consumer_can_decline_and_no_value_is_missing(backend, kv, monkeypatch, fused_env):
    staged = run(backend, monkeypatch, fused_env, "staged", kv=kv, interpret=False)
    decline(monkeypatch, backend)
    fused = run(backend, monkeypatch, fused_env, "fused", kv=kv, interpret=False)
    assert fused.plan.consumer is not None
    assert fused.calls == {"flushed:declined": 1}
    assert ab.calls() == {"torch:W_UK_T": 1}  # the bmm ran (late), upstream's torch.bmm
    for got, want in zip(fused.recorder.queries, staged.recorder.queries, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(fused.output, staged.output)


@pytest.mark.parametrize(
    ("why", "change"),
    [
        ("backend 'CUTLASS_MLA': no consumer of ours", {"backend": "CUTLASS_MLA"}),
        ("DCP/PCP", {"dcp_world_size": 2}),
        ("padded query heads", {"q_pad_num_heads": 16}),
        ("is_amx_bmm_enabled", {"is_amx_bmm_enabled": True}),
        ("forward_impl is traced", {"use_direct_call": True}),
        ("the FP8 concat+quant op is not ours", {"kv": "fp8", "stock_op": True}),
        ("auto: the fused kernel", {"mode": "auto"}),
    ],
)
def test_the_gate_leaves_layers_staged(why, change, monkeypatch, fused_env):
    fused_env(change.get("mode", "fused"), interpret=False)
    backend = change.get("backend", "FLASHMLA")
    kv = change.get("kv", "auto")
    impl = make_impl("FLASHMLA", monkeypatch, Recorder(), kv)
    impl.dcp_world_size = change.get("dcp_world_size", 1)
    layer = make_layer(backend, impl, kv)
    for key in ("q_pad_num_heads", "is_amx_bmm_enabled", "use_direct_call"):
        if key in change:
            layer.__dict__[key] = change[key]
    if change.get("stock_op"):  # a layer built while another plugin held the OOT slot
        from vllm.model_executor.custom_op import op_registry_oot

        mla = importlib.import_module(MLA)
        ours = op_registry_oot.pop("_DecodeConcatQuantFP8")
        try:
            with vllm_context():
                layer._decode_concat_quant_fp8_op = mla._DecodeConcatQuantFP8(
                    static=True, group_shape=mla.GroupShape.PER_TENSOR
                )
        finally:
            op_registry_oot["_DecodeConcatQuantFP8"] = ours
    decided = fused_query.bind(layer)
    assert decided.consumer is None and why in decided.why
    assert "forward_impl" not in layer.__dict__ and "forward_mqa" not in impl.__dict__


def test_bind_is_idempotent_and_staged_unbinds(monkeypatch, fused_env):
    fused_env("fused", interpret=False)
    impl = make_impl("CPU_MLA", monkeypatch, Recorder(), "auto")
    layer = make_layer("CPU_MLA", impl, "auto")
    fused_query.bind(layer)
    first = layer.W_UK_T
    fused_query.bind(layer)  # a reload's post-load binds again
    assert layer.W_UK_T is first and first.fusion is not None
    assert not getattr(layer.forward_impl.__wrapped__, fused_query.WRAPPED, False)
    assert not getattr(impl.forward_mqa.__wrapped__, fused_query.WRAPPED, False)
    monkeypatch.setenv("VLLM_MLA_QUERY", "staged")
    assert fused_query.bind(layer).consumer is None
    assert "forward_impl" not in layer.__dict__ and "forward_mqa" not in impl.__dict__
    assert layer.W_UK_T.fusion is None


def test_plugin_registers_our_op_under_vllms_name(fused_env):
    result = fused_env("auto", interpret=False)
    assert "fused query projection" in result["query"]
    from vllm.model_executor.custom_op import op_registry_oot

    mla = importlib.import_module(MLA)
    ours = op_registry_oot["_DecodeConcatQuantFP8"]
    assert ours.__qualname__ == fused_query.OP_NAME
    assert ours.name == mla._DecodeConcatQuantFP8.name == "mla_decode_concat_quant_fp8"
    with vllm_context():
        op = mla._DecodeConcatQuantFP8(static=True, group_shape=mla.GroupShape.PER_TENSOR)
    assert type(op) is ours
    from vllm_mla.vllm import plugin

    plugin.reset()
    assert "_DecodeConcatQuantFP8" not in op_registry_oot


def test_staged_mode_registers_nothing(fused_env):
    result = fused_env("staged", interpret=False)
    assert "VLLM_MLA_QUERY=staged" in result["query"]
    from vllm.model_executor.custom_op import op_registry_oot

    assert "_DecodeConcatQuantFP8" not in op_registry_oot


def test_post_load_binds_every_load_and_reload(monkeypatch, fused_env):
    """Through the plugin's post-load patch on vLLM's kv_b_proj (default dims: P = 96, so
    the torch path): bound at load, bound again at vLLM's layerwise reload."""
    from conftest import model_with, reload_through_vllm

    fused_env("fused", interpret=False)
    mla = importlib.import_module(MLA)
    monkeypatch.setattr(mla, "set_default_quant_scales", lambda *a, **k: None)
    model = model_with("bf16", backend="CPU_MLA")
    layer = model.attn
    telemetry.reset()
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    assert telemetry.snapshot()["query"] == {"bind:forward_mqa:torch": 1}
    first = layer.W_UK_T
    assert isinstance(first, AbsorbedWeight) and first.fusion is not None
    assert first.path == "torch"  # upstream's torch.bmm for every bmm that is not deferred
    assert "forward_impl" in layer.__dict__ and "forward_mqa" in layer.impl.__dict__
    reload_through_vllm(model, seed=1, fmt="bf16")
    assert telemetry.snapshot()["query"] == {"bind:forward_mqa:torch": 2}
    again = layer.W_UK_T
    assert isinstance(again, AbsorbedWeight) and again.fusion is not None
    assert again.fusion is not first.fusion and again._values.data_ptr() == first._values.data_ptr()
    assert not getattr(layer.forward_impl.__wrapped__, fused_query.WRAPPED, False)


def _flat(source: str) -> str:
    """Source with its whitespace folded (line breaks and indentation differ by version)."""
    return " ".join(source.split())


def test_vllm_source_is_what_the_consumers_rely_on():
    """The decode branch: the bmm into a token-major buffer, then the FP8 op or the tuple,
    with no reader between (DCP excluded by the gate), then forward_mqa (0.34: through
    ``_prepare_mqa_query``, with only ShardQ between, excluded by the gate too); the
    wrapped impls concatenate a tuple before anything else reads q."""
    mla = importlib.import_module(MLA)
    forward = _flat(inspect.getsource(mla.MLAAttention.forward_impl))
    prepare_fn = getattr(mla.MLAAttention, "_prepare_mqa_query", None)
    query = forward if prepare_fn is None else _flat(inspect.getsource(prepare_fn))
    bmm = "torch.bmm(mqa_q_nope, W_UK_T, out=mqa_ql_nope.transpose(0, 1))"
    op = "mqa_q = self._decode_concat_quant_fp8_op( mqa_ql_nope, mqa_q_pe, self._q_scale )"
    assert bmm in query and op in query and "mqa_q = (mqa_ql_nope, mqa_q_pe)" in query
    end = "self.impl.forward_mqa(mqa_q" if prepare_fn is None else "return mqa_q"
    between = query[query.index(bmm) + len(bmm) : query.index(end)]
    assert between.count("mqa_ql_nope") == 5  # the two shape asserts, the op, the tuple
    assert "torch.cat(mqa_q" in between and "dcp_world_size > 1" in between
    if prepare_fn is not None:  # vLLM 0.34: forward_impl's call, then only ShardQ
        call = "mqa_q = self._prepare_mqa_query(q[:num_mqa_tokens], qrep_decode=False)"
        consumer = "attn_out, lse = self.impl.forward_mqa(mqa_q, kv_cache, mqa_metadata, self)"
        after = forward[forward.index(call) + len(call) : forward.index(consumer)]
        sharded = "if shardq is not None: decode_q, mqa_q = shard_q(mqa_q, shardq)"
        assert sharded in after and after.replace(sharded, "").count("mqa_q") == 0
        shardq = _flat(inspect.getsource(mla.MLAAttention.__init__))
        assert "self.use_shardq = shardq_eligible and" in shardq
    for backend, (name, cls_name, *_) in IMPLS.items():
        try:
            module = importlib.import_module(f"{BACKENDS}.{name}")
        except ImportError:
            continue
        body = inspect.getsource(getattr(module, cls_name).forward_mqa)
        cat = body.index("torch.cat(")
        assert "tuple" in body[:cat], backend
    fp8 = _flat(inspect.getsource(mla._DecodeConcatQuantFP8))
    assert "def forward( self, decode_ql_nope" in fp8


def test_shardq_layers_are_not_fused(monkeypatch, fused_env):
    """vLLM 0.34's ShardQ slices mqa_q between the projection and forward_mqa: a layer with
    it on keeps the staged query."""
    fused_env("fused", interpret=False)
    impl = make_impl("CPU_MLA", monkeypatch, Recorder(), "auto")
    layer = make_layer("CPU_MLA", impl, "auto")
    assert fused_query.plan(layer).consumer == "forward_mqa"
    layer.use_shardq = True
    decided = fused_query.plan(layer)
    assert decided.consumer is None and "ShardQ" in decided.why


def test_dsa_row_layout_hands_b12x_one_buffer(monkeypatch, fused_env):
    """B12X_MLA_SPARSE with a b12x plan on fp8_ds_mla: W_UK_T gets the row layout, the
    DSA forward's ql_nope is the left part of one buffer, and the wrapped forward_mqa
    passes the whole query after copying q_pe only."""
    fused_env("auto", interpret=False)
    seen = []
    impl = SimpleNamespace(
        plan=SimpleNamespace(impl="b12x"),
        kv_format="fp8_ds_mla",
        dcp_world_size=1,
        forward_mqa=lambda q, kv, meta, layer: seen.append(q),
    )
    layer = make_layer("B12X_MLA_SPARSE", impl, "fp8_ds_mla")
    decided = fused_query.bind(layer)
    assert decided.rows == L + R and layer.W_UK_T.row_width == L + R
    q = torch.randn(5, H, P + R).bfloat16()
    q_nope, q_pe = q.split([P, R], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)
    rope = q_pe.clone() * 2  # vLLM's fused_q returns the RoPE'd q_pe as a new tensor
    qf.reset_calls()
    impl.forward_mqa((ql_nope[:4], rope[:4]), None, None, layer)
    (got,) = seen
    assert torch.is_tensor(got) and got.shape == (4, H, L + R) and got.is_contiguous()
    assert got.data_ptr() == ql_nope.data_ptr() and torch.equal(got[..., L:], rope[:4])
    assert qf.calls() == {"rows:copy_pe": 1}
    impl.plan = SimpleNamespace(impl="triton")  # the Triton plan reads the two pieces
    assert fused_query.bind(layer).rows == 0
    impl.plan = SimpleNamespace(impl="b12x")
    layer.qk_rope_head_dim = 0  # GLM-5.3-Flash's geometry: no [latent | rope] rows
    assert fused_query.bind(layer).rows == 0


def test_fused_kernel_runs_in_its_own_process():
    """The ``test_kernel_*`` tests in a fresh interpreter with ``TRITON_INTERPRET=1`` set
    before Triton is imported (module docstring)."""
    if KERNEL_PROCESS:
        pytest.skip("this is that process")
    root = Path(__file__).resolve().parents[1]
    pytest_args = ["-q", "-p", "no:cacheprovider", "-k", "test_kernel_", "-W", "ignore"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args, str(Path(__file__))],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    # 4 BF16 impls + 2 FP8 ones; FlashInfer MLA's two skip only where flashinfer is absent
    missing = importlib.util.find_spec("flashinfer") is None
    assert re.search(rf"\b{4 if missing else 6} passed", result.stdout), tail
    assert result.stdout.count("No module named 'flashinfer'") == (1 if missing else 0), tail
