"""Host microseconds per sparse-MLA ``forward_mqa`` call, device kernels stubbed (CPU only).

Ours (``B12XMLASparseImpl``, plan impl ``triton``) against vLLM's own sparse impls
(``FlashMLASparseImpl`` and ``FlashInferMLASparseSM120Impl``), side by side in one
process, on the same decode batch: one ``CommonAttentionMetadata`` per token count, from
which every impl's own metadata builder builds its metadata (ours:
``B12XMLASparseMetadataBuilder``; FlashMLA: ``FlashMLASparseMetadataBuilder``; SM120:
``FlashInferMLASparseMetadataBuilder``), one fp8_ds_mla cache (``[blocks, 64, 656]``
uint8) and one indexer-owned top-k buffer (int32 ``[max_tokens, topk]``).

Every device kernel (our two Triton kernels, stubbed at their launcher objects so our
launch Python is timed; vLLM's top-k conversion kernel, likewise; FlashMLA and
FlashInfer at their library entry points; vLLM's CUDA ``concat_mla_q``) is a no-op
returning preallocated outputs of the right shape and dtype; every other line of the
impls runs as it does on a GPU. Triton's own launcher is not timed (for anyone). Each
stub is listed in the JSON (``stubs``), with what it replaces and why. Torch's own ops
(views, ``torch.empty``, and upstream's ``torch.cat`` / head padding) run on CPU: a
one-call census per case (``census``: aten ops dispatched, bytes they moved) shows where
a figure includes CPU data movement, which on a GPU would be an asynchronous kernel.

Timing: every impl is warmed up (binding, freezing, lazy buffers), then each round times
``--calls`` back-to-back calls per impl with ``time.perf_counter_ns`` (impls interleaved,
order rotated every round, gc off while timing, one torch thread, under
``torch.inference_mode`` as vLLM's model runner); the figure is the median over rounds of
the per-call mean. ``floor_us`` is the same loop around a no-op.

    .venv-vllm/bin/python benchmarks/host_overhead.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

import torch

from vllm_mla.formats import FP8_DS_MLA_RECORD, HEAD_DIM, LATENT, PAGE_ROWS, ROPE

IMPLS = ("ours", "flashmla_sparse", "flashinfer_sm120")
UPSTREAM = {
    "flashmla_sparse": (
        "vllm.v1.attention.backends.mla.flashmla_sparse",
        "FlashMLASparseImpl",
        "FlashMLASparseMetadataBuilder",
    ),
    "flashinfer_sm120": (
        "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120",
        "FlashInferMLASparseSM120Impl",
        "vllm.v1.attention.backends.mla.flashinfer_mla_sparse.FlashInferMLASparseMetadataBuilder",
    ),
}
LAYER = "model.layers.0.self_attn.attn"
KV_LORA, NOPE, V_HEAD = LATENT, 128, 128
HEAD = HEAD_DIM
RECORD = FP8_DS_MLA_RECORD  # fp8_ds_mla bytes per token
ALLOC_OPS = ("empty.memory_format", "empty_strided", "new_empty", "empty_like")
HEAVY_BYTES = 256 << 10  # a census above this: the figure includes CPU data movement


# -- stubs ---------------------------------------------------------------------------------
class Stubs:
    """Monkeypatches, each recorded for the JSON (``target``, ``with``, ``why``, ``for``)."""

    def __init__(self) -> None:
        self.applied: list[dict] = []
        self._undo: list[tuple[object, str, object]] = []

    def set(self, owner: object, name: str, value: object, why: str, used_by: str) -> None:
        self._undo.append((owner, name, getattr(owner, name, None)))
        setattr(owner, name, value)
        where = getattr(owner, "__name__", type(owner).__name__)
        label = getattr(value, "__name__", type(value).__name__)
        self.applied.append(
            {"target": f"{where}.{name}", "with": label, "why": why, "for": used_by}
        )

    def note(self, target: str, value: str, why: str, used_by: str) -> None:
        self.applied.append({"target": target, "with": value, "why": why, "for": used_by})

    def undo(self) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()


def noop_kernel(*args, **kwargs) -> None:
    """A device kernel launch: no work, nothing returned (outputs were passed in)."""


class NoopStreamOrEvent:
    """Stands in for a CUDA stream or event (CPU has neither a wait_event nor an Event
    that records on a CPU stream)."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


NOOP_STREAM = NoopStreamOrEvent()


class NoopJIT:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` launches nothing."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __getitem__(self, grid) -> object:
        return noop_kernel


class Preallocated:
    """Outputs of a stubbed kernel, allocated once per shape key (first call: warmup)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, tuple] = {}

    def get(self, key: tuple, make) -> tuple:
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = make()
        return hit


def install_common_stubs(stubs: Stubs) -> None:
    """Stubs shared by every impl (vLLM's conversion kernel) and upstream's kernels."""
    import triton
    import vllm._custom_ops as vllm_ops
    import vllm.utils.flashinfer as vllm_flashinfer
    from vllm.v1.attention.backends.mla import flashmla_sparse, index_group, sparse_utils

    conv = "all (ours through its CUDA branch, see convert_to_physical)"
    stubs.set(
        sparse_utils,
        "_CONVERT_REQ_INDEX_TO_GLOBAL_INDEX_KERNEL",
        noop_kernel,
        "vLLM's Triton top-k logical->physical kernel (launcher object); its Python "
        "wrapper triton_convert_req_index_to_global_index still runs",
        conv,
    )
    stubs.set(
        sparse_utils,
        "triton",
        triton,
        "vLLM puts a Triton placeholder here when no GPU driver is active; the wrapper "
        "needs the real triton.next_power_of_2 (pure Python)",
        conv,
    )
    if not torch.accelerator.is_available():
        stubs.set(
            torch.accelerator,
            "empty_cache",
            lambda: None,
            "vLLM's workspace growth calls it; it raises without an accelerator",
            "all (setup only)",
        )
    stubs.set(
        index_group,
        "current_stream",
        lambda: NOOP_STREAM,
        "the index group's compute stream (CUDA stream on GPU; vLLM's CPU placeholder has "
        "no wait_event); its side stream and events are replaced per impl too: their "
        "CUDA calls (wait_event, record, stream switch) are not timed",
        "flashmla_sparse",
    )
    stubs.set(
        vllm_ops,
        "concat_mla_q",
        noop_kernel,
        "vLLM CUDA op (q_nope, q_pe -> workspace q)",
        "flashmla_sparse",
    )
    flash_outs = Preallocated()

    def flash_mla_with_kvcache(q, k_cache, block_table, head_dim_v, *args, **kwargs):
        b, s, h = q.shape[:3]

        def make():
            out = torch.empty(b, s, h, head_dim_v, dtype=q.dtype, device=q.device)
            return out, torch.empty(b, h, s, dtype=torch.float32, device=q.device)

        return flash_outs.get((b, s, h, head_dim_v, q.dtype), make)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, *args, **kwargs):
        t, h = q.shape[:2]

        def make():
            out = torch.empty(t, h, KV_LORA, dtype=q.dtype, device=q.device)
            stats = torch.empty(t, h, dtype=torch.float32, device=q.device)
            return out, stats, stats

        return flash_outs.get(("sparse_fwd", t, h, q.dtype), make)

    stubs.set(
        flashmla_sparse,
        "flash_mla_with_kvcache",
        flash_mla_with_kvcache,
        "FlashMLA sparse fp8 decode kernel (library wrapper included)",
        "flashmla_sparse",
    )
    stubs.set(
        flashmla_sparse,
        "flash_mla_sparse_fwd",
        flash_mla_sparse_fwd,
        "FlashMLA sparse bf16 prefill kernel (not on the decode path)",
        "flashmla_sparse",
    )
    stubs.set(
        flashmla_sparse,
        "get_mla_metadata",
        lambda *a, **k: (flashmla_sparse.FlashMLASchedMeta(), None),
        "FlashMLA scheduler metadata (CUDA op), called by the metadata builder only",
        "flashmla_sparse (metadata build, untimed)",
    )
    stubs.set(
        vllm_flashinfer,
        "flashinfer_trtllm_batch_decode_with_kv_cache_mla",
        lambda **kw: kw["out"],
        "FlashInfer trtllm-gen sparse MLA decode (library wrapper included); returns the "
        "out it was given, as FlashInfer does",
        "flashinfer_sm120",
    )


# -- the vLLM side: one config per head count ---------------------------------------------
def init_vllm_process() -> None:
    """One-process gloo group (vLLM's impls read TP/DCP groups) and the workspace manager.
    Off a GPU (the CPU smoke run), what the CUDA wheel lacks in CPU platform mode is stood
    in for first (``vllm_mla.vllm.cpu_platform_mode``: vLLM 0.34's triton-cpu gate)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker import workspace

    from vllm_mla.vllm import cpu_platform_mode

    cpu_platform_mode.install()

    bootstrap = make_config(16, 64, 4096)
    with set_current_vllm_config(bootstrap):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tempfile.mktemp(prefix='host-overhead-')}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    workspace.init_workspace_manager(torch.device("cpu"))


def make_config(heads: int, max_tokens: int, context: int):
    """A real VllmConfig: tiny DeepSeek-V3.2 geometry (MLA 512+64, index_topk 2048) with
    ``heads`` attention heads on this rank, fp8_ds_mla cache, 64-token blocks."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    hf = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": 256,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": V_HEAD,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "max_position_embeddings": context,
        "torch_dtype": "bfloat16",
        "first_k_dense_replace": 1,
    }
    folder = Path(tempfile.mkdtemp(prefix="host-overhead-cfg-"))
    (folder / "config.json").write_text(json.dumps(hf))
    model = ModelConfig(
        model=str(folder), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=context
    )
    batched = max(2 * max_tokens, 128)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=batched,
            max_num_seqs=max_tokens,
            max_model_len=context,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=PAGE_ROWS, cache_dtype="fp8_ds_mla"),
    )
    # The GPU path is what is modelled: every sparse backend reads 64-row pages there. vLLM's
    # CPU platform has just replaced them with its own MLA kernel's block (16, or 128 on AMX
    # hosts) while checking the config, whatever the host: put the GPU's back.
    config.cache_config.block_size = PAGE_ROWS
    # what MLAAttention registers: the builders read the layer's prefill backend (none:
    # every token is decode here)
    config.compilation_config.static_forward_context[LAYER] = SimpleNamespace(prefill_backend=None)
    return config


def kv_spec():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=PAGE_ROWS,
        num_kv_heads=1,
        head_size=HEAD,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
    )


def mla_kwargs() -> dict:
    return {
        "q_lora_rank": 256,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "qk_head_dim": NOPE + ROPE,
        "v_head_dim": V_HEAD,
        "kv_b_proj": torch.nn.Linear(2, 2),
    }


def impl_args(heads: int) -> tuple:
    """The positional arguments vLLM's MLAAttention passes every impl."""
    return (heads, HEAD, HEAD**-0.5, 1, None, None, "fp8_ds_mla", None, "decoder", None)


class Case:
    """One impl built for one head count: ``impl`` and ``metadata(cam)``."""

    def __init__(self, name: str, impl, metadata) -> None:
        self.name = name
        self.impl = impl
        self.metadata = metadata


def ours_case(config, heads: int, indexer, stubs: Stubs) -> Case:
    """Our impl, planned with impl='triton' (what a CUDA device without b12x runs) and
    prepared as vLLM's post-load does. Kept small: adapt here when preparation moves."""
    from vllm.config import set_current_vllm_config

    from vllm_mla import envs
    from vllm_mla.ops.sparse_mla import api, dispatch, triton_kernels
    from vllm_mla.vllm.sparse import impl as impl_mod
    from vllm_mla.vllm.sparse.impl import B12XMLASparseImpl
    from vllm_mla.vllm.sparse.metadata import B12XMLASparseMetadataBuilder

    def select_triton(device) -> str:
        return "triton"

    if not any(s["for"] == "ours" for s in stubs.applied):
        for name in ("_sparse_mla_split_kernel", "_sparse_mla_combine_kernel"):
            stubs.set(
                triton_kernels,
                name,
                NoopJIT(name),
                "our Triton kernel (launcher object, as vLLM's conversion kernel); our "
                "LaunchSite.launch Python still runs",
                "ours",
            )
        stubs.set(
            api,
            "select_impl",
            select_triton,
            "plan our impl as on a CUDA device without b12x (CPU picks 'reference')",
            "ours",
        )
        stubs.set(
            dispatch, "select_impl", select_triton, "as above (the dispatcher's own name)", "ours"
        )
        stubs.set(
            envs,
            "triton_interpret",
            lambda: True,
            "dispatch.resolve accepts impl='triton' for CPU tensors only under the Triton "
            "interpreter; on CUDA the check is device.type == 'cuda'",
            "ours",
        )
        stubs.set(
            impl_mod,
            "convert_to_physical",
            impl_mod.convert_with_vllm,
            "its CUDA branch (vLLM's triton_convert_req_index_to_global_index into the "
            "builder's buffer, kernel stubbed as for upstream) instead of the CPU torch "
            "fallback; the Triton plan timed here never calls it (its kernel maps the "
            "logical rows), so this only guards against a silent CPU fallback",
            "ours",
        )
    with set_current_vllm_config(config):
        impl = B12XMLASparseImpl(
            *impl_args(heads),
            indexer=indexer,
            topk_indices_buffer=indexer.topk_indices_buffer,
            **mla_kwargs(),
        )
        impl.process_weights_after_loading(torch.bfloat16)  # plan + prepare (launch stubbed)
        impl.reserve_workspace()  # the profile run
        builder = B12XMLASparseMetadataBuilder(kv_spec(), [LAYER], config, torch.device("cpu"))
    if impl.plan is None or impl.plan.impl != "triton":
        raise RuntimeError(f"ours: expected a 'triton' plan, got {impl.plan}")
    return Case("ours", impl, lambda cam: builder.build(0, cam))


def upstream_case(name: str, config, heads: int, indexer, stubs: Stubs) -> Case:
    """vLLM's impl ``name`` and its own metadata builder, as the layer builds them."""
    import importlib

    from vllm.config import set_current_vllm_config

    module_name, impl_name, builder_path = UPSTREAM[name]
    module = importlib.import_module(module_name)
    if "." in builder_path:
        builder_module, builder_name = builder_path.rsplit(".", 1)
        builder_cls = getattr(importlib.import_module(builder_module), builder_name)
    else:
        builder_cls = getattr(module, builder_path)
    with set_current_vllm_config(config):
        impl = getattr(module, impl_name)(
            *impl_args(heads),
            indexer=indexer,
            topk_indices_buffer=indexer.topk_indices_buffer,
            **mla_kwargs(),
        )
        builder = builder_cls(kv_spec(), [LAYER], config, torch.device("cpu"))
    group = getattr(impl, "index_group", None)
    if group is not None:  # CUDA side stream and events of the index group
        group.side_stream = NOOP_STREAM
        group.logical_topk_ready = NOOP_STREAM
        group.physical_topk_ready = NOOP_STREAM
    if hasattr(impl, "_workspace_buffer") and impl._workspace_buffer is None:
        # FlashInfer's 394 MiB workspace, allocated on the first call: its steady state
        impl._workspace_buffer = torch.empty(1 << 20, dtype=torch.int8)

    def metadata(cam):
        # vLLM's token -> request Triton kernel writes into the builder's buffer; here
        # the same values are filled in and handed over through the per-batch cache
        buffer = builder.req_id_per_token_buffer
        buffer[: cam.num_actual_tokens].copy_(token_to_request(cam))
        cam._token_to_req_indices_cache = buffer
        try:
            with set_current_vllm_config(config):
                return builder.build(0, cam)
        finally:
            cam._token_to_req_indices_cache = None

    return Case(name, impl, metadata)


def token_to_request(cam) -> torch.Tensor:
    starts = cam.query_start_loc_cpu
    lengths = (starts[1:] - starts[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(torch.int32)


def decode_batch(tokens: int, context: int, max_tokens: int, block_table: torch.Tensor):
    """``CommonAttentionMetadata`` of ``tokens`` decode requests, one token each."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.arange(tokens + 1, dtype=torch.int32)
    seq_lens = torch.full((tokens,), context, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=tokens,
        num_actual_tokens=tokens,
        max_query_len=1,
        max_seq_len=context,
        block_table_tensor=block_table[:tokens],
        slot_mapping=torch.arange(tokens, dtype=torch.int64) * 64,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )


def decode_query(tokens: int, heads: int, gen: torch.Generator):
    """(ql_nope [T, H, 512], q_pe [T, H, 64] strided), as MLAAttention passes them."""
    ql_nope = torch.randn(tokens, heads, KV_LORA, generator=gen).bfloat16()
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=gen).bfloat16()
    return ql_nope, q[..., NOPE:]


# -- census and timing ---------------------------------------------------------------------
def census(step) -> dict:
    """Aten ops one call dispatches, and the bytes the non-view, non-alloc ones wrote."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: dict[str, int] = {}
    moved: dict[str, int] = {}

    def nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, list | tuple):
            return sum(nbytes(v) for v in x)
        return 0

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.name().split("::")[-1]
            ops[name] = ops.get(name, 0) + 1
            if getattr(func, "is_view", False) or name in ALLOC_OPS:
                return out
            schema = func._schema
            written = [
                a.name
                for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write
            ]
            if written:
                values = dict(zip((a.name for a in schema.arguments), args, strict=False))
                values.update(kwargs)
                size = sum(nbytes(values.get(n)) for n in written)
            else:
                size = nbytes(out)
            if size:
                moved[name] = moved.get(name, 0) + size
            return out

    with Census():
        step()
    return {
        "aten_ops": sum(ops.values()),
        "ops": dict(sorted(ops.items())),
        "bytes_moved": sum(moved.values()),
        "moved_by": dict(sorted(moved.items())),
    }


def time_block(step, calls: int) -> float:
    """Mean microseconds per call over ``calls`` back-to-back calls."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        step()
    return (time.perf_counter_ns() - start) / calls / 1e3


def measure(steps: dict, calls: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per-round mean us per call for every step, interleaved, order rotated per round."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        gc.collect()
        gc.disable()
        try:
            for name in order:
                samples[name].append(time_block(steps[name], calls))
        finally:
            gc.enable()
    return samples


def _noop(q, kv_cache, attn_metadata, layer):
    return None, None


# -- main ----------------------------------------------------------------------------------
def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="200 calls x 5 rounds (smoke)")
    p.add_argument("--calls", type=int, help="calls per impl per round (default 2000)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 15)")
    p.add_argument("--warmup", type=int, help="untimed calls per impl first (default 100)")
    p.add_argument("--tokens", default="1,4,16,64", help="decode batch sizes")
    p.add_argument("--heads", default="16,128", help="heads per rank (GLM-5 TP4, DSV3.2 DP)")
    p.add_argument("--context", type=int, default=4096, help="tokens per request")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {IMPLS}")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args(argv)
    args.calls = args.calls or (200 if args.quick else 2000)
    args.rounds = args.rounds or (5 if args.quick else 15)
    args.warmup = args.warmup or (20 if args.quick else 100)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.heads = [int(h) for h in args.heads.split(",")]
    args.impls = [i for i in args.impls.split(",") if i]
    unknown = set(args.impls) - set(IMPLS)
    if unknown or "ours" not in args.impls:
        p.error(f"--impls: expected 'ours' and any of {IMPLS}, got {args.impls}")
    return args


def environment() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from common import environment as env
    except ImportError:
        return {"torch": torch.__version__, "python": sys.version.split()[0]}
    return env()


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    stubs = Stubs()
    install_common_stubs(stubs)
    init_vllm_process()
    import vllm
    from vllm.v1.worker import workspace

    max_tokens = max(args.tokens)
    topk = 2048
    buffer = torch.zeros(max(2 * max_tokens, 128), topk, dtype=torch.int32)
    buffer.copy_(torch.arange(topk, dtype=torch.int32).expand_as(buffer))  # valid logicals
    indexer = SimpleNamespace(topk_indices_buffer=buffer)  # the indexer owns the buffer
    blocks_per_req = -(-args.context // PAGE_ROWS)
    cache = torch.empty(max_tokens * blocks_per_req + 1, PAGE_ROWS, RECORD, dtype=torch.uint8)
    block_table = torch.arange(max_tokens * blocks_per_req, dtype=torch.int32) + 1
    block_table = block_table.view(max_tokens, blocks_per_req)

    impls: dict[str, dict] = {}
    cases: dict[int, dict[str, Case]] = {}
    block_sizes = set()
    for heads in args.heads:
        config = make_config(heads, max_tokens, args.context)
        block_sizes.add(config.cache_config.block_size)
        cases[heads] = {}
        for name in args.impls:
            entry = impls.setdefault(name, {"built": True, "heads": []})
            try:
                if name == "ours":
                    case = ours_case(config, heads, indexer, stubs)
                else:
                    case = upstream_case(name, config, heads, indexer, stubs)
            except Exception as exc:  # one impl that cannot be built: said why, not faked
                entry["built"] = False
                entry.setdefault("reason", {})[str(heads)] = f"{type(exc).__name__}: {exc}".strip()[
                    :2000
                ]
                entry.setdefault("traceback", traceback.format_exc(limit=6)[-3000:])
                continue
            cls = type(case.impl)
            entry["class"] = f"{cls.__module__}.{cls.__qualname__}"
            entry["heads"].append(heads)
            cases[heads][name] = case
    workspace.lock_workspace()  # vLLM locks it after CUDA-graph capture: serving state
    stubs.note(
        "vllm.v1.worker.workspace (lock_workspace)",
        "locked before timing",
        "the serving state after capture (ours freezes its session on the first call)",
        "all (setup, not a stub)",
    )

    results = []
    gen = torch.Generator().manual_seed(0)
    header = f"{'H':>4} {'T':>3} | {'ours':>9}"
    built = [n for n in args.impls if n != "ours" and any(n in c for c in cases.values())]
    for name in built:
        header += f" | {name + ' us':>22} {'ours/it':>7}"
    header += f" | {'floor':>5}"
    print(header)
    print("-" * len(header))
    for heads in args.heads:
        for tokens in args.tokens:
            cam = decode_batch(tokens, args.context, max_tokens, block_table)
            q = decode_query(tokens, heads, gen)
            steps, metadata = {}, {}
            for name, case in cases[heads].items():
                metadata[name] = case.metadata(cam)
                steps[name] = functools.partial(
                    case.impl.forward_mqa, q, cache, metadata[name], None
                )
            for name, step in steps.items():  # fail loudly before timing anything
                out, _ = step()
                if tuple(out.shape) != (tokens, heads, KV_LORA):
                    raise RuntimeError(f"{name}: out {tuple(out.shape)} at H={heads}, T={tokens}")
            counted = {name: census(step) for name, step in steps.items()}
            steps["floor"] = functools.partial(_noop, q, cache, None, None)
            samples = measure(steps, args.calls, args.rounds, args.warmup)
            median = {n: round(statistics.median(s), 3) for n, s in samples.items()}
            row = {
                "heads": heads,
                "tokens": tokens,
                "median_us": {n: median[n] for n in cases[heads]},
                "min_us": {n: round(min(samples[n]), 3) for n in cases[heads]},
                "max_us": {n: round(max(samples[n]), 3) for n in cases[heads]},
                "rounds_us": {n: [round(v, 3) for v in samples[n]] for n in cases[heads]},
                "ours_over": {
                    n: ratio(median.get("ours"), median[n]) for n in cases[heads] if n != "ours"
                },
                "floor_us": median["floor"],
                "census": counted,
            }
            results.append(row)
            line = f"{heads:>4} {tokens:>3} | {fmt(median.get('ours'), counted.get('ours'))}"
            for name in built:
                line += f" | {fmt(median.get(name), counted.get(name), 22)}"
                line += f" {row['ours_over'].get(name) or float('nan'):>7.2f}"
            print(line + f" | {median['floor']:>5.2f}", flush=True)
    print(
        f"(* a call moved > {HEAVY_BYTES >> 10} KiB on CPU: torch data ops that a GPU runs as "
        "asynchronous kernels are inside that figure; see census)"
    )
    for name, entry in impls.items():
        if not entry["built"]:
            print(f"{name}: not built: {entry['reason']}")
    stubs.undo()
    return {
        "benchmark": "host_overhead",
        "what": "host us per forward_mqa call, device kernels stubbed, decode batch",
        "env": {**environment(), "vllm": vllm.__version__, "torch_threads": args.threads},
        "config": {
            "tokens": args.tokens,
            "heads": args.heads,
            "topk": topk,
            "block_size": block_sizes.pop() if len(block_sizes) == 1 else sorted(block_sizes),
            "context": args.context,
            "kv_cache": f"fp8_ds_mla uint8 [blocks, {PAGE_ROWS}, {RECORD}] (CPU)",
            "q": "tuple (ql_nope [T,H,512] bf16, q_pe [T,H,64] bf16 strided)",
            "calls": args.calls,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "quick": args.quick,
            "statistic": "median over rounds of the per-call mean of a round",
        },
        "impls": impls,
        "stubs": stubs.applied,
        "results": results,
        "notes": [
            "Kernel stubs are at the library entry points (FlashMLA, FlashInfer, Triton "
            "launchers), so their own Python wrappers are not timed for anyone.",
            "Upstream's index-group CUDA stream/event calls are no-ops here: on a GPU they "
            "add their driver calls to flashmla_sparse.",
            "Torch ops run on CPU: views and allocations cost about what they cost on a GPU "
            "host; data ops (bytes_moved in census) run their data movement here.",
        ],
    }


def fmt(value: float | None, counted: dict | None, width: int = 9) -> str:
    if value is None:
        return f"{'-':>{width}}"
    mark = "*" if counted and counted["bytes_moved"] > HEAVY_BYTES else " "
    return f"{value:>{width - 1}.2f}{mark}"


def main(argv=None) -> int:
    args = parse(argv)
    with torch.inference_mode():
        report = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
